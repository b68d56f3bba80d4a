"""Admission: how much one participant's update may move the global model.

Layout, dtype and finiteness are checked as a message arrives (`comm/validation.py`).
The rules here need the round's other updates or the aggregate, so they run
where the server aggregates (`handlers/rounds.py`), in simulation and in
deployment alike, and an algorithm never sees an update they refused:

- **what it decodes to**: an update that reaches the server encoded (compressed, sparse:
  `algorithms/compression.py`) is decoded as it arrives, and a problem found there (indices
  that do not decode, values not finite once decoded) travels with it as a `Refusal`; a
  behaviour whose aggregation forms something else from the update (LoRA's exact mean, the
  product B A of each client's factors) declares `install.admission_check`, run here on each
  update. Either way the update is refused for its client alone, before the rules below,
  at this one place the folding and the list-based paths share;
- **sample counts**: an update's `num_samples` may not exceed what its client
  declared when it joined, nor `admission.max_num_samples` (in deployment it
  defaults to the largest partition of the server's own build of the data; at an
  edge aggregator, to the largest among its clients'). A participant with a
  bound of its own (an edge at the cloud: its clients' caps summed,
  `AdmissionState.bounds`) is held to it, at its join (`handlers/edge.py`) and after;
- **influence**: an update whose distance from the global model exceeds
  `admission.norm_ratio` times the median distance of the round's other
  updates is refused (off by default in simulation and deployment alike, so
  both compute the algorithm's own aggregate; a course facing untrusted clients
  sets it, 10 for one). A client that missed rounds (paused, late,
  not sampled) sends an honest update that is larger until the model fits its
  data again; above the bound it is scaled down to the bound instead of refused
  (`Returning`), so an honest returner is not taken for an attacker, and no
  update moves the model further than the bound allows;
- **the aggregate**: a non-finite result is never adopted. The previous model
  is kept; in simulation that is divergence and ends the course (exit code 5);
  in deployment the round is run again, and after `admission.max_rejected_rounds`
  rejected rounds in a row the course ends as diverged.

Refusals are counted in the summary (`admission`) and logged at most once per
reason every few seconds (`fedcore.runtime.quiet`), so a hostile peer cannot flood the log.
What admission keeps between rounds is the server's typed `AdmissionState`, which
snapshots save (`fedcore.kernel.server_state`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fedcore.kernel import registry
from fedcore.kernel.config import declare, positive
from fedcore.kernel.contract import ReceivedUpdate, clone_tree
from fedcore.runtime.quiet import QuietLog
from fedcore.kernel.server_state import Outcome, transient, worker_state
from fedcore.wire.spooled import release
from fedcore.wire.tensor_forms import get_form

__all__ = ["admit_updates", "Refusal", "decoded_problem", "AdmissionState", "Returning", "scaled_update",
           "Snapshot", "finite_state", "reject_round", "note", "sample_cap", "norm_ratio"]

log = logging.getLogger("fedcore.admission")

declare("admission.norm_ratio", float, None, "refuse an update whose distance from the global model "
        "exceeds this many times the median of the round's other updates (default: off, in "
        "simulation and deployment alike; 10 suits a deployment facing untrusted clients)",
        check=lambda v: None if v > 1 else "must exceed 1")
declare("admission.max_num_samples", int, None, "largest num_samples one client's update may claim "
        "(default: in deployment, the largest partition of the server's own build of the data; at an "
        "edge aggregator, the largest of its clients' partitions; set it when clients bring larger "
        "own data); with topology.edges an edge may declare at most this times its clients", check=positive)
declare("admission.max_rejected_rounds", int, 3, "deployment: rounds in a row whose aggregate is "
        "not finite before the course stops as diverged (exit code 5)", check=positive)



def note(server, kind: str, message: str, level: int = logging.WARNING) -> None:
    """Count one refusal of `kind` in the summary's `admission` counts; log it (rate-limited)."""
    state = server.state(AdmissionState)
    state.quiet(kind, message, level)
    state.counts[kind] = state.counts.get(kind, 0) + 1
    _add_counts(server.course, {kind: 1})


def _add_counts(course, counts: dict[str, int]) -> None:
    """The summary's `admission` counts are the course's: the server's and its edges' together."""
    for kind, n in counts.items():
        course.monitor.tally("admission", "admission", kind, by=n)


def norm_ratio(course) -> float | None:
    return course.cfg["admission.norm_ratio"]


def sample_cap(course, worker=None) -> int | None:
    """The most samples one client's update may claim: `admission.max_num_samples`, else the
    receiving edge's cap on its clients, else the course's default (a deployed server's)."""
    cap = course.cfg["admission.max_num_samples"]
    if cap is None:
        cap = getattr(worker, "client_cap", None)
    return cap if cap is not None else getattr(course, "default_sample_cap", None)


def _distance(content: dict, reference: dict[str, torch.Tensor]) -> float:
    """Euclidean norm (float64) of the update's tensors, the model's taken relative to the
    global model (`reference`, already in float64): how far this update would pull the aggregate."""
    total = 0.0
    for key, value in content.items():
        if not isinstance(value, dict):
            continue
        for name, t in value.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                continue
            ref = reference.get(name) if key == "model" else None
            if t.numel() <= DISTANCE_PIECE:
                d = t.double()
                if ref is not None:
                    d = d - ref
                total += float(torch.sum(d * d))
                continue
            # a large tensor a piece at a time: no float64 copy of it, and a spooled update's
            # pages go back once read (wire/spooled.py)
            flat, ref_flat = t.reshape(-1), None if ref is None else ref.reshape(-1)
            for at in range(0, flat.numel(), DISTANCE_PIECE):
                piece = flat[at:at + DISTANCE_PIECE]
                d = piece.double()
                if ref_flat is not None:
                    d = d - ref_flat[at:at + DISTANCE_PIECE]
                total += float(torch.sum(d * d))
                release(piece)
    return math.sqrt(total)


DISTANCE_PIECE = 2 ** 20   # elements of a large tensor read at a time for its distance


def medians_of_others(values: list[float]) -> list[float]:
    """For each value, the median of all the other values (as `statistics.median` gives it),
    from one sort: removing the value at sorted position p shifts only the positions after p,
    so each median is read off the sorted list, O(n log n) for a round of n updates. A NaN
    counts as infinitely far (it has no place in an order)."""
    n = len(values)
    ranked_values = [v if v == v else math.inf for v in values]
    order = sorted(range(n), key=ranked_values.__getitem__)
    ranked = [ranked_values[i] for i in order]
    half, odd = divmod(n - 1, 2)
    out = [0.0] * n
    for p, i in enumerate(order):
        def kth(k: int) -> float:   # the k-th smallest of the others
            return ranked[k] if k < p else ranked[k + 1]
        out[i] = kth(half) if odd else (kth(half - 1) + kth(half)) / 2
    return out


@dataclass(frozen=True)
class Refusal:
    """Why an update cannot be aggregated, found where the server decoded it on arrival: it
    stands in the update's `model` until admission refuses it, so the round counts its client
    as having replied (it does not wait for it) and, deployed, tells it why."""
    kind: str     # the summary's `admission` count it adds to
    why: str      # what was wrong, for the log line


def decoded_problem(server, update: ReceivedUpdate) -> tuple[str, str] | None:
    """(kind, why) when what `update` decodes to may not be aggregated: a `Refusal` its decoding
    left, or the first problem a check the course's behaviours declare
    (`install.admission_check(server, update)`) finds."""
    model = update.content.get("model") if isinstance(update.content, dict) else None
    if isinstance(model, Refusal):
        return model.kind, model.why
    for name in registry.selected_behaviours(server.course.cfg):
        check = getattr(registry.behaviours.get(name), "admission_check", None)
        problem = check(server, update) if check is not None else None
        if problem is not None:
            return problem
    return None


def admit_updates(server, updates: list[ReceivedUpdate]) -> list[ReceivedUpdate]:
    """The updates that may be aggregated; each refusal is counted and logged."""
    course = server.course
    state = server.state(AdmissionState)
    declared = state.declared
    cap = sample_cap(course, server)
    kept = []
    for u in updates:
        n = u.content.get("num_samples") if isinstance(u.content, dict) else None
        decoded = decoded_problem(server, u)
        if decoded is not None:
            note(server, decoded[0], f"round {server.round}: refused client {u.client_id}'s update: "
                 f"{decoded[1]}")
            continue
        # an update that stands for several clients (secure aggregation's unmasked sum) is
        # bounded by what they declared together
        clients = getattr(u, "contributors", None) or [u.client_id]
        limit = sum(declared[c] for c in clients) if all(c in declared for c in clients) else None
        # an edge speaks for its clients: its own bound, not one client's cap
        own = state.bounds.get(u.client_id)
        if isinstance(n, int) and limit is not None and n > limit:
            note(server, "num_samples above the declared count",
                 f"round {server.round}: refused client {u.client_id}'s update: num_samples {n} "
                 f"exceeds the {limit} it declared when it joined")
        elif isinstance(n, int) and own is not None and n > own:
            note(server, "num_samples above the edge's bound",
                 f"round {server.round}: refused edge {u.client_id}'s update: num_samples {n} "
                 f"exceeds the {own} its clients may hold together")
        elif isinstance(n, int) and own is None and cap is not None and n > cap * len(clients):
            note(server, "num_samples above admission.max_num_samples",
                 f"round {server.round}: refused client {u.client_id}'s update: num_samples {n} "
                 f"exceeds admission.max_num_samples={cap}")
        else:
            kept.append(u)
    ratio = norm_ratio(course)
    if ratio is None:
        return kept
    if state.history is None:
        state.history = Returning(server.round)
    history = state.history
    if len(kept) < 2:   # (a folding round's updates come one at a time: no float64 copy each)
        history.sent(updates, server.round)
        return kept
    reference = {k: t.double() for k, t in server.aggregator.global_state.items()
                 if isinstance(t, torch.Tensor)}   # once per round, not once per update
    norms = [_distance(u.content, reference) for u in kept]
    admitted = []
    for u, norm, median in zip(kept, norms, medians_of_others(norms)):
        bound = ratio * median
        if median <= 0 or norm <= bound:
            admitted.append(u)
            continue
        if math.isfinite(norm) and history.returning(u.client_id, server.round):
            note(server, "update of a returning client scaled to the bound",
                 f"round {server.round}: client {u.client_id} missed rounds; its update's distance "
                 f"{norm:.3g} is scaled to admission.norm_ratio={ratio:g} x the median {median:.3g} "
                 "of the round's others", logging.INFO)
            admitted.append(scaled_update(u, reference, bound / norm))
            history.still_away(u.client_id, server.round)
        else:
            note(server, "update norm far above the round's others",
                 f"round {server.round}: refused client {u.client_id}'s update: its distance "
                 f"{norm:.3g} from the global model exceeds admission.norm_ratio={ratio:g} "
                 f"x the median {median:.3g} of the round's others")
    history.sent(updates, server.round)   # refused ones too: their clients did not miss the round
    return admitted


@dataclass
class Returning:
    """Which clients are returning from missed rounds (paused, lost, late, not sampled).

    The global model moved on without a returning client's data, so its honest update is
    larger than the others' until the model fits its data again, which takes rounds, and
    hovers about the bound meanwhile. Its update above the bound is scaled down to the bound
    instead of refused: it still moves the model no more than an update at the bound, which
    admission admits from anyone, so missing rounds earns no extra influence. A client that
    missed m rounds is returning in the round it comes back in and m rounds more (a late
    joiner missed every round since the first), and for m rounds more after each of its
    updates that had to be scaled: it stops returning once the model fits its data (a client
    whose updates were refused could never get there); a client sending every round keeps the
    plain rule (refusal)."""

    first_round: int             # the first round admission saw
    last: dict[int, int] = field(default_factory=dict)    # client -> last round it sent an update in
    until: dict[int, int] = field(default_factory=dict)   # client -> last round it counts as returning
    span: dict[int, int] = field(default_factory=dict)    # client -> rounds it missed before it came back

    def returning(self, client_id: int, round_: int) -> bool:
        last = self.last.get(client_id, self.first_round - 1)
        return last < round_ - 1 or self.until.get(client_id, -1) >= round_

    def sent(self, updates: list[ReceivedUpdate], round_: int) -> None:
        """Note the round's updates (admitted or not: a refused client did not miss the round)."""
        for u in updates:
            cid = u.client_id
            last = self.last.get(cid, self.first_round - 1)
            if last < round_ - 1:
                self.span[cid] = round_ - 1 - last
                self.until[cid] = round_ + self.span[cid]
            self.last[cid] = max(round_, last)

    def still_away(self, client_id: int, round_: int) -> None:
        """The client's update this round had to be scaled: it stays returning `span` rounds more."""
        self.until[client_id] = max(self.until.get(client_id, -1), round_ + self.span.get(client_id, 1))


@worker_state("admission")
@dataclass
class AdmissionState:
    """What admission keeps on the server (or an edge aggregator). Saved in snapshots, so that
    a resumed course bounds, scales and refuses exactly as the uninterrupted one would, and
    its summary counts refusals from the course's start."""
    declared: dict[int, int] = field(default_factory=dict)   # client -> num_samples of its first join
    counts: dict[str, int] = field(default_factory=dict)     # refusals by kind (summary `admission`)
    told: dict[str, int] = field(default_factory=dict)       # `counts` when clients were last told
    history: Returning | None = None                         # the norm rule's returning clients
    rejected_in_a_row: int = 0                               # aggregates rejected since the last adopted
    # participant -> the most samples it may declare (a cloud's edges); derived from the config
    # and the data at every start, so not saved
    bounds: dict[int, int] = transient(dict)
    # rate-limits log lines by wall-clock time, which a restart resets anyway
    quiet: QuietLog = transient(lambda: QuietLog(log))

    def restored(self, worker) -> None:
        """After a resume: the summary goes on counting from the snapshot's counts."""
        if self.counts:
            _add_counts(worker.course, self.counts)


def scaled_update(u: ReceivedUpdate, reference: dict[str, torch.Tensor], s: float) -> ReceivedUpdate:
    """`u` with its distance from the global model multiplied by `s` (a new content; the model's
    tensors move toward `reference`, other floating tensors are scaled as they are measured)."""
    content = dict(u.content)
    for key, value in u.content.items():
        if not isinstance(value, dict):
            continue
        out = dict(value)
        for name, t in value.items():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                base = reference[name] if key == "model" and name in reference else 0.0
                out[name] = (base + (t.double() - base) * s).to(t.dtype)
        content[key] = out
    return ReceivedUpdate(u.client_id, content, u.round, u.staleness)


def finite_state(state: dict[str, Any]) -> bool:
    return all(_TORCH.all_finite(t) for t in state.values() if isinstance(t, torch.Tensor))


_TORCH = get_form("torch")


class Snapshot:
    """The aggregator's state before an aggregation, to put back if the result is rejected
    (its server optimizer's moments too: a rejected round must not have moved them).

    With `copy=False` it keeps the global model's tensors themselves, not a copy (a model less
    in memory), for an aggregator that replaces them rather than writing them (the FedAvg
    family, whose rounds fold); their version counters tell if one was written after all."""

    def __init__(self, aggregator, copy: bool = True):
        self.aggregator = aggregator
        self.global_state = {k: v.clone() if copy else v for k, v in aggregator.global_state.items()}
        extra = aggregator.state_dict()
        # an aggregator whose folding rounds replace its own state's tensors too (SCAFFOLD's c)
        # says so with `replaces_state`: that state is kept by reference, as the model is
        by_ref = not copy and getattr(aggregator, "replaces_state", False)
        self.extra = extra if by_ref else clone_tree(extra)
        kept = dict(self.global_state)
        if by_ref:
            kept.update({f"{k}/{n}": t for k, v in extra.items() if isinstance(v, dict)
                         for n, t in v.items() if isinstance(t, torch.Tensor)})
        self._kept = kept
        self.versions = None if copy else {k: v._version for k, v in kept.items()}
        self.optimizer = getattr(aggregator, "server_optimizer", None)
        self.moments = self.optimizer.snapshot() if self.optimizer else None

    def restore(self) -> None:
        if self.versions is not None and any(t._version != self.versions[k]
                                             for k, t in self._kept.items()):
            raise RuntimeError(f"{type(self.aggregator).__name__}.aggregate wrote the global model's "
                               "tensors in place, so the previous model cannot be put back; an "
                               "aggregator replaces them (they were broadcast by reference)")
        self.aggregator.global_state = self.global_state
        if self.extra:
            self.aggregator.load_state_dict(self.extra)
        if self.optimizer:
            self.optimizer.load_state_dict(self.moments)


def reject_round(server, why: str) -> bool:
    """The round's aggregate is not adopted (the previous model stays). Returns True when the
    course should run the round again, False when it stops as diverged."""
    course = server.course
    state = server.state(AdmissionState)
    state.rejected_in_a_row += 1
    again = course.wall_clock and state.rejected_in_a_row < course.cfg["admission.max_rejected_rounds"]
    note(server, "rejected rounds", f"round {server.round}: aggregate rejected: {why}; the previous "
         "global model is kept", logging.WARNING if again else logging.INFO)
    if again:
        return True
    server.state(Outcome).diverged = (f"course diverged in round {server.round}: {why} (likely cause: a learning "
                       f"rate too large, e.g. train.optimizer.lr={course.cfg['train.optimizer.lr']:g}, "
                       "or poisoned updates); outputs hold the last finite model")
    return False
