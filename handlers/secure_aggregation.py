"""Secure aggregation (SecAgg+, Bell et al. 2020; the full graph is Bonawitz et al. 2017):
the server learns the sum of the round's updates and nothing else about any one of them.

A behaviour switched on by `secure_aggregation.enabled`. It replaces the
synchronous round's exchange of plain updates with four stages, each a
message type answered by the clients and a condition event raised on the
server when the stage's replies are in (or the stage timed out, or a
deployment lost the missing clients):

1. `models` -> clients train, quantize their update, keep it, and advertise two
   X25519 public keys (`secagg_public_keys`) -> `secagg_keys_collected`;
2. `secagg_neighbour_keys` (each client's neighbours in a k-regular graph, or all
   others) -> clients Shamir-share their mask key and a fresh self-mask seed,
   each share AES-GCM-encrypted for its holder (`secagg_encrypted_shares`) ->
   `secagg_shares_collected`;
3. `secagg_routed_shares` -> clients send their input plus self mask plus
   pairwise masks, mod p (`secagg_masked_input`) -> `secagg_inputs_collected`;
4. `secagg_unmask_request` (who dropped, who survived) -> clients reveal, per
   neighbour, the seed share of a survivor or the key share of a dropout
   (`secagg_unmask_shares`) -> `secagg_shares_revealed`: the server removes the
   masks (algorithms/secure_sum.py) and aggregates the unmasked sum.

Fewer survivors than the threshold at any stage: the round is skipped (one
warning, the model unchanged, `secagg_skipped: 1` in its record) and the next
round starts. Client stages are in handlers/secagg_client.py.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedcore.comm.validation import CHECKS
from fedcore.config import declare, positive, validator
from fedcore.errors import ConfigError
from fedcore.handlers import rounds, secagg_client, sync
from fedcore.message import SERVER_ID
from fedcore.registry import behaviours
from fedcore.schema import clients_per_round

__all__ = ["Settings", "neighbour_graph", "install", "STAGES"]

log = logging.getLogger("fedcore.secagg")

MERSENNE_61 = 2 ** 61 - 1

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
        "dropouts, twice the slowest modelled round trip; otherwise wait, or distribute.round_deadline)",
        check=positive)

# (stage, message type the server collects, condition event raised when the stage is complete)
STAGES = (("keys", "secagg_public_keys", "secagg_keys_collected"),
          ("shares", "secagg_encrypted_shares", "secagg_shares_collected"),
          ("inputs", "secagg_masked_input", "secagg_inputs_collected"),
          ("unmask", "secagg_unmask_shares", "secagg_shares_revealed"))
_EVENT = {stage: event for stage, _, event in STAGES}
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
    if cfg["asyn.use"]:
        raise ConfigError(f"asyn.use: secure aggregation needs synchronous rounds; set asyn.use=false {off}")
    from fedcore.algorithms.secagg_crypto import is_prime
    if not is_prime(cfg["secure_aggregation.modulus"]):
        raise ConfigError(f"secure_aggregation.modulus: {cfg['secure_aggregation.modulus']} is not prime "
                          f"(e.g. {MERSENNE_61} = 2^61 - 1)")
    m = clients_per_round(cfg)
    k = cfg["secure_aggregation.num_neighbours"]
    k_eff = m - 1 if k == 0 or k >= m - 1 else k
    t = Settings.of(cfg).threshold(k_eff)
    if m < 2 or t > k_eff:
        raise ConfigError(f"secure_aggregation.threshold: {t} exceeds the {k_eff} neighbour(s) a client "
                          f"has with {m} clients per round; lower it or sample more clients")


@dataclass(frozen=True)
class Settings:
    """The protocol's parameters, as both ends compute them from the same config."""

    neighbours: int
    fixed_threshold: int | None
    clip: float
    bits: int
    modulus: int
    per_round: int
    uniform: bool             # every client weighs 1 (central DP; DiLoCo's uniform weighting)
    dp_clip: float | None     # central DP: the L2 bound each client applies to its delta

    @classmethod
    def of(cls, cfg) -> "Settings":
        central = cfg["privacy.dp.mode"] == "central"
        uniform = central or (cfg["algorithm.name"] == "diloco"
                              and cfg["algorithm.diloco.aggregation_weighting"] == "uniform")
        return cls(cfg["secure_aggregation.num_neighbours"], cfg["secure_aggregation.threshold"],
                   cfg["secure_aggregation.clip"], cfg["secure_aggregation.bits"],
                   cfg["secure_aggregation.modulus"], clients_per_round(cfg), uniform,
                   cfg["privacy.dp.clip_norm"] if central else None)

    def threshold(self, neighbours: int) -> int:
        return self.fixed_threshold if self.fixed_threshold is not None else neighbours // 2 + 1

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


# ---------------------------------------------------------------- the server's round
@dataclass
class ServerRound:
    serial: int
    round: int
    stage: str = "keys"
    threshold: int = 0
    keys: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)     # U1: (cipher pk, mask pk)
    graph: dict[int, list[int]] = field(default_factory=dict)
    shares: dict[int, dict[int, bytes]] = field(default_factory=dict)      # U2: sender -> holder -> ct
    masked: dict[int, np.ndarray] = field(default_factory=dict)            # U3
    dropped: list[int] = field(default_factory=list)
    revealed: dict[int, dict[int, bytes]] = field(default_factory=dict)    # responder -> v -> share
    messages: int = 0
    nbytes: int = 0

    def count(self, nbytes: int, messages: int = 1) -> None:
        self.messages += messages
        self.nbytes += nbytes

    def fields(self) -> dict[str, Any]:
        return {"secagg_messages": self.messages, "secagg_bytes": self.nbytes,
                "secagg_dropped": len(self.dropped)}


_serials = itertools.count(1)


def _settings(server) -> Settings:
    return Settings.of(server.course.cfg)


def _send(server, sr: ServerRound, msg_type: str, receiver: int, content: Any) -> None:
    msg = server.send(msg_type, receiver, content, round_=sr.round)
    sr.count(msg.nbytes)


def _next_stage(server, sr: ServerRound, stage: str, expected) -> None:
    sr.stage = stage
    server.selected, server.buffer = set(expected), []
    timeout = server.secagg_timeout
    if timeout:
        server.set_timer(timeout, "secagg_stage_timeout", (sr.serial, stage))


def start_secure_round(server, _event=None) -> None:
    """`all_joined_in` (and after each round): sample and send the model, as a sync round does;
    the clients answer with keys, not updates."""
    sync.start_round(server)
    server.secagg = ServerRound(next(_serials), server.round)
    _next_stage(server, server.secagg, "keys", server.selected)


def _accept(server, msg, stage: str) -> ServerRound | None:
    sr = getattr(server, "secagg", None)
    if server.finished or sr is None or msg.round != sr.round or sr.stage != stage \
            or msg.sender not in server.selected:
        log.info("round %d: %s from client %d (round %d) ignored", server.round, msg.msg_type,
                 msg.sender, msg.round)
        return None
    sr.count(msg.nbytes_to(SERVER_ID))
    return sr


def _received(server, msg, stage: str) -> None:
    server.selected.discard(msg.sender)
    server.buffer.append(msg.sender)
    if not server.selected:
        server.trigger(_EVENT[stage])


def collect_keys(server, msg) -> None:
    sr = _accept(server, msg, "keys")
    if sr is not None:
        sr.keys[msg.sender] = (msg.content["cipher_key"], msg.content["mask_key"])
        _received(server, msg, "keys")


def collect_shares(server, msg) -> None:
    sr = _accept(server, msg, "shares")
    if sr is not None:
        mine = set(sr.graph.get(msg.sender, ()))
        sr.shares[msg.sender] = {v: ct for v, ct in zip(msg.content["to"], msg.content["ciphertexts"])
                                 if v in mine}
        _received(server, msg, "shares")


def collect_masked_input(server, msg) -> None:
    sr = _accept(server, msg, "inputs")
    if sr is not None:
        sr.masked[msg.sender] = msg.content["masked"].numpy().astype(np.uint64)
        _received(server, msg, "inputs")


def collect_unmask_shares(server, msg) -> None:
    sr = _accept(server, msg, "unmask")
    if sr is not None:
        sr.revealed[msg.sender] = dict(zip(msg.content["ids"], msg.content["shares"]))
        _received(server, msg, "unmask")


def refuse_plain_update(server, msg) -> None:
    """`receiving_updates`: this course takes no plain update; one that arrives is dropped unread."""
    log.warning("round %d: a plain update from client %d refused: this course aggregates securely",
                server.round, msg.sender)


def _enough(server, sr: ServerRound, ids: list[int], what: str) -> bool:
    if len(ids) >= max(sr.threshold, 2):
        return True
    _skip(server, sr, f"{len(ids)} client(s) {what}, {max(sr.threshold, 2)} needed")
    return False


def _skip(server, sr: ServerRound, why: str) -> None:
    """Too few survivors: skip the round (model unchanged), logged and recorded."""
    log.warning("secure aggregation: round %d skipped: %s (secure_aggregation.threshold)", sr.round, why)
    server.course.monitor.extra_summary.setdefault("secagg_skipped_rounds", []).append(sr.round)
    fields = {"num_updates": 0, "secagg_skipped": 1, "secagg_survivors": len(sr.masked), **sr.fields()}
    server.secagg, server.selected, server.buffer = None, set(), []
    if rounds.aggregate(server, [], fields):
        start_secure_round(server)


def advertise_keys(server, _event=None) -> None:
    """`secagg_keys_collected`: send each client its neighbours' public keys."""
    sr = server.secagg
    u1 = sorted(sr.keys)
    s = _settings(server)
    sr.graph = neighbour_graph(u1, s.neighbours, server.course.cfg["seed"], sr.round)
    sr.threshold = s.threshold(len(sr.graph[u1[0]])) if u1 else 2
    if not _enough(server, sr, u1, "advertised keys"):
        return
    if sr.threshold > len(sr.graph[u1[0]]):
        _skip(server, sr, f"{len(sr.graph[u1[0]])} neighbour(s) per client, threshold {sr.threshold}")
        return
    for u in u1:
        nb = sr.graph[u]
        _send(server, sr, "secagg_neighbour_keys", u, {
            "ids": nb, "cipher_keys": [sr.keys[v][0] for v in nb], "mask_keys": [sr.keys[v][1] for v in nb]})
    _next_stage(server, sr, "shares", u1)


def route_shares(server, _event=None) -> None:
    """`secagg_shares_collected`: deliver each encrypted share to its holder."""
    sr = server.secagg
    u2 = sorted(sr.shares)
    if not _enough(server, sr, u2, "shared their secrets"):
        return
    for v in u2:
        senders = [u for u in u2 if v in sr.shares[u]]
        _send(server, sr, "secagg_routed_shares", v,
              {"from": senders, "ciphertexts": [sr.shares[u][v] for u in senders]})
    _next_stage(server, sr, "inputs", u2)


def request_unmasking(server, _event=None) -> None:
    """`secagg_inputs_collected`: tell the survivors who dropped, and ask for the shares."""
    sr = server.secagg
    u3 = sorted(sr.masked)
    if not _enough(server, sr, u3, "sent masked inputs"):
        return
    sr.dropped = [v for v in sorted(sr.shares) if v not in sr.masked]
    if sr.dropped:
        log.warning("secure aggregation: round %d: client(s) %s dropped after sharing; their masks "
                    "are rebuilt from the survivors' shares", sr.round, sr.dropped)
    for u in u3:
        _send(server, sr, "secagg_unmask_request", u, {"dropped": sr.dropped, "survivors": u3})
    _next_stage(server, sr, "unmask", u3)


def unmask_and_aggregate(server, _event=None) -> None:
    """`secagg_shares_revealed`: rebuild the secrets, remove the masks, aggregate the sum."""
    from fedcore.algorithms.dp import gaussian_noise, noise_generator
    from fedcore.algorithms.secure_sum import ShareShortage, mean_delta, unmask, unmasked_update
    from fedcore.shamir import share_from_bytes
    sr, s, cfg = server.secagg, _settings(server), server.course.cfg
    survivors = sorted(sr.masked)
    wanted = set(survivors) | set(sr.dropped)
    shares: dict[int, dict[int, int]] = {v: {} for v in wanted}
    for holder, revealed in sr.revealed.items():
        for v, share in revealed.items():
            if v in wanted and holder in sr.shares.get(v, {}):   # only a holder v gave a share to
                shares[v][holder] = share_from_bytes(share)
    receivers = {v: sorted(sr.shares[v]) for v in sr.dropped}
    try:
        total = unmask(sr.masked, sr.dropped, receivers, {u: sr.keys[u][1] for u in survivors},
                       {v: shares[v] for v in survivors}, {v: shares[v] for v in sr.dropped},
                       sr.threshold, s.modulus)
    except (ShareShortage, ValueError) as exc:
        _skip(server, sr, f"cannot unmask: {exc}")
        return
    mean, weight = mean_delta(total, s.clip, s.bits)
    if s.dp_clip is not None and cfg["privacy.dp.noise_multiplier"] > 0:   # central DP on the sum
        noise = gaussian_noise(mean.size, cfg["privacy.dp.noise_multiplier"] * s.dp_clip,
                               noise_generator(cfg["seed"], 0, sr.round))
        mean = (mean * weight + noise.numpy()) / weight
    names = s.names(server.aggregator.broadcast(sr.round)["model"])
    update = unmasked_update(server.aggregator, mean, weight, names, survivors, sr.round)
    fields = {"num_updates": len(survivors), "secagg_survivors": len(survivors), **sr.fields()}
    server.secagg = None
    if rounds.aggregate(server, [update], fields):
        start_secure_round(server)


def stage_timeout(server, payload) -> None:
    """`secagg_stage_timeout`: go on without the clients still silent in this stage."""
    sr = getattr(server, "secagg", None)
    serial, stage = payload
    if sr is None or sr.serial != serial or sr.stage != stage or not server.selected:
        return
    log.warning("secure aggregation: round %d: no %s from client(s) %s within %gs; going on without them",
                sr.round, dict((s, m) for s, m, _ in STAGES)[stage], sorted(server.selected),
                server.secagg_timeout)
    server.selected.clear()
    server.trigger(_EVENT[stage])


def stage_complete(server, _event=None) -> None:
    """`all_received` (a deployment dropped the last clients it waited for): end the stage."""
    sr = getattr(server, "secagg", None)
    if sr is not None:
        server.trigger(_EVENT[sr.stage])


# ---------------------------------------------------------------- wiring
def _auto_timeout(course) -> float:
    value = course.cfg["secure_aggregation.stage_timeout"]
    timing = getattr(course, "timing", None)
    if value is not None or course.wall_clock or timing is None or not timing.has_dropouts:
        return value or 0.0
    from fedcore.serialization import encoded_size
    from fedcore.timing import expected_work
    nbytes = encoded_size(course.server.aggregator.broadcast(1))
    return 2.0 * max(timing.round_trip_time(c, expected_work(course, c), nbytes) for c in course.client_ids)


def _withhold_after_sharing(timing):
    """Simulated device dropouts in a secure course: a client that drops in a round vanishes
    after the share stage (its masks must then be recovered), the protocol's hard case."""
    def keep(msg, receiver: int) -> bool:
        if msg.msg_type in ("secagg_masked_input", "secagg_unmask_shares") and \
                timing.drops_out(msg.sender, msg.round):
            timing.lost_replies += 1
            return False
        return True
    return keep


@behaviours.register("secure_aggregation")
def install(course) -> None:
    c, s = course.client_table, course.server_table
    c.register("receiving_models", secagg_client.train_and_advertise, sends=("secagg_public_keys",))
    c.register("receiving_secagg_neighbour_keys", secagg_client.share_keys,
               sends=("secagg_encrypted_shares",))
    c.register("receiving_secagg_routed_shares", secagg_client.mask_input, sends=("secagg_masked_input",))
    c.register("receiving_secagg_unmask_request", secagg_client.reveal_shares,
               sends=("secagg_unmask_shares",))
    next_round = ("models", "secagg_stage_timeout", "eval_request", "max_rounds_reached", "early_stop")
    s.register("all_joined_in", start_secure_round, sends=("models", "secagg_stage_timeout"))
    s.register("receiving_updates", refuse_plain_update)
    s.register("receiving_secagg_public_keys", collect_keys, sends=("secagg_keys_collected",))
    s.register("secagg_keys_collected", advertise_keys,
               sends=("secagg_neighbour_keys", "secagg_stage_timeout") + next_round)
    s.register("receiving_secagg_encrypted_shares", collect_shares, sends=("secagg_shares_collected",))
    s.register("secagg_shares_collected", route_shares,
               sends=("secagg_routed_shares", "secagg_stage_timeout") + next_round)
    s.register("receiving_secagg_masked_input", collect_masked_input, sends=("secagg_inputs_collected",))
    s.register("secagg_inputs_collected", request_unmasking,
               sends=("secagg_unmask_request", "secagg_stage_timeout") + next_round)
    s.register("receiving_secagg_unmask_shares", collect_unmask_shares, sends=("secagg_shares_revealed",))
    s.register("secagg_shares_revealed", unmask_and_aggregate, sends=next_round)
    events = tuple(e for _, _, e in STAGES)
    s.register("secagg_stage_timeout", stage_timeout, sends=events)
    s.register("all_received", stage_complete, sends=events)
    server = getattr(course, "server", None)
    if server is not None:
        server.secagg = None
        server.secagg_timeout = _auto_timeout(course)
        if not course.wall_clock and course.timing.has_dropouts:
            course.comm.filters.append(_withhold_after_sharing(course.timing))


install.enabled = lambda cfg: cfg["secure_aggregation.enabled"]


# ---------------------------------------------------------------- what a deployed server accepts
def _ints(v: Any, limit: int) -> bool:
    return isinstance(v, list) and len(v) <= limit and all(
        isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= limit for x in v)


def _blobs(v: Any, size: int, count: int) -> bool:
    return isinstance(v, list) and len(v) == count and all(isinstance(b, bytes) and len(b) == size for b in v)


def _check_keys(content, server) -> str | None:
    if not isinstance(content, dict) or set(content) != {"cipher_key", "mask_key"} or \
            not all(isinstance(v, bytes) and len(v) == 32 for v in content.values()):
        return "secagg_public_keys content must be {cipher_key, mask_key}: 32 bytes each"
    return None


def _check_shares(content, server) -> str | None:
    n = server.course.cfg["federate.client_num"]
    # nonce 12 + ids 8 + two shares 2 * 66 + tag 16
    if not isinstance(content, dict) or set(content) != {"to", "ciphertexts"} or \
            not _ints(content["to"], n) or not _blobs(content["ciphertexts"], 168, len(content["to"])):
        return "secagg_encrypted_shares content must be {to: [client ids], ciphertexts: [168 bytes each]}"
    return None


def _check_masked(content, server) -> str | None:
    s = _settings(server)
    model = server.aggregator.broadcast(server.round)["model"]
    length = sum(model[n].numel() for n in s.names(model)) + 1
    t = content.get("masked") if isinstance(content, dict) and set(content) == {"masked"} else None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or tuple(t.shape) != (length,):
        return f"secagg_masked_input content must be {{masked: int64 tensor of {length}}}"
    if bool((t < 0).any()) or bool((t >= s.modulus).any()):
        return "secagg_masked_input values must lie in the field [0, secure_aggregation.modulus)"
    return None


def _check_unmask(content, server) -> str | None:
    n = server.course.cfg["federate.client_num"]
    if not isinstance(content, dict) or set(content) != {"ids", "shares"} or \
            not _ints(content["ids"], n) or not _blobs(content["shares"], 66, len(content["ids"])):
        return "secagg_unmask_shares content must be {ids: [client ids], shares: [66 bytes each]}"
    return None


CHECKS.update({"secagg_public_keys": _check_keys, "secagg_encrypted_shares": _check_shares,
               "secagg_masked_input": _check_masked, "secagg_unmask_shares": _check_unmask})
