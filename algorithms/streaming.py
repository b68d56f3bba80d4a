"""Streaming aggregation: each update is folded into a running weighted sum as it arrives.

A FedAvg-family aggregator needs of a round's updates only sum_i w_i x_i and sum_i w_i
(the models' weighted mean and its weight): FedAvg and FedProx, every server optimizer
(FedAvgM, FedAdam, FedYogi, FedAdagrad step from that mean), DiLoCo's outer step
(uniform weights) and FedMoS's server momentum. So the synchronous course's buffer can be
a `FoldingBuffer`: an arriving update passes admission's per-update checks, is weighted
by the aggregator's own rule and added to a float64 running sum, and is let go. The
server then holds the global model and the running sum (float64: twice a float32 model),
however many clients send (a deployed server keeps the global model in a file meanwhile,
runtime/parking.py; a simulation of a large model the sum and its mean too,
algorithms/spill.py); at the round's end the aggregator receives one update carrying the
mean (with `contributors` naming the clients, as a secure sum does), whose weighted mean
is itself.

The float64 sum makes the result the exact mean up to float64 rounding, whatever the
order updates arrive in, then rounded once to the model's dtype; the list-based path
sums in the model's dtype, so the two agree to that dtype's rounding (float32: ~1e-7
relative). A sum in the model's own dtype saves a model, but its result depends on the
arrival order (deployment against simulation): it is offered, not the default
(`aggregator.streaming_sum: model`); a compensated float32 sum needs a second float32
tensor, as much as the float64 one. An update is folded once whole: its
checks (finite values, its weight, the message's SHA-256 at its end) come before it may
touch the sum, and a float64 addition cannot be taken back exactly. A deployed server
therefore receives a large update into a file (wire/spooled.py), not its memory, and the
finiteness check and the fold read it a slice at a time, giving each slice's pages back;
the sum is kept in pieces, so the mean is cast piece by piece as the sum is let go. Central
DP replaces the mean with a rule that folds too: the sum of the clipped deltas
(`folding_rule`, algorithms/dp_fold.py). Rules that need every update at once keep the
list: robust rules (their combination replaces the mean, `combine.replace_combination`),
admission's influence check (a median over the round, where `admission.norm_ratio` is
set), FedEx, and aggregators with a rule of their own that does not fold (FedBuff, pFedMe,
asynchronous courses; SCAFFOLD, FedDyn and FedNova fold several sums, `folded_keys`,
`fold_parts`). Those hold k updates of a round: k times the model. See docs/compression.md
(large models) and docs/performance.md (W8).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from fedcore.runtime import admission
from fedcore.runtime.parking import Parking, model_bytes, round_spills
from fedcore.wire.spooled import blank, is_mapped, release

from fedcore.algorithms.combine import COMBINED, models_only
from fedcore.kernel import registry
from fedcore.kernel.config import declare
from fedcore.kernel.contract import Aggregator, ReceivedUpdate
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.message import Message
from fedcore.kernel.schema import clients_per_round
from fedcore.kernel.server_state import worker_state

log = logging.getLogger("fedcore.course")

__all__ = ["RunningMean", "FoldingBuffer", "fold_when_sent", "folds", "folded_keys", "round_buffer", "sum_slices",
           "AUTO_MIN_BYTES"]

AUTO_MIN_BYTES = 16 * 2 ** 20   # `auto` folds models at least this large

declare("aggregator.streaming", str, "auto", "fold each update into a running weighted sum as it "
        "arrives, so server memory does not grow with the clients (FedAvg-family rules): on, off, "
        "or auto (on for models of 16 MiB or more, where the rule allows it)",
        choices=("auto", "on", "off"))
declare("aggregator.streaming_sum", str, "float64", "dtype of the running sum of a folding round: "
        "float64 (the exact mean, whatever order the updates arrive in; twice a float32 model) or "
        "model (the model's own dtype: one float32 model less on the server, but a mean that "
        "depends on the arrival order to that dtype's rounding, so a deployed course equals its "
        "simulation only to that rounding)", choices=("float64", "model"))


class RunningMean:
    """sum_i w_i x_i (float64, or each floating entry's own dtype) and sum_i w_i over models
    folded one at a time.

    Each entry's sum is kept in pieces of SUM_PIECE elements, so that the mean, cast to the
    entry's dtype into memory the system maps only as it is written, lets each piece go as
    it is cast: the sum and the mean are never whole at once (2 models at the round's end,
    not 3). As the list-based mean does, a round whose weights are all zero is averaged
    uniformly: until a positive weight arrives the sum is unweighted, and it restarts at
    that weight."""

    def __init__(self, in_model_dtype: bool = False, spill: bool = False, folder: str | None = None) -> None:
        self.in_model_dtype = in_model_dtype   # floating entries summed in their own dtype
        self.spill, self.folder = spill, folder   # the sum in a file in `folder` (see `_blank_sum`)
        self.sum: dict[str, list[torch.Tensor]] | None = None
        self.like: dict[str, tuple[torch.dtype, torch.Size]] = {}
        self.total = 0.0      # sum of the positive weights
        self.count = 0        # models folded while every weight was zero

    def start(self, model: dict[str, torch.Tensor]) -> None:
        """A zero sum shaped like `model`, in pieces (in a file where it spills)."""
        self.sum = self._blank_sum(model) if self.spill else None
        if self.sum is None:
            self.sum = {n: [torch.zeros(min(SUM_PIECE, t.numel() - at), dtype=self._sum_dtype(t),
                                        device=t.device) for at in range(0, t.numel(), SUM_PIECE)]
                        for n, t in model.items()}
        self.like = {n: (t.dtype, t.shape, t.device) for n, t in model.items()}

    def fold(self, model: dict[str, torch.Tensor], weight: float) -> None:
        if self.sum is None:
            self.start(model)
        if weight > 0:
            if self.total == 0 and self.count:
                for pieces in self.sum.values():
                    for piece in pieces:
                        piece.zero_()
                        release(piece)
            self.total += weight
        elif self.total == 0:
            self.count += 1
            weight = 1.0
        else:
            return     # weight zero among positive weights: it adds nothing
        for name, pieces in self.sum.items():
            _add_scaled(pieces, model[name], weight)

    def _blank_sum(self, model: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]] | None:
        """The sum's pieces as views of a new unlinked file in `folder` (wire/spooled.py `blank`),
        each piece's pages given back once added to: the same float64 additions in the same
        order, with the sum in the system's page cache instead of the process. None (the sum
        in memory) where a tensor is not on the CPU or the file cannot be made (said once)."""
        if any(t.device.type != "cpu" for t in model.values()):
            return None
        try:
            flat = blank({n: ((t.numel(),), self._sum_dtype(t)) for n, t in model.items()}, self.folder)
        except OSError as exc:
            log.warning("aggregator.spill: the running sum could not be kept in a file in %s (%s); it "
                        "stays in memory", self.folder or "the temporary folder", exc)
            self.spill = False
            return None
        return {n: [f[at:at + SUM_PIECE] for at in range(0, f.numel(), SUM_PIECE)] for n, f in flat.items()}

    def _blank_mean(self) -> dict[str, torch.Tensor]:
        """Where a spilled sum's mean is written: a new file of its own (the next global model,
        parked as it is made, runtime/parking.py), or nothing (memory) where it cannot be made."""
        try:
            return blank({n: (tuple(shape), dtype) for n, (dtype, shape, _) in self.like.items()}, self.folder)
        except OSError as exc:
            log.warning("aggregator.spill: the round's mean could not be kept in a file in %s (%s); it "
                        "is made in memory", self.folder or "the temporary folder", exc)
            return {}

    def _sum_dtype(self, t: torch.Tensor) -> torch.dtype:
        return t.dtype if self.in_model_dtype and t.is_floating_point() else torch.float64

    @property
    def weight(self) -> float:
        return self.total if self.total > 0 else float(self.count)

    def mean(self, divide: bool = True) -> dict[str, torch.Tensor]:
        """The weighted mean in each entry's own dtype (integers rounded), or with `divide`
        False the sum itself; releases the sum."""
        out, divisor, sums = {}, (self.weight if divide else 1.0), self.sum or {}
        self.sum = None
        spilled = self._blank_mean() if sums and all(is_mapped(p[0]) for p in sums.values() if p) else {}
        for name in list(sums):
            pieces, (dtype, shape, device) = sums.pop(name), self.like[name]
            mean = spilled.get(name)   # in a file like the sum, or in memory mapped as it is written
            mean = torch.empty(shape, dtype=dtype, device=device) if mean is None else mean
            flat, at = mean.view(-1), 0
            pieces.reverse()
            while pieces:
                piece = pieces.pop()   # each piece let go once cast
                piece.div_(divisor)
                if not dtype.is_floating_point:
                    piece.round_()
                flat[at:at + piece.numel()].copy_(piece)
                release(piece)   # a spilled sum's pages go back to its file, and its mean's
                release(flat[at:at + piece.numel()])
                at += piece.numel()
                del piece
            out[name] = mean
        return out


FOLD_STEP = 2 ** 20   # elements cast to float64 at a time while folding
SUM_PIECE = 2 ** 21   # elements of one piece of a running sum (16 MiB in float64)


def sum_slices(numel: int):
    """(piece, its from, its to, flat from) of each slice of FOLD_STEP elements of an entry of
    `numel` elements whose running sum is kept in pieces of SUM_PIECE elements."""
    for index, start in enumerate(range(0, numel, SUM_PIECE)):
        size = min(SUM_PIECE, numel - start)
        for lo in range(0, size, FOLD_STEP):
            yield index, lo, min(lo + FOLD_STEP, size), start + lo


def _add_scaled(pieces: list[torch.Tensor], t: torch.Tensor, weight: float) -> None:
    """pieces += weight * t in the pieces' dtype, a slice at a time: adding a float32 tensor to
    a float64 one whole would first cast all of it (a temporary twice the tensor's size)."""
    flat = t.reshape(-1)
    for index, lo, hi, at in sum_slices(flat.numel()):
        acc, part = pieces[index][lo:hi], flat[at:at + hi - lo]
        acc.add_(part.to(acc.dtype), alpha=weight)
        release(part)   # a spooled update's pages go back once folded (wire/spooled.py)
        release(acc)    # and a spilled sum's (`RunningMean._blank_sum`)


class FoldingBuffer:
    """A synchronous round's updates, folded as they arrive; `received` and `admitted` keep
    only who sent what (records without the model), for the round's record and refusals."""

    def __init__(self, server) -> None:
        self.server = server
        parking = server.state(Parking)
        spill = round_spills(server)
        self.keys = folded_keys(server.aggregator)   # running sum -> summed (else a weighted mean)
        # the update's entries the fold reads: the sums' own keys, or what `fold_parts` reads
        self.reads = tuple(getattr(server.aggregator, "fold_reads", self.keys))
        self.runnings = {k: RunningMean(server.course.cfg["aggregator.streaming_sum"] == "model", spill,
                                        parking.folder) for k in self.keys}
        self.running = self.runnings[next(k for k, summed in self.keys.items() if not summed)]
        # central DP (algorithms/dp_fold.py): each update's clipped delta summed instead
        self.rule = getattr(server.aggregator, "folding_rule", None)
        if self.rule is not None:
            self.running = self.runnings["model"] = self.rule.start(spill, parking.folder)
        self.received: list[ReceivedUpdate] = []
        self.admitted: list[ReceivedUpdate] = []
        self.sent: dict[int, bool] = {}   # client -> admitted, for updates folded as they were sent

    def fold_sent(self, update: ReceivedUpdate) -> None:
        """Simulation: admit and fold `update` as its client sends it (`fold_when_sent`); its
        arrival only records it."""
        self.sent[update.client_id] = self._fold(update)

    def append(self, update: ReceivedUpdate) -> None:
        record = ReceivedUpdate(update.client_id, {"num_samples": update.content.get("num_samples")},
                                update.round, update.staleness)
        self.received.append(record)
        folded = self.sent.pop(update.client_id, None)
        if folded if folded is not None else self._fold(update):
            self.admitted.append(record)

    def _fold(self, update: ReceivedUpdate) -> bool:
        kept = admission.admit_updates(self.server, [update])
        if kept:
            update = kept[0]
            agg = self.server.aggregator
            weight = float(agg.weights([update])[0])
            if self.rule is not None:
                models_only(update, agg.combination)
                self.rule.fold(self.running, update.content["model"], agg.global_state, update.client_id,
                               weight)
                return True
            parts = getattr(agg, "fold_parts", None)   # (entries, weight) per running sum
            parts = parts(update, weight) if parts is not None else {
                k: (update.content[k], 1.0 if summed else weight) for k, summed in self.keys.items()}
            for key, (entries, w) in parts.items():
                self.runnings[key].fold(entries, w)
        return bool(kept)

    def __len__(self) -> int:
        return len(self.received)

    def combined(self) -> ReceivedUpdate:
        """One update standing for the admitted ones: their weighted mean, weighing their total."""
        ids = sorted(r.client_id for r in self.admitted)
        weight, round_ = self.running.weight, self.admitted[0].round
        if self.rule is not None:   # the rule's own result, which the aggregator takes as it is
            model, metrics = self.rule.combined(self.running, round_, self.server.aggregator.global_state)
            one = ReceivedUpdate(ids[0], {"model": model, "num_samples": weight, COMBINED: metrics},
                                 round_, 0, owned=True)
            one.contributors = ids
            return one
        content = {k: self.runnings[k].mean(divide=not summed) for k, summed in self.keys.items()}
        if hasattr(self.server.aggregator, "fold_parts"):   # its own weights: their totals too
            content["folded_weights"] = {k: r.weight for k, r in self.runnings.items()}
        one = ReceivedUpdate(ids[0], {**content, "num_samples": weight}, round_, 0, owned=True)
        one.contributors = ids
        return one


def fold_when_sent(server, collect) -> Callable[[Message, int], None]:
    """A simulation's tap (InProcessComm.taps): an update on its way to `server` for the round
    it waits for is admitted and folded when it is sent, not when it arrives, and its model let
    go at once. A simulation's client trains when the broadcast reaches it, so a round's updates
    would otherwise all wait in the scheduler, k models, until their virtual arrival times.

    It folds only what the arrival would fold: the server's own `collect` handler, with no
    observer, takes the updates of a synchronous round, which ends only once every selected
    client's reply has arrived (a reply the time model drops is never tapped), so each update
    tapped here arrives in its round. Bytes and times were counted from the whole message
    before. The sum's order becomes the order of sending instead of arrival: a float64 sum of
    the same terms, equal to float64 rounding before its cast to the model's dtype."""
    def tap(msg: Message, receiver: int) -> None:
        buffer, content = server.buffer, msg.content
        if (receiver != server.id or msg.msg_type != "updates" or not isinstance(buffer, FoldingBuffer)
                or server.finished or msg.round != server.round or msg.sender not in server.selected
                or msg.sender in buffer.sent or not isinstance(content, dict)
                or not all(isinstance(content.get(k), dict) for k in buffer.reads)):
            return
        handlers = server.handlers
        entry = handlers.entries.get("receiving_updates")
        if entry is None or entry.fn is not collect or handlers.observers.get("receiving_updates"):
            return
        buffer.fold_sent(ReceivedUpdate(msg.sender, content, msg.round, 0))
        for key in buffer.reads:
            content.pop(key)
    return tap


def folded_keys(aggregator) -> dict[str, bool]:
    """The update's entries a folding round sums, each a model-shaped dict: summed as they
    are (True) or as the aggregator's weighted mean (False); an aggregator that folds more
    than the model says so with `folded` (SCAFFOLD: the mean model delta, the summed
    control-variate deltas)."""
    return dict(getattr(aggregator, "folded", {"model": False}))


def folds(aggregator) -> bool:
    """Whether `aggregator` depends on a round's updates only through their weighted mean:
    the class that defines its `aggregate` is the contract's (FedAvg) or says so with
    `streams_updates = True`, and no behaviour replaced its combination of updates, or the
    one that did folds too (central DP, `folding_rule`) over an aggregator that needs only
    the mean model (not FedNova's or SCAFFOLD's parts)."""
    owner = next(c for c in type(aggregator).__mro__ if "aggregate" in vars(c))
    plain = owner is Aggregator or bool(vars(owner).get("streams_updates", False))
    if getattr(aggregator, "combination", None) is None:
        return plain
    return (plain and getattr(aggregator, "folding_rule", None) is not None
            and folded_keys(aggregator) == {"model": False} and not hasattr(aggregator, "fold_parts"))


def _model_bytes(aggregator) -> int:
    return model_bytes(aggregator.global_state)


def _why_not(server) -> str | None:
    cfg = server.course.cfg
    if cfg["fedex.candidates"] is not None:
        return "FedEx's aggregation reads each update's feedback"
    if not folds(server.aggregator):
        label = getattr(server.aggregator, "combination", None)   # a rule that replaced the mean
        return (f"{label} needs every update at once" if label else
                f"the {cfg['algorithm.name']} aggregation needs every update at once")
    ratio = admission.norm_ratio(server.course)
    if ratio is not None and not math.isinf(ratio):
        return ("admission.norm_ratio compares each update with the round's others (set "
                "admission.norm_ratio: .inf to turn that check off)")
    return None


def round_buffer(server) -> list | FoldingBuffer:
    """The buffer a synchronous round collects into: folding where the rule and the config
    allow it (`aggregator.streaming`), else a list."""
    mode = server.course.cfg["aggregator.streaming"]
    if mode == "off":
        return []
    why = _why_not(server)
    size = _model_bytes(server.aggregator)
    if why is not None:
        told = server.state(StreamingState)
        if mode == "auto" and size >= AUTO_MIN_BYTES and not told.said_not_folded:
            told.said_not_folded = True   # said once, as the first round starts
            k = clients_per_round(server.course.cfg)
            log.warning("aggregator.streaming: updates are not folded (%s): a round holds its %d "
                        "updates until it aggregates them, %d x %.0f MB (a deployed server keeps "
                        "each in a file, distribute.spool_bytes; the robust rules read them a band "
                        "at a time)", why, k, k, size / 1e6)
        return []
    if mode == "auto" and size < AUTO_MIN_BYTES:
        return []
    return FoldingBuffer(server)


@worker_state("streaming")
@dataclass
class StreamingState:
    """Whether the server has said that a large model's rounds keep their list (a restarted
    server says it again)."""
    transient = True
    said_not_folded: bool = False


def install(course) -> None:
    """`aggregator.streaming: on` where no update can be folded is refused when the course is built."""
    if course.server is None or course.cfg["course"] != "sync":
        why = None if course.server is None else "only synchronous rounds fold (course: sync)"
    else:
        why = _why_not(course.server)
    if why is not None:
        raise ConfigError(f"aggregator.streaming: on cannot fold updates here: {why}; "
                          "set aggregator.streaming to auto or off")


install.enabled = lambda cfg: cfg["aggregator.streaming"] == "on"
registry.behaviours.register("streaming_aggregation", install)
