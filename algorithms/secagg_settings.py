"""Secure aggregation's parameters (`secure_aggregation.*`), what they may be combined with,
and the neighbour graph; both ends of the protocol compute them from the same config.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedcore.kernel import registry
from fedcore.kernel.config import declare, lives_elsewhere, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.schema import clients_per_round

__all__ = ["MERSENNE_61", "Settings", "neighbour_graph"]

MERSENNE_61 = 2 ** 61 - 1


@registry.components.register("secagg_roster")
def write_roster(folder, ids: list[int]):
    """The operator's part, for fedcore.launch: one signing key per client and their roster
    (`secagg_identity.write_roster`; cryptography is imported only here)."""
    from fedcore.algorithms.secagg_identity import write_roster as write
    return write(folder, ids)

declare("secure_aggregation.enabled", bool, False, "secure aggregation (SecAgg+): the server learns "
        "only the sum of each round's updates")
declare("secure_aggregation.num_neighbours", int, 0, "k: the clients each client shares secrets and "
        "pairwise masks with (even; 0: all others of the round, the full graph)",
        check=lambda v: None if v >= 0 and v % 2 == 0 else "must be an even number >= 0")
declare("secure_aggregation.threshold", int, None, "t: shares needed to rebuild a client's secret, "
        "and the fewest survivors a round may have (default: half the neighbours, plus one)",
        check=positive)
declare("secure_aggregation.clip", float, 1.0, "c: each coordinate of an update delta is clipped to "
        "[-c, c] before quantization", check=positive)
declare("secure_aggregation.bits", int, 16, "quantization levels 2^bits over [-c, c]; the sum is exact "
        "to c / (2^bits - 1) per coordinate of the mean",
        check=lambda v: None if 1 <= v <= 30 else "must be in 1..30")
declare("secure_aggregation.modulus", int, MERSENNE_61, "p: the prime field of masked inputs (< 2^62)",
        check=lambda v: None if 2 < v < 2 ** 62 else "must be a prime below 2^62")
declare("secure_aggregation.stage_timeout", float, None, "seconds the server waits for a stage's "
        "replies before going on without the silent clients (default: in simulation with device "
        "dropouts, twice the slowest modelled round trip; otherwise none: a deployed server drops a "
        "client silent past its stage's derived deadline, see distribute.deadline_factor)",
        check=positive)
declare("secure_aggregation.roster", str, None, "deployment: JSON file {client id: Ed25519 public key "
        "hex} the operator gives every process out of band; the keys clients sign with (fedcore.launch "
        "writes a fresh one; in simulation every key is made in-process)")
declare("secure_aggregation.signing_key", str, None, "deployed client: file holding its Ed25519 "
        "private key (hex), whose public key is its entry in secure_aggregation.roster")
declare("secure_aggregation.signature_quorum", int, None, "signatures from survivors a client needs on "
        "the survivor set before it reveals shares (default: a majority of the clients per round, at "
        "least the threshold; raise it to (clients + colluders) / 2 + 1 to tolerate colluding clients)",
        check=positive)
for _name in ("secagg", "secaggplus", "secure_aggregation"):
    lives_elsewhere("algorithm.name", _name, "secure_aggregation.enabled=true (with a FedAvg-style algorithm.name)")

# algorithms whose server rule needs more than the weighted mean of the models
_REFUSED = {"scaffold": "its control variates are averaged alongside the model",
            "feddyn": "its server state is built from every client's model",
            "fedasync": "it mixes single updates asynchronously",
            "fedbuff": "it buffers single updates asynchronously"}


@validator
def _check(cfg) -> None:
    if not cfg["secure_aggregation.enabled"]:
        return
    off = "or set secure_aggregation.enabled=false"
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise ConfigError("secure_aggregation.enabled: needs the 'cryptography' package: "
                          "pip install 'fedcore[secagg]'") from None
    if cfg["aggregator.robust_rule"] != "none":
        raise ConfigError("aggregator.robust_rule: robust rules need each update, which secure "
                          f"aggregation hides from the server; set aggregator.robust_rule=none {off}")
    name = cfg["algorithm.name"]
    if name in _REFUSED:
        raise ConfigError(f"algorithm.name: {name} cannot be aggregated securely ({_REFUSED[name]}); "
                          f"use fedavg, fedprox, moon, fedmos or diloco {off}")
    if cfg["attack.type"] != "none":
        raise ConfigError(f"attack.type: simulated attackers send plain updates, which a secure course "
                          f"refuses; set attack.type=none {off}")
    if cfg["asyn.use"]:
        raise ConfigError(f"asyn.use: secure aggregation needs synchronous rounds; set asyn.use=false {off}")
    role = cfg["distribute.role"]
    if role is not None and not cfg["secure_aggregation.roster"]:
        raise ConfigError("secure_aggregation.roster: a deployed secure course needs the operator's roster "
                          "of client signing keys (fedcore.launch writes one; python -m "
                          f"fedcore.algorithms.secagg_identity --out DIR --clients N makes one) {off}")
    if role == "client" and not cfg["secure_aggregation.signing_key"]:
        raise ConfigError("secure_aggregation.signing_key: a deployed secure client needs its signing key "
                          f"file, the private half of its roster entry {off}")
    from fedcore.algorithms.secagg_crypto import is_prime
    if not is_prime(cfg["secure_aggregation.modulus"]):
        raise ConfigError(f"secure_aggregation.modulus: {cfg['secure_aggregation.modulus']} is not prime "
                          f"(e.g. {MERSENNE_61} = 2^61 - 1)")
    settings = Settings.of(cfg)
    m, k_eff = settings.per_round, settings.neighbours_each
    t = settings.threshold(k_eff)
    if m < 2 or t > k_eff:
        raise ConfigError(f"secure_aggregation.threshold: {t} exceeds the {k_eff} neighbour(s) a client "
                          f"has with {m} clients per round; lower it or sample more clients")
    quorum = cfg["secure_aggregation.signature_quorum"]
    if quorum is not None and quorum > m:
        raise ConfigError(f"secure_aggregation.signature_quorum: {quorum} exceeds the {m} clients per round; "
                          "no survivor set could gather it")


@dataclass(frozen=True)
class Settings:
    """The protocol's parameters, as both ends compute them from the same config."""

    neighbours: int
    fixed_threshold: int | None
    clip: float
    bits: int
    modulus: int
    per_round: int
    fixed_quorum: int | None
    uniform: bool             # every client weighs 1 (central DP; uniform weighting, DiLoCo's default)
    dp_clip: float | None     # central DP: the L2 bound each client applies to its delta

    @classmethod
    def of(cls, cfg) -> "Settings":
        central = cfg["privacy.dp.mode"] == "central"
        uniform = central or cfg["aggregator.weighting"] == "uniform" or (
            cfg["algorithm.name"] == "diloco" and cfg["algorithm.diloco.aggregation_weighting"] == "uniform")
        return cls(cfg["secure_aggregation.num_neighbours"], cfg["secure_aggregation.threshold"],
                   cfg["secure_aggregation.clip"], cfg["secure_aggregation.bits"],
                   cfg["secure_aggregation.modulus"], clients_per_round(cfg),
                   cfg["secure_aggregation.signature_quorum"], uniform,
                   cfg["privacy.dp.clip_norm"] if central else None)

    @property
    def neighbours_each(self) -> int:
        """k: each client's neighbours with `per_round` clients a round (0 configured: all others)."""
        m = self.per_round
        return m - 1 if self.neighbours == 0 or self.neighbours >= m - 1 else self.neighbours

    def threshold(self, neighbours: int) -> int:
        return self.fixed_threshold if self.fixed_threshold is not None else neighbours // 2 + 1

    def quorum(self, threshold: int) -> int:
        """Signatures needed on a survivor set: two different sets cannot both gather a majority
        of the round's clients when each honest client signs one set per round."""
        if self.fixed_quorum is not None:
            return self.fixed_quorum
        return max(threshold, self.per_round // 2 + 1)

    @staticmethod
    def names(model: dict[str, torch.Tensor]) -> list[str]:
        """The entries that travel masked, in one order both ends agree on."""
        return sorted(n for n, t in model.items() if t.is_floating_point())

    def client_weight(self, num_samples: int) -> int:
        return 1 if self.uniform else int(num_samples)

    def check_headroom(self, weight: int) -> None:
        """The field must hold the round's largest possible sum, or it would wrap around."""
        if weight * ((1 << self.bits) - 1) * self.per_round >= self.modulus:
            raise ValueError(f"secure_aggregation: a weight of {weight} with {self.bits} bits and "
                             f"{self.per_round} clients may overflow the field; lower "
                             "secure_aggregation.bits or raise secure_aggregation.modulus")


def neighbour_graph(ids: list[int], k: int, seed: int, round_: int) -> dict[int, list[int]]:
    """Each client's neighbours: all others (k = 0 or k >= n - 1), else the k nearest on a ring
    in a seeded random order (a k-regular graph, as in SecAgg+)."""
    ids = sorted(ids)
    n = len(ids)
    if k == 0 or k >= n - 1:
        return {u: [v for v in ids if v != u] for u in ids}
    ring = [ids[i] for i in np.random.default_rng([seed % 2 ** 32, 0x5EC, round_]).permutation(n)]
    pos = {u: i for i, u in enumerate(ring)}
    return {u: sorted(ring[(pos[u] + d) % n] for d in range(-(k // 2), k // 2 + 1) if d) for u in ids}
