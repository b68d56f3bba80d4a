"""Differential privacy for updates: clip each update's L2 norm, add Gaussian noise.

`privacy.dp.mode: local` is a client behaviour: each chosen client (all, a
list, or a fraction, as in the paper's experiment on the share of clients
adding noise) clips its delta to `clip_norm` C and adds N(0, (sigma C)^2) per
coordinate before sending. `central` is the server variant (DP-FedAvg,
McMahan et al., 2018): every delta is clipped to C, the clipped deltas are
summed, N(0, (sigma C)^2) is added and the total is divided by the expected cohort size
qN (the fixed-denominator estimator of DP-FedAvg, so the divisor reveals nothing about who
took part); clients are then Poisson-sampled with q = clients per round / N, as the bound
assumes, and a round whose sample is empty still releases its noise. The server needs only the
sum of the clipped deltas: a folding round adds each to it as it arrives (`dp_fold`).

The server keeps an accountant (`privacy.dp.accountant`: RDP, PLD or PRV, `dp_accountants`) and writes the
client-level epsilon spent at `privacy.dp.delta` into each round's record
(`dp_epsilon`) and the summary. Central: one subsampled Gaussian step per
round with q = clients per round / N. Local: each noisy release is a Gaussian
mechanism (q = 1) on that client's update; the epsilon of the client that
released most often is reported.

Central DP's clip norm may adapt to a quantile of the update norms (`dp_adaptive_clip`);
`privacy.dp.mode: ftrl` (DP-FTRL, no sampling assumed) has its server in `dp_ftrl`.
Noise comes from `dp_noise`: seeded in simulation, the OS's randomness in deployment.
The neighbouring relation, sensitivities and assumptions: docs/algorithms/dp.md.
"""
from __future__ import annotations

import logging
import math

from typing import Any

import torch

from fedcore.kernel import registry
from fedcore.algorithms.combine import flatten, float_names, replace_combination, unflatten
from fedcore.algorithms.dp_accountants import make_accountant
from fedcore.algorithms.dp_adaptive_clip import AdaptiveClip
from fedcore.algorithms.dp_fold import FoldingRule
from fedcore.algorithms.dp_noise import (noise_generator, noise_source, resolved_noise_source,
                                         standard_normal)
from fedcore.algorithms.participants import chosen_clients
from fedcore.kernel.config import declare, lives_elsewhere, non_negative, positive, validator
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrapper
from fedcore.runtime.sampling import PoissonSampler
from fedcore.kernel.schema import clients_per_round

__all__ = ["clip_delta", "gaussian_noise", "noise_generator", "privatize", "central_dp_rule", "install"]

log = logging.getLogger("fedcore.dp")

declare("privacy.dp.mode", str, "none", "differential privacy of updates: none, local (clients "
        "clip and add noise before sending), central (the server clips each update and adds "
        "noise to the aggregate: DP-FedAvg) or ftrl (the server clips each update and releases "
        "noisy prefix sums: DP-FTRL, no sampling assumed)", choices=("none", "local", "central", "ftrl"))
declare("privacy.dp.clip_norm", float, 1.0, "C: largest L2 norm of an update delta",
        check=positive)
declare("privacy.dp.noise_multiplier", float, 1.0, "sigma: Gaussian noise std is sigma * C",
        check=non_negative)
declare("privacy.dp.clients", list, None, "local: ids of the clients that add noise (default all)")
declare("privacy.dp.fraction", float, None, "local: fraction of clients (seeded draw) that add noise",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")
declare("privacy.dp.delta", float, 1e-5, "delta at which the epsilon spent is reported",
        check=lambda v: None if 0 < v < 1 else "must be in (0, 1)")
declare("privacy.dp.clip_each_step", bool, True, "central: after every local optimizer step the "
        "client's model goes back onto the ball of radius clip_norm around the model it received, "
        "as DP-FedAvg's Algorithm 1 does (the delta it sends is already clipped); false: only the "
        "final delta is clipped, by the server")
for _name in ("dp", "dpfedavg", "dp_fedavg"):
    lives_elsewhere("algorithm.name", _name, "privacy.dp.mode=central (or local) with privacy.dp.clip_norm and "
                    "privacy.dp.noise_multiplier")


@validator
def _check_dp(cfg) -> None:
    mode = cfg["privacy.dp.mode"]
    if mode == "none":
        return
    if cfg["privacy.dp.clients"] is not None and cfg["privacy.dp.fraction"] is not None:
        raise ConfigError("privacy.dp.clients and privacy.dp.fraction are both set; keep one")
    if mode in ("central", "ftrl"):
        if cfg["privacy.dp.clients"] is not None or cfg["privacy.dp.fraction"] is not None:
            raise ConfigError("privacy.dp.clients/fraction: central DP applies to every update; "
                              "use privacy.dp.mode=local to choose clients")
        if cfg["aggregator.robust_rule"] != "none":
            raise ConfigError("privacy.dp.mode: central DP replaces the aggregation, so it cannot be "
                              "combined with aggregator.robust_rule; set one of them to none")
        if cfg["fedex.candidates"] is not None:
            # the arm weights are computed from the clients' un-noised validation losses
            raise ConfigError("fedex.candidates: FedEx's arm weights come from each client's "
                              "validation loss, which no noise covers, so central DP's bound would "
                              "not hold for them; drop fedex.candidates or privacy.dp.mode")
        ratio = cfg["admission.norm_ratio"]
        if ratio is not None and not math.isinf(ratio):
            # whether an update is refused would depend on the round's others: one client's
            # presence could drop others' clipped updates, moving the noised sum by several C
            raise ConfigError("admission.norm_ratio: under central DP it would make who is summed "
                              "depend on every client's update, past the clip's sensitivity C; "
                              "drop it (the clip already bounds each update's influence)")
        if cfg["algorithm.name"] in ("scaffold", "feddyn", "fednova", "fedasync", "fedbuff"):
            raise ConfigError(f"privacy.dp.mode: central DP cannot wrap algorithm.name "
                              f"{cfg['algorithm.name']} (its aggregation uses more than the mean "
                              "model); use privacy.dp.mode=local")
    if mode == "central":
        _check_central_sampling(cfg)
    if mode == "local" and cfg["fedex.candidates"] is not None:
        raise ConfigError("fedex.candidates: FedEx sends each client's validation loss (and with "
                          "fedex.diff its loss before training) as it is, beside the noised update, "
                          "so local DP's bound would not cover what the server sees; drop "
                          "fedex.candidates or privacy.dp.mode")
    if mode == "local" and cfg["algorithm.name"] == "scaffold":
        # dc_i = -c - dy_i/(K eta) would release the clipped-and-noised dy_i exactly
        raise ConfigError("privacy.dp.mode: local DP cannot wrap algorithm.name scaffold (its "
                          "control-variate update reveals the model delta without noise); use "
                          "privacy.dp.mode=none or another algorithm")


def _check_central_sampling(cfg) -> None:
    """Central DP's bound holds for synchronous rounds on a Poisson sample: refuse the rest."""
    if cfg["asyn.use"] or cfg["asyn.overselection"]:
        raise ConfigError("privacy.dp.mode: central DP's privacy bound is for synchronous rounds on a "
                          "Poisson sample; set asyn.use and asyn.overselection to false")
    if cfg["federate.sampler"] != "uniform":
        raise ConfigError(f"federate.sampler: central DP samples clients itself (Poisson, as its "
                          f"privacy bound assumes), not by {cfg['federate.sampler']}; set uniform")
    if cfg["secure_aggregation.enabled"]:
        if clients_per_round(cfg) < cfg["federate.client_num"]:
            raise ConfigError("privacy.dp.mode: central DP under secure aggregation needs every client "
                              "in every round (a secure round cannot yet run on a Poisson sample); "
                              "drop federate.sample_client_num/rate or use privacy.dp.mode=local")


# ---------------------------------------------------------------- the mechanism
def clip_delta(vector: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float]:
    """(vector scaled to L2 norm at most `clip_norm`, its norm before clipping)."""
    norm = vector.norm().item()
    factor = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return vector * factor, norm


def gaussian_noise(numel: int, std: float, generator) -> torch.Tensor:
    """N(0, std^2) noise, float64, drawn from `generator` (a torch.Generator or OS_NOISE)."""
    return standard_normal(numel, generator) * std


def privatize(model: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], clip_norm: float,
              noise_multiplier: float, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], float]:
    """`reference + clip(model - reference) + noise` as new tensors; integer entries pass through.
    Returns the new model and the delta's norm before clipping."""
    names = float_names(model)
    delta = {n: model[n].to(torch.float64) - reference[n].to(torch.float64) for n in names}
    vec, norm = clip_delta(flatten(delta, names), clip_norm)
    if noise_multiplier > 0:
        vec = vec + gaussian_noise(vec.numel(), noise_multiplier * clip_norm, generator).to(vec.device)
    noisy = unflatten(vec, delta, names)
    out = dict(model)
    for n in names:
        out[n] = (reference[n].to(torch.float64) + noisy[n]).to(model[n].dtype)
    return out, norm


class CentralRule(FoldingRule):
    """DP-FedAvg's rule: (sum of deltas clipped to C + N(0, (sigma C)^2)) / m, as a list rule
    or folded one update at a time (algorithms/dp_fold.py)."""

    def __init__(self, clip_norm: float, noise_multiplier: float, noise, expected: float | None = None):
        self.clip, self.sigma, self.m = clip_norm, noise_multiplier, expected
        self.noise = noise if callable(noise) else (lambda round_: noise_generator(noise, 0, round_))

    def std(self) -> float:
        return self.sigma * self.clip


def central_dp_rule(clip_norm: float, noise_multiplier: float, noise, expected: float | None = None):
    """A combination rule: (sum of clipped deltas + N(0, (sigma C)^2)) / `expected`, the expected
    cohort size (None: the number of deltas, right only for a cohort of fixed size). `noise` is
    the course seed (seeded noise) or a function of the round giving the noise source."""
    return CentralRule(clip_norm, noise_multiplier, noise, expected)


# ---------------------------------------------------------------- the behaviour
class _Ledger:
    """Server-side accounting of the epsilon spent (client-level)."""

    def __init__(self, course):
        cfg = course.cfg
        self.mode = cfg["privacy.dp.mode"]
        self.sigma = cfg["privacy.dp.noise_multiplier"]
        self.delta = cfg["privacy.dp.delta"]
        self.q = clients_per_round(cfg) / course.num_clients
        self.kind = cfg["privacy.dp.accountant"]
        self.central = make_accountant(self.kind)
        self.releases: dict[int, int] = {}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the privacy already spent must survive a resume."""
        kind = {} if self.kind == "rdp" else {"accountant": self.kind}
        return {**kind, **self.central.state(),
                "releases": {int(c): n for c, n in self.releases.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        kind = state.get("accountant", "rdp")
        if kind != self.kind:
            raise ConfigError(f"privacy.dp.accountant: the snapshot's privacy was accounted with "
                              f"{kind}; resume with privacy.dp.accountant={kind}")
        self.central.restore(state)
        self.releases = {int(c): int(n) for c, n in state["releases"].items()}

    def released(self, client: int) -> None:
        """Local DP: `client`, which adds noise, released one noisy update."""
        self.releases[client] = self.releases.get(client, 0) + 1

    def record(self) -> dict[str, Any]:
        if self.sigma == 0:
            return {"dp_epsilon": None}  # no noise: no finite guarantee
        if self.mode == "central":
            self.central.step(self.q, self.sigma)
            return {"dp_epsilon": self.central.epsilon(self.delta)}
        most = max(self.releases.values(), default=0)
        if most == 0:
            return {"dp_epsilon": None, "dp_epsilon_replace_one": None}  # nothing released yet
        # a client's data against none (a zero update: sensitivity C), and against any other
        # data of that client (replace-one: sensitivity 2C, i.e. noise multiplier sigma / 2)
        zero_out, replace_one = make_accountant(self.kind), make_accountant(self.kind)
        zero_out.step(1.0, self.sigma, most)
        replace_one.step(1.0, self.sigma / 2, most)
        return {"dp_epsilon": zero_out.epsilon(self.delta),
                "dp_epsilon_replace_one": replace_one.epsilon(self.delta)}


def _install_central(course, q: float) -> None:
    """The server clips, noises and divides by the expected cohort; clients are Poisson-sampled
    (coins from the OS when the noise is), and a round whose sample is empty releases noise."""
    cfg, server = course.cfg, course.server
    sigma = cfg["privacy.dp.noise_multiplier"]
    if sigma > 0:
        old = server.sampler
        server.sampler = PoissonSampler(old.client_ids, cfg["seed"], old.timing, rate=q,
                                        secret=resolved_noise_source(cfg) == "os")
    if cfg["secure_aggregation.enabled"]:
        # the clients clip and the noise goes on the unmasked sum (handlers/secure_aggregation.py):
        # the server has no single update to clip
        return
    aggregator = server.aggregator
    noise = lambda round_: noise_source(cfg, 0, round_)  # noqa: E731
    if cfg["privacy.dp.adaptive_clip.target_quantile"] is not None:   # Andrew et al. 2021
        adaptive = AdaptiveClip(cfg, noise)
        rule = adaptive
        course.checkpointer.register("privacy.dp.adaptive_clip", adaptive.state, adaptive.restore)
    else:
        rule = central_dp_rule(cfg["privacy.dp.clip_norm"], sigma, noise, expected=clients_per_round(cfg))
    replace_combination(aggregator, rule, "privacy.dp.mode central", others="global")

    def releasing_empty_rounds(combine, updates, round_):
        if not updates:  # the server's own unchanged model: a zero delta, so noise alone is added
            updates = [ReceivedUpdate(0, {"model": dict(aggregator.global_state), "num_samples": 1.0},
                                      round_)]
        return combine(updates, round_)
    aggregator.wrap(Wrapper("differential_privacy central", "aggregate", releasing_empty_rounds))
    aggregator.releases_empty_rounds = sigma > 0


def _install_local(course, noisy: set[int]) -> None:
    """Each chosen client clips its update and adds noise before sending it."""
    cfg, trainer = course.cfg, course.trainer
    clip, sigma = cfg["privacy.dp.clip_norm"], cfg["privacy.dp.noise_multiplier"]

    def private_fit(fit, client_id, data, received, round_):
        result = fit(client_id, data, received, round_)
        if client_id in noisy:
            source = noise_source(cfg, client_id, round_)
            if "delta" in result.content:  # updates sent as deltas (FedBuff): noise those
                delta = result.content["delta"]
                zero = {n: torch.zeros_like(t) for n, t in delta.items()}
                delta, norm = privatize(delta, zero, clip, sigma, source)
                result.content = dict(result.content, delta=delta)
            else:
                model, norm = privatize(result.content["model"], received["model"], clip, sigma, source)
                result.content = dict(result.content, model=model)
            result.metrics["dp_update_norm"] = norm
        return result
    # the clipped, noised update depends on the fit's inputs and result only: it applies to a
    # batched result as to a plain fit
    trainer.wrap(Wrapper("differential_privacy local", "fit", private_fit,
                         per_client_result=True, process_safe=True))


def _install_projection(course) -> None:
    """Central DP's local steps as Algorithm 1's UserUpdateFedAvg takes them: after each optimizer
    step, theta <- theta0 + clip(theta - theta0) over the floating entries the server clips (a
    trainer that steps without its optimizer, as FedMoS does, is clipped at the end only)."""
    trainer, clip = course.trainer, course.cfg["privacy.dp.clip_norm"]

    def projected_fit(fit, client_id, data, received, round_):
        anchor = received["model"]
        names = [n for n in float_names(anchor) if n in trainer.entries]

        @torch.no_grad()
        def project(_optimizer, _args, _kwargs):
            current = {n: trainer.entries[n] for n in names}
            inside, norm = privatize(current, anchor, clip, 0.0, None)
            if norm > clip:
                for n in names:
                    trainer.entries[n].copy_(inside[n])
        handle = trainer.optimizer.register_step_post_hook(project)
        try:
            return fit(client_id, data, received, round_)
        finally:
            handle.remove()
    # it acts inside every local step: a batched engine cannot apply it around a result
    trainer.wrap(Wrapper("differential_privacy central (clip each step)", "fit", projected_fit,
                         process_safe=True))


def install(course) -> None:
    """Behaviour: local DP on the chosen clients' trainer output, or central DP on the server
    (and, with clip_each_step, its clipping inside the clients' local steps)."""
    cfg = course.cfg
    # In a deployment a client process has no server and the server process no trainer:
    # each installs its own half. The noisy clients are drawn over the whole federation.
    server = course.server
    noisy: set[int] = set()
    if cfg["privacy.dp.mode"] == "local":
        noisy = chosen_clients(list(range(1, course.num_clients + 1)), cfg["privacy.dp.clients"],
                               cfg["privacy.dp.fraction"], cfg["seed"], 8101, "privacy.dp")
        if course.trainer is not None:
            _install_local(course, noisy)
    if cfg["privacy.dp.mode"] in ("central", "ftrl") and cfg["privacy.dp.clip_each_step"] \
            and course.trainer is not None:
        _install_projection(course)
    if server is None:
        return
    if cfg["eval.clients"] and cfg["privacy.dp.noise_multiplier"] > 0:
        log.warning("privacy.dp: client evaluations (eval.clients) send each client's test loss and "
                    "accuracy without noise: dp_epsilon does not cover them; set eval.clients: false "
                    "for it to cover everything the server sees")
    if cfg["privacy.dp.mode"] == "ftrl":   # its server: algorithms/dp_ftrl.py
        return
    ledger = _Ledger(course)
    if cfg["privacy.dp.mode"] == "central":
        _install_central(course, ledger.q)
    course.checkpointer.register("privacy.dp", ledger.state, ledger.restore)
    aggregator = server.aggregator
    source = resolved_noise_source(cfg)

    def summarize(spent: dict[str, Any]) -> None:
        course.monitor.add_summary("dp", {"dp_epsilon": spent["dp_epsilon"], "dp_delta": ledger.delta,
                                          "dp_mode": ledger.mode, "dp_noisy_clients": len(noisy),
                                          "dp_noise_source": source,
                                          "dp_accountant": ledger.kind})
        if "dp_epsilon_replace_one" in spent:
            course.monitor.add_summary("dp", {"dp_epsilon_replace_one": spent["dp_epsilon_replace_one"]})

    def received(_server, msg):
        # a noisy release is every update a client sends that reaches the server, whether it is
        # then aggregated, refused (admission), late or for another round; under secure
        # aggregation, its masked input. The summary says it at once (no round may follow).
        if msg.sender in noisy:
            ledger.released(msg.sender)
            summarize(ledger.record())
    # in a tree the clients' updates reach their edges: the edges' table is watched too (a
    # simulated tree's edges share this process; deployed edges do not, see below). Only where
    # a client adds noise: an observed arrival keeps a simulation from folding each update as
    # it is sent (streaming.fold_when_sent), so central DP's rounds would hold k updates
    tables = [course.server_table] + [t for t in course.extra_tables if t.role == "edge"] if noisy else []
    for table in tables:
        for event in ("receiving_updates", "receiving_secagg_masked_input"):
            table.observe(event, received)
    if cfg.get("topology.edges") and cfg["federate.mode"] == "distributed" and noisy:
        log.warning("privacy.dp: the clients' noisy releases reach their edge processes, not this "
                    "server: dp_epsilon is not reported (each client's is that of its releases, "
                    "one a round of its edge)")

    def accounted(aggregate, updates, round_):
        out = dict(aggregate(updates, round_) or {})
        out.update(ledger.record())
        summarize(out)
        return out
    aggregator.wrap(Wrapper("differential_privacy accounting", "aggregate", accounted))


install.enabled = lambda cfg: cfg["privacy.dp.mode"] != "none"
registry.behaviours.register("differential_privacy", install)
