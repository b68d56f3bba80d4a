"""DP-FTRL: central DP on the server's aggregate without assuming that clients are sampled.

`privacy.dp.mode: ftrl`. The clients are split once (seeded) into b = N // k groups of the
same size, and round t asks group t mod b, so a client takes part at most
ceil(T / b) times, b rounds apart. Each round the server clips every delta to C, sums them
into g_t and moves the model by the FTRL step on the noisy prefix sums,

    theta_t = theta_0 + (eta / m) (g_1 + ... + g_t + (B Z)_t),  m = N / b,

taken as theta_t = theta_{t-1} + (eta / m) (g_t + (B Z)_t - (B Z)_{t-1}), with the noise
from a factorization A = B C of the prefix sums (`dp_matrix`: the binary tree of Kairouz et
al. 2021 or the banded one of Choquette-Choo et al. 2023), Z of std sigma C sens, sens the
factorization's sensitivity for that participation. Without noise it is SGD with server
learning rate eta on the mean clipped delta. The whole course is one Gaussian mechanism of
noise multiplier sigma (Denisov et al. 2022), accounted by `privacy.dp.accountant`; round
t's epsilon is that of its prefix of the release. docs/algorithms/dp_ftrl.md.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from fedcore.algorithms.combine import Deltas, flatten, replace_combination, unflatten
from fedcore.algorithms.dp import clip_delta
from fedcore.algorithms.dp_accountants import epsilon_for
from fedcore.algorithms.dp_matrix import BandedNoise, TreeNoise, banded_matrix, sensitivity, tree_matrix
from fedcore.algorithms.dp_noise import noise_source, resolved_noise_source, standard_normal
from fedcore.kernel import registry
from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.schema import clients_per_round
from fedcore.runtime.sampling import Sampler

__all__ = ["Schedule", "CyclicSampler", "FtrlRelease", "install"]

log = logging.getLogger("fedcore.dp_ftrl")

declare("privacy.dp.ftrl.factorization", str, "tree", "ftrl: how the prefix sums' noise is "
        "factorized: tree (binary tree aggregation, Kairouz et al. 2021) or banded (banded matrix "
        "factorization, Choquette-Choo et al. 2023)", choices=("tree", "banded"))
declare("privacy.dp.ftrl.lr", float, 1.0, "ftrl: server learning rate eta of the FTRL step on "
        "the noisy prefix sums of the mean clipped deltas", check=positive)
declare("privacy.dp.ftrl.bands", int, None, "ftrl, banded: non-zero diagonals of C (default: the "
        "rounds between a client's participations, N // clients per round, where the "
        "sensitivity is sqrt(participations) times a column's norm)", check=positive)


@validator
def _check_ftrl(cfg) -> None:
    if cfg["privacy.dp.mode"] != "ftrl":
        return
    why = {"asyn.use": cfg["asyn.use"], "asyn.overselection": cfg["asyn.overselection"],
           "secure_aggregation.enabled": cfg["secure_aggregation.enabled"],
           "topology.edges": cfg["topology.edges"] > 0}
    for key, bad in why.items():
        if bad:
            raise ConfigError(f"{key}: DP-FTRL's bound is for synchronous rounds of a star whose "
                              f"server sees the clipped updates; turn it off or use another "
                              f"privacy.dp.mode")
    if cfg["federate.sampler"] != "uniform":
        raise ConfigError("federate.sampler: DP-FTRL asks the clients in fixed groups, in turn "
                          "(its sensitivity assumes that); leave federate.sampler uniform")
    if cfg["server_optimizer.type"] != "sgd" or cfg["server_optimizer.lr"] not in (None, 1, 1.0):
        raise ConfigError("server_optimizer.type: DP-FTRL's step is the server's optimizer; set "
                          "its learning rate with privacy.dp.ftrl.lr and leave server_optimizer "
                          "at sgd with lr 1")
    if cfg["privacy.dp.adaptive_clip.target_quantile"] is not None:
        raise ConfigError("privacy.dp.adaptive_clip.target_quantile: adaptive clipping is "
                          "accounted for DP-FedAvg (privacy.dp.mode central) only")


def groups(cfg) -> int:
    """b: how many groups the clients are split into (rounds between two participations)."""
    return max(1, cfg["federate.client_num"] // clients_per_round(cfg))


class Schedule:
    """Who may contribute to release t: a client at most `k` times, `b` releases apart
    (what the sensitivity assumes); kept per client and saved with the snapshot."""

    def __init__(self, k: int, b: int) -> None:
        self.k, self.b = k, b
        self.seen: dict[int, list[int]] = {}   # client -> [times, last release]

    def admits(self, client: int, t: int) -> bool:
        times, last = self.seen.get(client, (0, -math.inf))
        if times >= self.k or t - last < self.b:
            return False
        self.seen[client] = [times + 1, t]
        return True


class CyclicSampler(Sampler):
    """The clients shuffled once by the seed and dealt into `b` groups; round r asks group
    r mod b (those of it that are candidates), whatever `k`."""

    def __init__(self, client_ids: list[int], seed: int, timing, b: int, round_of) -> None:
        super().__init__(client_ids, seed, timing)
        order = [self.client_ids[i] for i in self.rng.permutation(len(self.client_ids))]
        self.groups = [sorted(order[g::b]) for g in range(b)]
        self.round_of = round_of

    def sample(self, k: int, candidates: list[int]) -> list[int]:
        allowed = set(candidates)
        return [c for c in self.groups[self.round_of() % len(self.groups)] if c in allowed]


class FtrlRelease:
    """The server's DP-FTRL state: the release count t, the factorization's noise stream and
    the participation schedule. `rule` is the combination rule it puts in the aggregator."""

    def __init__(self, cfg, num_clients: int, noise) -> None:
        self.clip, self.sigma = cfg["privacy.dp.clip_norm"], cfg["privacy.dp.noise_multiplier"]
        self.lr, self.delta = cfg["privacy.dp.ftrl.lr"], cfg["privacy.dp.delta"]
        self.kind, self.factorization = cfg["privacy.dp.accountant"], cfg["privacy.dp.ftrl.factorization"]
        self.T = cfg["federate.total_round_num"]
        b = groups(cfg)
        self.m = num_clients / b                       # the fixed denominator: a group's mean size
        self.schedule = Schedule(math.ceil(self.T / b), b)
        if self.factorization == "tree":
            self.C, self.stream = tree_matrix(self.T), TreeNoise()
        else:
            bands = min(cfg["privacy.dp.ftrl.bands"] or b, self.T)
            self.C = banded_matrix(self.T, bands)
            self.stream = BandedNoise(self.C, bands)
        self.sens = sensitivity(self.C, self.schedule.k, b)
        self.noise = noise                             # round -> noise source
        self.t = 0
        self._eps: dict[int, float | None] = {}

    def rule(self, deltas: Deltas, weights: list[float], client_ids: list[int], round_: int):
        """(eta / m) (g_t + noise increment): the model's move this release."""
        if self.t >= self.T:
            raise RuntimeError(f"DP-FTRL's factorization covers {self.T} releases; the course "
                               "asked for one more")
        self.t += 1
        names = list(deltas[0])
        total = torch.zeros(sum(deltas[0][n].numel() for n in names), dtype=torch.float64)
        dropped = clipped = 0
        for delta, client in zip(deltas, client_ids):
            if client == 0:            # the server's own model on a round nobody answered
                continue
            if not self.schedule.admits(client, self.t):
                dropped += 1
                continue
            vec, norm = clip_delta(flatten(delta, names), self.clip)
            total += vec.to(total.device)
            clipped += norm > self.clip
        if self.sigma > 0:
            source = self.noise(self.t)
            draw = lambda: standard_normal(total.numel(), source)  # noqa: E731
            total += (self.sigma * self.clip * self.sens) * self.stream.increment(self.t, draw).to(total.device)
        step = total * (self.lr / self.m)
        return unflatten(step, deltas[0], names), {"dp_clipped": clipped, "dp_ftrl_dropped": dropped}

    def epsilon(self) -> float | None:
        """Epsilon of releases 1..t: the prefix's sensitivity against the noise of the whole.
        Past round 64 the prefix is measured at the next power of two (or T) only: the
        sensitivity grows with the prefix, so that is an upper bound, at a cost in log T."""
        if self.sigma == 0:
            return None
        at = self.t if self.t <= 64 else min(self.T, 1 << (self.t - 1).bit_length())
        if at not in self._eps:
            prefix = sensitivity(self.C[:at, :at], self.schedule.k, self.schedule.b)
            self._eps[at] = 0.0 if prefix == 0 else epsilon_for(
                self.kind, 1.0, self.sigma * self.sens / prefix, 1, self.delta)
        return self._eps[at]

    def state(self) -> dict[str, Any]:
        return {"t": self.t, "T": self.T, "factorization": self.factorization, "stream": self.stream.state(),
                "seen": {int(c): [int(n), int(last)] for c, (n, last) in self.schedule.seen.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        if (int(state["T"]), state["factorization"]) != (self.T, self.factorization):
            # the kept noises belong to that factorization: another one would release them wrongly
            raise ConfigError(f"federate.total_round_num: the snapshot's DP-FTRL noise is for "
                              f"{state['T']} rounds of a {state['factorization']} factorization; "
                              f"resume with those")
        self.t = int(state["t"])
        self.stream.restore(state["stream"])
        self.schedule.seen = {int(c): [int(n), int(last)] for c, (n, last) in state["seen"].items()}


def install(course) -> None:
    """Server side: the cyclic groups, the FTRL rule in the aggregator, its accounting."""
    cfg, server = course.cfg, course.server
    if server is None:
        return
    release = FtrlRelease(cfg, course.num_clients, lambda t: noise_source(cfg, 0, t))
    old = server.sampler
    server.sampler = CyclicSampler(old.client_ids, cfg["seed"], old.timing, groups(cfg),
                                   lambda: server.round)
    aggregator = server.aggregator
    replace_combination(aggregator, release.rule, "privacy.dp.mode ftrl", others="global")

    def every_round_releases(combine, updates, round_):
        if not updates:   # nobody answered: the noise still advances (a zero contribution)
            updates = [ReceivedUpdate(0, {"model": dict(aggregator.global_state), "num_samples": 1.0},
                                      round_)]
        out = dict(combine(updates, round_) or {})
        out["dp_epsilon"] = release.epsilon()
        course.monitor.add_summary("dp", {
            "dp_epsilon": out["dp_epsilon"], "dp_delta": release.delta, "dp_mode": "ftrl",
            "dp_accountant": release.kind, "dp_ftrl_factorization": release.factorization,
            "dp_ftrl_sensitivity": release.sens, "dp_ftrl_max_participations": release.schedule.k,
            "dp_ftrl_min_separation": release.schedule.b,
            "dp_noise_source": resolved_noise_source(cfg)})
        return out
    aggregator.wrap(Wrapper("differential_privacy ftrl", "aggregate", every_round_releases))
    aggregator.releases_empty_rounds = True
    course.checkpointer.register("privacy.dp.ftrl", release.state, release.restore)


install.enabled = lambda cfg: cfg["privacy.dp.mode"] == "ftrl"
registry.behaviours.register("dp_ftrl", install)
