"""Outputs of a run: metrics.jsonl, summary.json, final_model.pt, and its callbacks.

One JSON object per aggregation round. A round's record waits for the client
evaluations it asked for (if any) and is written as soon as it is complete,
always in round order; whatever is still pending at the end is written then.
A deployed server (`hold_one_round`) waits no longer than the next round's end and
`hold_seconds()` (its round deadline: a client not answering by then counts as hung)
from the record's opening: a record still missing evaluations then is written with
those received, and
an evaluation that comes after is written as its own line,
`{"late_eval": {"round": r, "client": k, "acc": ..., "loss": ...}, "wall_time": t}`
(no top-level "round": it is not a round's record), so a lost or hung client
never holds back the records of the rounds after it.
Every other side output (progress, CSV, TensorBoard, MLflow, W&B, a user's own)
is a `Callback` that sees the same records, in the same order, and the summary.
Behaviours add their own summary fields through `add_summary` (or `tally`, `append_summary`),
which refuses a field another behaviour already wrote and a value that is not JSON.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import torch

from fedcore.kernel.files import make_folder, open_fresh, write_atomic
from fedcore.kernel.message import SERVER_ID, Message
from fedcore.wire.spooled import copy_released, is_mapped, release

__all__ = ["Monitor", "Callback", "StopRun", "strict_json"]


class StopRun(BaseException):
    """Raised by a callback to end a simulated course early (e.g. a tuner pruning a trial):
    the course writes its outputs with `stopped_by` set to `reason` and returns its summary.
    A BaseException, like KeyboardInterrupt, so handlers' error wrapping lets it through."""

    def __init__(self, reason: str = "callback"):
        super().__init__(reason)
        self.reason = reason


class Callback:
    """A side output of a run. Override what you need; each is called once per event.

    `on_start(monitor)` before the first record (the outdir exists by then, if any);
    `on_record(record)` for each round's record, in round order, as it is written to
    metrics.jsonl (raise `StopRun` there to end the course early); `on_end(summary)` once,
    with the summary (also when interrupted: `summary["stopped_by"] == "interrupted"`)."""

    def on_start(self, monitor: "Monitor") -> None:
        pass

    def on_record(self, record: dict[str, Any]) -> None:
        pass

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


@dataclass
class _Pending:
    record: dict[str, Any]
    expected: int = 0
    client_metrics: list[dict] = field(default_factory=list)
    opened: float = 0.0          # this process's wall time when the record was opened

    @property
    def complete(self) -> bool:
        return len(self.client_metrics) >= self.expected


def strict_json(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None, so the JSON written is strict."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def _dumps(obj: Any, **kw) -> str:
    return json.dumps(strict_json(obj), allow_nan=False, **kw)


def _not_json(value: Any, path: str) -> str | None:
    """Why `value` would not be written as the same JSON value (None when it would). A float
    that is not finite is fine: it is written as null."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_not_json(v, f"{path}[{i}]") for i, v in enumerate(value))), None)
    if isinstance(value, dict):
        for k, v in value.items():
            why = (f"{path} has the key {k!r}, not a string" if not isinstance(k, str)
                   else _not_json(v, f"{path}[{k!r}]"))
            if why:
                return why
        return None
    return f"{path} is a {type(value).__name__}, not a JSON value"


# the summary fields the monitor writes itself
_OWN_FIELDS = ("rounds", "virtual_time", "wall_time", "bytes_up", "bytes_down", "bytes_eval", "final",
               "final_test_acc", "best_test_acc", "best_round", "target_acc", "time_to_target",
               "rounds_to_target")


def _spread(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    mean = sum(v) / len(v)
    std = math.sqrt(sum((x - mean) ** 2 for x in v) / len(v))
    p10 = v[min(len(v) - 1, int(math.floor(0.1 * (len(v) - 1) + 0.5)))]
    return {f"{prefix}_mean": mean, f"{prefix}_std": std, f"{prefix}_p10": p10}


class Monitor:
    """Collects per-round records and byte counts; writes the run's output files."""

    def __init__(self, outdir: Path | None, target_acc: float | None = None, *,
                 total_rounds: int = 0, callbacks: list[Callback] | tuple = ()):
        self.outdir = Path(outdir) if outdir is not None else None
        self.target_acc = target_acc
        self.total_rounds = total_rounds
        self.callbacks = list(callbacks)
        self.started = False
        self.t0 = time.perf_counter()
        self.bytes_up = self.bytes_down = 0          # since the last record
        self.total_up = self.total_down = 0
        # Message types counted apart from training traffic (e.g. evaluation requests/replies),
        # so bytes_up/bytes_down compare algorithms' communication honestly.
        self.separate_types: set[str] = set()
        self.bytes_other = self.total_other = 0
        self.records: list[dict[str, Any]] = []      # written records, in order
        self.lines_written = 0                       # lines in metrics.jsonl (records, late evals)
        self.hold_one_round = False                  # deployment: see the module's docstring
        self.hold_seconds = lambda: 0.0              # ... and how long a record waits at least
        self._last_round: int | None = None          # the latest round whose record was opened
        self._closed_rounds: set[int] = set()        # rounds written before all their evals came
        self._pending: dict[int, _Pending] = {}
        self._metrics_file = None
        self.time_to_target: float | None = None
        self.rounds_to_target: int | None = None
        self._summary: dict[str, Any] = {}
        self._summary_owner: dict[str, str] = dict.fromkeys(_OWN_FIELDS, "monitor")
        self.extra_summary = MappingProxyType(self._summary)   # read-only: write with add_summary

    def start(self) -> None:
        """Create the outdir, open metrics.jsonl and start the callbacks (once; also implied by
        the first record), so building a course or checking it leaves no files behind."""
        if self.started:
            return
        self.started = True
        if self.outdir is not None:
            make_folder(self.outdir)
            self._metrics_file = open_fresh(self.outdir / "metrics.jsonl")
        for callback in self.callbacks:
            callback.on_start(self)

    @property
    def wall_time(self) -> float:
        return time.perf_counter() - self.t0

    # ------------------------------------------------------------ bytes
    def count_bytes(self, msg: Message, receiver: int, nbytes: int) -> None:
        """Called by the communicator for each copy of each message sent."""
        if msg.msg_type in self.separate_types:
            self.bytes_other += nbytes
            self.total_other += nbytes
        elif receiver == SERVER_ID:
            self.bytes_up += nbytes
            self.total_up += nbytes
        else:
            self.bytes_down += nbytes
            self.total_down += nbytes

    # ------------------------------------------------------------ records
    def record_round(self, round_: int, virtual_time: float, fields: dict[str, Any],
                     expected_client_metrics: int = 0) -> None:
        """Open the record of an aggregation round; it is written once complete."""
        record = {"round": round_, "virtual_time": virtual_time, "wall_time": self.wall_time,
                  "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                  # running totals, so curves against communication need no summing
                  "bytes_up_total": self.total_up, "bytes_down_total": self.total_down,
                  "bytes_total": self.total_up + self.total_down}
        if self.separate_types:
            record["bytes_eval"] = self.bytes_other
            record["bytes_eval_total"] = self.total_other
        record.update(fields)
        self.bytes_up = self.bytes_down = self.bytes_other = 0
        self._last_round = round_
        if self.hold_one_round:   # a round has ended: earlier records may wait no longer
            self._flush(before=round_)
        self._pending[round_] = _Pending(record, expected_client_metrics, opened=self.wall_time)
        acc = record.get("test_acc")
        if self.target_acc is not None and self.time_to_target is None and acc is not None \
                and acc >= self.target_acc:
            self.time_to_target, self.rounds_to_target = virtual_time, round_
        self._flush()

    def add_client_metrics(self, round_: int, client_id: int, metrics: dict[str, float]) -> None:
        pending = self._pending.get(round_)
        if pending is None:
            if round_ in self._closed_rounds:   # its record was written without it
                # the round and the client are the server's, never a metric's name
                self._write_line({"late_eval": {**metrics, "round": round_, "client": client_id},
                                  "wall_time": self.wall_time})
            return  # arrived after the record was closed: nothing to attach it to
        pending.client_metrics.append(metrics)
        self._flush()

    def close_overdue(self) -> None:
        """Deployment, called periodically: write the records whose evaluations are overdue
        (a later round has ended and they have waited `hold_seconds()`)."""
        if self.hold_one_round and self._last_round is not None:
            self._flush(before=self._last_round)

    def _write_line(self, obj: dict[str, Any]) -> None:
        self.lines_written += 1
        if self._metrics_file is not None:
            self._metrics_file.write(_dumps(obj) + "\n")
            self._metrics_file.flush()

    def _flush(self, force: bool = False, before: int | None = None) -> None:
        """Write the complete records in round order (`force`: all; `before`: also the
        incomplete ones of rounds before that one)."""
        self.start()
        opened_before = self.wall_time - self.hold_seconds() if before is not None else None
        for round_ in sorted(self._pending):
            pending = self._pending[round_]
            cut_short = force or (before is not None and round_ < before
                                  and pending.opened <= opened_before)
            if not (pending.complete or cut_short):
                break
            if not pending.complete and self.hold_one_round:
                self._closed_rounds.add(round_)
            record = pending.record
            if pending.client_metrics:
                record.update(_spread([m["acc"] for m in pending.client_metrics if "acc" in m],
                                      "client_test_acc"))
                record.update(_spread([m["loss"] for m in pending.client_metrics if "loss" in m],
                                      "client_test_loss"))
                record.update(_spread([m["perplexity"] for m in pending.client_metrics if "perplexity" in m],
                                      "client_test_perplexity"))
                record["client_evals"] = len(pending.client_metrics)
            del self._pending[round_]
            self.records.append(record)
            self._write_line(record)
            for callback in self.callbacks:
                callback.on_record(record)

    def open_records(self) -> dict[int, dict]:
        """Records still waiting for client evaluations: {round: {record, expected}}."""
        return {r: {"record": p.record, "expected": p.expected} for r, p in self._pending.items()}

    def preload(self, records: list[dict], pending: dict, totals: list[int], target: list,
                keep_lines: int | None = None, wall_time: float | None = None) -> None:
        """Continue from a checkpoint: its written records, open records, byte totals, target,
        and its `wall_time`, from which this run's goes on (a checkpoint without it: from the
        last record's).
        `keep_lines`: the outdir's metrics.jsonl already holds these records in its first that
        many lines (a deployed server resuming in place): keep them, drop the lines after them
        (rounds the snapshot does not hold, which the resumed course runs again)."""
        kept = self._kept_lines(keep_lines, len(records))
        if wall_time is None:
            wall_time = max((float(r.get("wall_time", 0.0)) for r in records), default=0.0)
        self.t0 = time.perf_counter() - wall_time
        self.start()
        self.records.extend(records)
        if kept is not None:
            self._metrics_file.write(kept)
            self._metrics_file.flush()
            self.lines_written = keep_lines
        else:
            for record in records:
                self._write_line(record)
        for round_, p in pending.items():
            self._pending[int(round_)] = _Pending(dict(p["record"]), int(p["expected"]),
                                                  opened=self.wall_time)
        self._last_round = max([r["round"] for r in records] + [int(r) for r in pending],
                               default=None)
        self.total_up, self.total_down, self.total_other = totals
        self.time_to_target, self.rounds_to_target = target

    def _kept_lines(self, keep: int | None, records: int) -> str | None:
        """The first `keep` lines of the outdir's metrics.jsonl, where it has them and they hold
        `records` round records (else None: the records are written anew)."""
        if keep is None or self.outdir is None or self.started:
            return None
        try:
            lines = (self.outdir / "metrics.jsonl").read_text().splitlines(keepends=True)[:keep]
        except (OSError, UnicodeDecodeError):
            return None
        if len(lines) < keep or not all(line.endswith("\n") for line in lines):
            return None
        if sum(1 for line in lines if line.startswith('{"round"')) != records:
            return None
        return "".join(lines)

    # ------------------------------------------------------------ summary fields of behaviours
    def add_summary(self, section: str, fields: Mapping[str, Any]) -> None:
        """Set summary fields on behalf of `section` (the behaviour that writes them). A field
        belongs to the first section that writes it: another one writing the same name is
        refused, so two behaviours never overwrite each other's results unseen. Values are JSON
        (a non-finite float is written as null); a dict or list given stays live until the end."""
        for name, value in fields.items():
            self._check(section, name, value)
        for name, value in fields.items():
            self._summary_owner[name] = section
            self._summary[name] = value

    def tally(self, section: str, name: str, key: str | None = None, by: int = 1) -> None:
        """Add `by` to the summary's count `name`, or to `name[key]` in its dict of counts."""
        self._check(section, name, by)
        if key is None:
            self.add_summary(section, {name: self._summary.get(name, 0) + by})
        else:
            counts = dict(self._summary.get(name, {}))
            counts[key] = counts.get(key, 0) + by
            self.add_summary(section, {name: counts})

    def append_summary(self, section: str, name: str, entry: Any, limit: int | None = None) -> None:
        """Append `entry` to the summary's list `name` (kept to its first `limit` entries)."""
        self._check(section, name, entry)
        self._summary_owner[name] = section
        entries = self._summary.setdefault(name, [])
        if limit is None or len(entries) < limit:
            entries.append(entry)

    def _check(self, section: str, name: str, value: Any) -> None:
        owner = self._summary_owner.get(name, section)
        if owner != section:
            raise ValueError(f"summary field {name!r} is written by {owner!r}; {section!r} may not "
                             "write it too (choose another name)")
        why = _not_json(value, name)
        if why:
            raise TypeError(f"summary field from {section!r}: {why}")

    # ------------------------------------------------------------ the end
    def summary(self, virtual_time: float) -> dict[str, Any]:
        evals = [r for r in self.records if "test_acc" in r]
        best = max(evals, key=lambda r: r["test_acc"], default=None)
        final = {k: v for k, v in (self.records[-1] if self.records else {}).items()}
        out = {
            "rounds": len(self.records),
            "virtual_time": virtual_time,
            "wall_time": self.wall_time,
            "bytes_up": self.total_up,
            "bytes_down": self.total_down,
            "bytes_eval": self.total_other,
            "final": final,
            "final_test_acc": evals[-1]["test_acc"] if evals else None,
            "best_test_acc": best["test_acc"] if best else None,
            "best_round": best["round"] if best else None,
        }
        if self.target_acc is not None:
            out["target_acc"] = self.target_acc
            out["time_to_target"] = self.time_to_target
            out["rounds_to_target"] = self.rounds_to_target
        out.update(self._summary)
        return out

    def finalize(self, virtual_time: float, global_state: dict[str, torch.Tensor] | None) -> dict:
        """Write what is pending, the final model and the summary; return the summary."""
        self._flush(force=True)
        summary = self.summary(virtual_time)
        if self.outdir is not None:
            if self._metrics_file is not None:
                self._metrics_file.close()
            if global_state is not None:
                final = {k: _alone(v) for k, v in global_state.items()}
                write_atomic(self.outdir / "final_model.pt", lambda fh: torch.save(final, fh))
            write_atomic(self.outdir / "summary.json", _dumps(summary, indent=2) + "\n")
        for callback in self.callbacks:
            callback.on_end(summary)
        return summary


def _alone(t: torch.Tensor) -> torch.Tensor:
    """`t` on the CPU as `torch.save` should get it: a tensor that is the whole of its storage as
    it is (a large model's final mean: no copy at the course's end); a view of a larger storage
    (a received message's bytes, a file the model waited in) copied, or all of it would be saved."""
    t = t.detach().cpu()
    if t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    if is_mapped(t):   # a parked or spilled model: what was read of it goes back, and the copy
        release(t)     # reads it a slice at a time (wire/spooled.py)
        out = torch.empty_like(t, memory_format=torch.contiguous_format)
        copy_released(out, t)
        return out
    return t.clone()
