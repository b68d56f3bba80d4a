"""FedEx (Khodak et al., NeurIPS 2021): clients explore local hyper-parameters within one course.

The server holds a categorical distribution theta over `fedex.candidates`
(each a few client-side config values) and sends it with the model. Each
sampled client draws its candidate from theta (seeded by seed, client,
round), trains with it, and returns its validation loss after training
(with `fedex.diff`, the change that training made) and its validation size.
The server aggregates the models as the course's algorithm does, then takes
one exponentiated-gradient step on theta:

    grad_j = sum_{i: arm_i = j} w_i (L_i - lambda_t) / theta_j,   w_i = |V_i| / sum |V|
    theta <- theta * exp(-eta_t grad),  normalised

with baseline lambda_t the discounted mean of earlier rounds' weighted losses
(0 in the first round) and eta_t = eta0 / sqrt(t) by default. A behaviour: it
wraps whichever algorithm the course runs. docs/algorithms/fedex.md aligns the
paper, the authors' code and this module.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fedcore.kernel import registry
from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.contract import ReceivedUpdate, evaluate_model
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrapper

__all__ = ["LOCAL_KEYS", "ExpGradPolicy", "draw_arm", "check_feedback", "feedback_layout",
           "install"]

LOCAL_KEYS = ("train.optimizer.lr", "train.optimizer.momentum", "train.optimizer.weight_decay",
              "train.local_steps", "train.local_epochs", "train.batch_size")
registry.components.register("fedex_local_keys", LOCAL_KEYS)   # what `fedcore.tune --method fedex` sets
_OPTIMIZER_FIELDS = {"train.optimizer.lr": "lr", "train.optimizer.momentum": "momentum",
                     "train.optimizer.weight_decay": "weight_decay"}
SCHEDULES = ("auto", "constant", "adaptive", "aggressive")

declare("fedex.candidates", list, None, "FedEx: client-side configurations clients draw from each "
        "round, a list of {key: value} over " + ", ".join(LOCAL_KEYS) + " (null: FedEx off)")
declare("fedex.eta0", float, None, "FedEx: base step of the exponentiated gradient (null: "
        "sqrt(2 ln k) for k candidates)", check=positive)
declare("fedex.schedule", str, "auto", "FedEx: step schedule: auto (eta0/sqrt(t)), constant (eta0), "
        "adaptive (eta0/sqrt(sum of squared max-norms of the gradients)), aggressive (eta0/max-norm)",
        choices=SCHEDULES)
declare("fedex.baseline", float, 0.0, "FedEx: discount of the baseline over earlier rounds' losses "
        "(0: the previous round's only, 1: their plain mean)",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")
declare("fedex.diff", bool, False, "FedEx: feedback is the change of validation loss made by local "
        "training (after - before) instead of the loss after it")


@validator
def _check_fedex(cfg) -> None:
    candidates = cfg["fedex.candidates"]
    if candidates is None:
        return
    if not candidates or not all(isinstance(c, dict) and c for c in candidates):
        raise ConfigError("fedex.candidates: must be a non-empty list of {key: value} mappings")
    for i, c in enumerate(candidates):
        for key in c:
            if key not in LOCAL_KEYS:
                raise ConfigError(f"fedex.candidates[{i}]: '{key}' is not a client-side key FedEx can "
                                  f"set per client; use {', '.join(LOCAL_KEYS)}")
        try:
            cfg.with_overrides(**{**c, "fedex.candidates": None})
        except ConfigError as exc:
            raise ConfigError(f"fedex.candidates[{i}]: {exc}") from None
    keys = {k for c in candidates for k in c}
    if "train.optimizer.lr" in keys and cfg["train.scheduler.type"] != "none":
        raise ConfigError("fedex.candidates: an LR schedule sets the learning rate itself; use "
                          "train.scheduler.type=none with learning-rate candidates")
    if cfg["topology.edges"]:
        raise ConfigError("fedex.candidates: edge aggregators (topology.edges) neither send theta to "
                          "their clients nor pass their feedback on, so theta would never move; set "
                          "topology.edges=0")
    if cfg["algorithm.name"] == "diloco" and "train.local_steps" in keys:
        raise ConfigError("fedex.candidates: diloco fixes H = train.local_steps for the course; "
                          "leave train.local_steps out of the candidates")


def draw_arm(theta: np.ndarray, seed: int, client_id: int, round_: int) -> int:
    """A client's candidate this round: its own seeded draw from theta, whatever the order of
    trainings (executor, processes) or which clients were sampled."""
    rng = np.random.default_rng([seed, client_id, round_, 0xFEDE])
    return int(rng.choice(len(theta), p=theta / theta.sum()))


class ExpGradPolicy:
    """The server's distribution over k candidates and its exponentiated-gradient step (float64)."""

    def __init__(self, k: int, eta0: float | None = None, schedule: str = "auto",
                 baseline: float = 0.0, diff: bool = False):
        self.k = k
        self.eta0 = math.sqrt(2.0 * math.log(k)) if eta0 is None else float(eta0)
        self.schedule, self.discount, self.diff = schedule, baseline, diff
        self.z = np.full(k, -math.log(k), dtype=np.float64)   # log theta
        self.store = 0.0                                       # the schedule's running sum
        self.after: list[float] = []                           # weighted loss after training, per round
        self.before: list[float] = []                          # ... before training (diff only)

    @property
    def theta(self) -> np.ndarray:
        return np.exp(self.z)

    def baseline(self) -> float:
        if not self.after:
            return 0.0
        trace = np.array(self.after) - (np.array(self.before) if self.diff else 0.0)
        weight = self.discount ** np.flip(np.arange(len(trace)))
        return float(np.inner(trace, weight) / weight.sum())

    def step(self, arms: list[int], after: list[float], sizes: list[float],
             before: list[float] | None = None) -> dict[str, float]:
        """One update from a round's feedback; returns the round's FedEx metrics."""
        w = np.asarray(sizes, dtype=np.float64)
        if w.sum() <= 0:
            return self.metrics()  # no client holds validation data: nothing to learn from
        w = w / w.sum()
        a = np.asarray(after, dtype=np.float64)
        b = np.asarray(before, dtype=np.float64) if self.diff else np.zeros_like(a)
        lam = self.baseline()
        self.after.append(float(np.inner(a, w)))
        if self.diff:
            self.before.append(float(np.inner(b, w)))
        theta = self.theta
        grad = np.zeros(self.k, dtype=np.float64)
        for arm, s, wi in zip(arms, a - b if self.diff else a, w):
            grad[arm] += wi * (s - lam) / theta[arm]
        eta = self.eta0 / self._denominator(grad)
        self.z = self.z - eta * grad
        self.z = self.z - _logsumexp(self.z)
        return self.metrics()

    def _denominator(self, grad: np.ndarray) -> float:
        top = float(np.abs(grad).max())
        if self.schedule == "auto":
            self.store += 1.0
            return math.sqrt(self.store)
        if self.schedule == "adaptive":
            self.store += top ** 2
            return math.sqrt(self.store) if self.store > 0 else 1.0
        if self.schedule == "aggressive":
            return top if top > 0 else 1.0
        return 1.0

    def metrics(self) -> dict[str, float]:
        theta = self.theta
        positive_ = theta[theta > 0]
        return {"fedex_entropy": float(-(positive_ * np.log(positive_)).sum()),
                "fedex_max_prob": float(theta.max()), "fedex_mle_arm": int(theta.argmax())}

    def state(self) -> dict[str, Any]:
        return {"z": torch.from_numpy(self.z.copy()), "store": self.store,
                "after": list(self.after), "before": list(self.before)}

    def restore(self, state: dict[str, Any]) -> None:
        self.z = state["z"].numpy().astype(np.float64)
        self.store = float(state["store"])
        self.after, self.before = [float(v) for v in state["after"]], [float(v) for v in state["before"]]


def _logsumexp(z: np.ndarray) -> float:
    m = float(z.max())
    return m + math.log(float(np.exp(z - m).sum()))


def _val_loss(trainer, data) -> float:
    result = evaluate_model(trainer.model, data.val.x, data.val.y, trainer.loss,
                            trainer.cfg["eval.batch_size"])
    return float(result.get("loss", 0.0))


def _wrap_trainer(course, candidates: list[dict]) -> None:
    """Each fit draws its candidate from the received theta and trains with those values."""
    trainer, cfg = course.trainer, course.cfg
    seed, diff = cfg["seed"], cfg["fedex.diff"]
    arm_cfgs = [cfg.with_overrides(**c) for c in candidates]
    chosen: dict[str, Any] = {}

    def fedex_begin(begin, state, received):
        # after the client's optimizer state is restored, before the first step
        for key, value in chosen.items():
            for group in trainer.optimizer.param_groups:
                group[_OPTIMIZER_FIELDS[key]] = value
        begin(state, received)

    def fedex_fit(fit, client_id, data, received, round_):
        theta = received.get("fedex_theta")
        if theta is None:
            return fit(client_id, data, received, round_)
        arm = draw_arm(theta.cpu().numpy().astype(np.float64), seed, client_id, round_)
        before = None
        if diff:
            trainer.load_global(received["model"], trainer.store.load(client_id))
            before = _val_loss(trainer, data)
        chosen.clear()
        chosen.update({k: v for k, v in candidates[arm].items() if k in _OPTIMIZER_FIELDS})
        trainer.cfg = arm_cfgs[arm]
        try:
            result = fit(client_id, data, received, round_)
        finally:
            trainer.cfg = cfg
            chosen.clear()
        feedback = {"arm": arm, "loss": _val_loss(trainer, data), "size": len(data.val)}
        if before is not None:
            feedback["before"] = before
        result.content = dict(result.content, fedex=feedback)
        return result

    # the arm's values change the training itself; the trainer's own copy carries them
    trainer.wrap(Wrapper("fedex", "begin", fedex_begin, process_safe=True))
    trainer.wrap(Wrapper("fedex", "fit", fedex_fit, process_safe=True))


def install(course) -> None:
    """Behaviour: FedEx around the course's own trainer and aggregator (each process installs
    its half: a deployed client has no server, a deployed server no trainer)."""
    cfg = course.cfg
    candidates = cfg["fedex.candidates"]
    if course.trainer is not None:
        _wrap_trainer(course, candidates)
    server = course.server
    if server is None:
        return
    policy = ExpGradPolicy(len(candidates), cfg["fedex.eta0"], cfg["fedex.schedule"],
                           cfg["fedex.baseline"], cfg["fedex.diff"])
    course.checkpointer.register("fedex", policy.state, policy.restore)
    aggregator = server.aggregator

    def fedex_broadcast(broadcast, round_):
        return {**broadcast(round_), "fedex_theta": torch.from_numpy(policy.theta)}

    def fedex_aggregate(aggregate, updates, round_):
        feedback = [u.content.get("fedex") for u in updates]
        plain = [ReceivedUpdate(u.client_id, {k: v for k, v in u.content.items() if k != "fedex"},
                                u.round, u.staleness) for u in updates]
        out = dict(aggregate(plain, round_) or {})
        given = [f for f in feedback if f is not None]
        if given:
            out.update(policy.step([f["arm"] for f in given], [f["loss"] for f in given],
                                   [f["size"] for f in given],
                                   [f.get("before", 0.0) for f in given]))
        best = int(policy.theta.argmax())
        course.monitor.add_summary("fedex", {"fedex_theta": [float(t) for t in policy.theta],
                                             "fedex_best_arm": best, "fedex_best": candidates[best]})
        return out

    aggregator.wrap(Wrapper("fedex", "broadcast", fedex_broadcast))
    aggregator.wrap(Wrapper("fedex", "aggregate", fedex_aggregate))


def check_feedback(feedback: Any, server) -> str | None:
    """The problem with a client's feedback as it arrives, or None: what `install`'s
    aggregation reads of it must be there and in range (a hostile client cannot make it raise)."""
    cfg = server.course.cfg
    k, diff = len(cfg["fedex.candidates"]), cfg["fedex.diff"]
    keys = {"arm", "loss", "size"} | ({"before"} if diff else set())
    shape = (f"update's 'fedex' feedback must be {{arm: int in [0, {k}), loss: finite number, "
             f"size: int >= 0{', before: finite number' if diff else ''}}}")
    if not isinstance(feedback, dict) or set(feedback) != keys:
        return shape
    ints = [feedback["arm"], feedback["size"]]
    numbers = [feedback["loss"], feedback.get("before", 0.0)]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints) \
            or not 0 <= feedback["arm"] < k or feedback["size"] < 0 \
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                       for v in numbers):
        return shape
    return None


def feedback_layout(server, layout: dict) -> dict:
    """What clients send in a FedEx course (`fedcore.kernel.contract.LayoutChange`): the course's
    update and, under 'fedex', the feedback `check_feedback` admits."""
    return {**layout, "fedex": check_feedback}


install.enabled = lambda cfg: cfg["fedex.candidates"] is not None
install.update_layout = feedback_layout
registry.behaviours.register("fedex", install)
