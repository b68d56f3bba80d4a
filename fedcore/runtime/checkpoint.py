"""Checkpoints of a simulated course at round boundaries, and resuming from one.

A checkpoint is written right after an aggregation: the global model, the
aggregator's own state, every behaviour's typed server state (`server.states`,
see `fedcore.kernel.server_state`: admission's, secure aggregation's, ...) and the
plug-in states registered here (the privacy ledger, the server optimizer),
every logical client's state, the sampler's and torch's random state, the
records written so far and the open record of the round just aggregated. Resuming restores all of it, re-sends that round's
evaluation requests if it asked for any, and raises `all_joined_in` at the
checkpoint's virtual time, so a resumed course continues exactly where the
original was (same models, same metrics; only `bytes_eval` counts the
re-sent evaluation requests again). Files are read with `weights_only=True`, and checked
as inputs before any of it is used (`fedcore.runtime.snapshot_input`).

Ctrl-C or SIGTERM during a simulation (`stop_at_round_end`) lets the round in
progress finish, writes its checkpoint whatever `checkpoint.every` says, and
stops; a second one stops at once (keeping the last checkpoint written, if any).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from fedcore.kernel.config import declare, non_negative, validator
from fedcore.runtime.device import CPU, to_cpu, to_device
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.file_tag import load_key
from fedcore.kernel.files import make_folder
from fedcore.runtime.snapshot import LATEST, in_run_folder, interrupts_deferred, write_snapshot
from fedcore.runtime.snapshot_input import FORMAT, load, load_tensor_file

__all__ = ["Checkpointer", "resume", "load_tensor_file", "stop_at_round_end"]

log = logging.getLogger("fedcore.checkpoint")

declare("checkpoint.every", int, None, "write a checkpoint (snapshot) every k rounds (0: off; "
        "default: 0 in simulation, 1 on a deployed server)", check=non_negative)
declare("checkpoint.path", str, None, "folder for checkpoints (default: <outdir>/checkpoints)")
declare("checkpoint.keep", int, None, "newest checkpoints kept in checkpoint.path, older ones "
        "removed once a new one is complete (0: all; default: all in simulation, 2 on a deployed "
        "server)", check=non_negative)
declare("resume_from", str, None, "a checkpoint file (round_<k>.pt) to resume a course from; "
        "a run folder: the newest complete one in its checkpoints folder (or in the folder itself); "
        "or latest: the newest complete one in checkpoint.path (any way, a round_<k>.pt that does "
        "not load or is not intact - an entry missing, a tensor of another shape, NaN or "
        "infinite - is skipped, with a warning line, for the newest older one beside it)")


@validator
def _check_resume(cfg) -> None:
    path = cfg["resume_from"]
    if path and path != LATEST and Path(path).is_dir():
        in_run_folder(Path(path))   # a folder without a snapshot: said now, in one line
    elif path and path != LATEST and not Path(path).is_file():
        raise ConfigError(f"resume_from: checkpoint '{path}' does not exist")
    if path and cfg["course"] == "async" and cfg.get("distribute.role") is None:
        # A checkpoint holds no updates in flight, no buffer and no timers: resuming such a
        # course could not continue it exactly (and the async handlers have no `resume`). A
        # deployed server resumes one anyway: its clients are sent the model again when they
        # rejoin, which is what a deployed async course does with lost clients in any case.
        raise ConfigError("resume_from: a course on asyn.* strategies (async, over-selection, "
                          "time_up) cannot be resumed, its in-flight updates are not in the "
                          "checkpoint; rerun it from the start or resume a synchronous course")


class Checkpointer:
    """Writes `round_<k>.pt` every `checkpoint.every` rounds (see `fedcore.runtime.snapshot`)."""

    def __init__(self, course):
        self.course = course
        cfg = course.cfg
        deployed = course.wall_clock
        every = cfg["checkpoint.every"]
        self.every = (1 if deployed else 0) if every is None else every
        keep = cfg["checkpoint.keep"]
        self.keep = (2 if deployed else 0) if keep is None else keep
        folder = cfg["checkpoint.path"]
        if folder is None and course.outdir is not None:
            folder = course.outdir / "checkpoints"
        self.folder = Path(folder) if folder is not None else None
        if self.every and self.folder is None:
            if every is None:   # the deployed default, with nowhere to write: off
                self.every = 0
            else:
                raise ConfigError("checkpoint.every: set checkpoint.path or outdir so checkpoints have a place")
        if self.every and not deployed and cfg["course"] == "async":
            log.warning("checkpoint.every: a simulated course on asyn.* strategies cannot be resumed "
                        "from its checkpoints (they hold no updates in flight): they keep the global "
                        "model for inspection only")
        self.key = load_key(cfg)   # checkpoint.hmac_key_file: tag snapshots, refuse untagged ones
        if self.every:
            try:  # now, not at the first checkpoint after a round of training
                make_folder(self.folder, "checkpoint.path")
            except OSError as exc:
                raise ConfigError(f"checkpoint.path: cannot create '{self.folder}' "
                                  f"({exc.strerror or exc}); choose a writable folder") from None
        # name -> (get, set): state that plug-ins keep outside the aggregator and the store
        # (e.g. the privacy ledger); saved with every checkpoint and restored on resume.
        self.extras: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.stop_requested = False      # set by Ctrl-C/SIGTERM: snapshot at the round's end, stop
        self.last_path: Path | None = None   # the newest checkpoint this run wrote, and its round
        self.last_round = 0
        # client -> the latest round whose update from it was aggregated (what a rejoining
        # client's state should be of, and older updates are not aggregated again: see
        # `fedcore.deployment.deployed_resume`)
        self.contributed: dict[int, int] = {}
        self.unsaved: dict[str, Any] | None = None   # the last round's state, where not written
        # the written records as JSON lines, encoded once each: a snapshot carries them as one
        # text, not as thousands of objects to pickle (a deployed server snapshots every round)
        self._record_lines: list[str] = []

    def register(self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]) -> None:
        """Have `get()` saved in each checkpoint under `name` and `set_(value)` called on resume;
        values must be loadable with `weights_only=True` (tensors, numbers, lists, dicts)."""
        self.extras[name] = (get, set_)

    def after_aggregation(self, server, updates=()) -> None:
        for u in updates:   # the round (model version) each client's update was trained on
            self.contributed[u.client_id] = max(u.round, self.contributed.get(u.client_id, -1))
        due = bool(self.every) and server.round % self.every == 0
        if due:
            self.save(server, self.state(server))
        elif self.folder is not None and self.course.wall_clock:
            # kept (copied) for an interruption later in the next round, which snapshots the
            # last completed round whatever checkpoint.every says
            self.unsaved = self.state(server, copy=True)
        if self.stop_requested and not _last_round(server):
            if self.last_path is None or self.last_round != server.round:
                self.save(server, self.state(server))
            raise KeyboardInterrupt

    def save_last_completed(self) -> None:
        """On an interruption mid-round (deployment): the snapshot of the last completed round,
        if it was not written already."""
        if self.unsaved is not None and self.unsaved["round"] != self.last_round:
            self._write(self.unsaved)

    def state(self, server, copy: bool = False) -> dict[str, Any]:
        """What a snapshot holds, as of the aggregation just done."""
        from fedcore.comm.fingerprint import fingerprint
        course = self.course
        store = course.store
        monitor = course.monitor
        cpu = (lambda v: _cloned(to_cpu(v))) if copy else to_cpu
        return {
            "format": FORMAT,
            "round": server.round,
            "algorithm": course.cfg["algorithm.name"],
            "course": fingerprint(course.cfg),
            "virtual_time": server.now,
            "wall_time": monitor.wall_time,
            "global_state": cpu(server.aggregator.global_state),   # resumable without a GPU
            "aggregator": cpu(server.aggregator.state_dict()),
            "sampler_rng": server.sampler.rng.bit_generator.state,
            "sampler_turn": getattr(server.sampler, "turn", None),   # the group sampler's position
            "torch_rng": torch.get_rng_state(),
            "client_states": {cid: store.load(cid) for cid in course.client_ids if cid in store},
            "records": self._records_text(monitor.records),
            "pending": monitor.open_records(),
            "metrics_lines": monitor.lines_written,
            "contributed": dict(self.contributed),
            "bytes": [monitor.total_up, monitor.total_down, monitor.total_other],
            "best": [server.best_acc, server.evals_since_best],
            "target": [monitor.time_to_target, monitor.rounds_to_target],
            "extras": {name: cpu(get()) for name, (get, _) in self.extras.items()},
            "states": server.states.saved(),   # copies already
        }

    def _records_text(self, records: list[dict[str, Any]]) -> str:
        """`records` as JSON lines (floats exactly, NaN included), encoding only the new ones."""
        lines = self._record_lines
        if len(lines) > len(records):   # records restarted (a resume): encode them again
            lines.clear()
        lines.extend(json.dumps(r) for r in records[len(lines):])
        return "\n".join(lines)

    def save(self, server, state: dict[str, Any] | None = None) -> None:
        self._write(state if state is not None else self.state(server))

    def _write(self, state: dict[str, Any]) -> None:
        with interrupts_deferred():   # an interrupt lands once the snapshot is written and known
            path = write_snapshot(state, self.folder, state["round"], self.keep, self.key)
            self.last_path, self.last_round = path, state["round"]
            self.unsaved = None
        log.info("checkpoint of round %d written to %s", state["round"], path)


def _cloned(value: Any) -> Any:
    """`value` with every tensor copied (what an aggregator may change in place later)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


def _last_round(server) -> bool:
    """True where this aggregation ends the course by rounds or time (nothing left to resume)."""
    cfg = server.course.cfg
    limit = cfg["federate.time_limit"]
    return server.round >= cfg["federate.total_round_num"] or (limit is not None and server.now >= limit)


@contextlib.contextmanager
def stop_at_round_end(course):
    """While a simulation runs: the first Ctrl-C or SIGTERM asks `course.checkpointer` to write
    the checkpoint of the round in progress once it is aggregated and stop there, so the course
    can be resumed whatever `checkpoint.every` says; a second one stops at once. Signals are
    left alone where the course cannot be resumed (no folder, an async course), off the main
    thread, and where the embedding program handles them itself."""
    checkpointer = course.checkpointer
    if (checkpointer.folder is None or course.cfg["course"] == "async"
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    previous = {sig: signal.getsignal(sig) for sig in defaults}

    owner = os.getpid()

    def request_stop(signum, _frame) -> None:
        if os.getpid() != owner:  # a worker forked by `executor: processes`: Ctrl-C is the
            if signum == signal.SIGTERM:   # course's to handle; SIGTERM (terminate) still ends it
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if checkpointer.stop_requested:
            raise KeyboardInterrupt
        checkpointer.stop_requested = True
        # os.write: the interrupted code may be halfway through a write to sys.stderr
        os.write(2, f"fedcore: stopping when round {course.server.round} ends, to write a snapshot "
                    "that resumes the course (interrupt again to stop at once)\n".encode())

    for sig, handler in previous.items():
        if handler is defaults[sig]:
            signal.signal(sig, request_stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is request_stop:
                signal.signal(sig, handler)


def _records_of(state: dict[str, Any]) -> list[dict[str, Any]]:
    """A snapshot's written records: JSON lines (a list in snapshots written before)."""
    records = state["records"]
    if isinstance(records, str):
        return [json.loads(line) for line in records.splitlines()]
    return records


def interrupted_message(course, command: list[str] | None) -> str:
    """What an operator needs after an interruption: where the outputs are, the round reached,
    and the command that resumes (`command` is how the course was started, without outdir and
    resume_from)."""
    import shlex
    if course.outdir is None:
        return ""
    records = course.monitor.records
    reached = records[-1]["round"] if records else 0
    lines = [f"stopped after round {reached}; outputs in {course.outdir.resolve()}"]
    snapshot = course.checkpointer.last_path
    if snapshot is None:
        lines.append("no snapshot was written (stopped at once); rerun the course to train it")
    elif command is not None:
        resume_cmd = [*command, f"outdir={course.outdir.resolve()}", f"resume_from={snapshot.resolve()}"]
        lines.append(f"resume from the snapshot of round {course.checkpointer.last_round} with: "
                     f"cd {shlex.quote(os.getcwd())} && {shlex.join(resume_cmd)}")
    else:
        lines.append(f"resume it with resume_from={snapshot.resolve()}")
    return "\n".join(f"fedcore: {line}" for line in lines)


def restore(course, state: dict[str, Any], metrics_lines: int | None = None) -> None:
    """Put a checked checkpoint's state into `course` (built, not yet run): models, aggregator,
    sampler, random states, plug-ins' extras, the records. `metrics_lines`: keep that many
    lines of the metrics.jsonl already in the outdir instead of writing the records anew."""
    server, monitor = course.server, course.monitor
    device = getattr(course, "device", CPU)
    server.aggregator.global_state = to_device(state["global_state"], device)
    server.aggregator.load_state_dict(to_device(state["aggregator"], device))
    server.sampler.rng.bit_generator.state = state["sampler_rng"]
    if state.get("sampler_turn") is not None:
        server.sampler.turn = state["sampler_turn"]
    extras = state.get("extras", {})
    for name, (_, set_) in course.checkpointer.extras.items():
        set_(extras[name])
    server.states.restore(state["states"], server)
    torch.set_rng_state(state["torch_rng"])
    for cid, client_state in state["client_states"].items():
        course.store.save(int(cid), client_state)
    monitor.preload(_records_of(state), state["pending"], state["bytes"], state["target"],
                    keep_lines=metrics_lines, wall_time=state.get("wall_time"))
    course.checkpointer.contributed = {int(c): int(r) for c, r in state.get("contributed", {}).items()}
    course.checkpointer.last_round = state["round"]
    server.best_acc, server.evals_since_best = state["best"]
    server.round = state["round"]
    server.now = state["virtual_time"]


def resume(course, path: str) -> float:
    """Restore a simulated `course` (built, not yet run) from a checkpoint; returns its
    virtual time."""
    _, state = load(course, path)
    restore(course, state)
    server = course.server
    server.joined, server.started = set(course.client_ids), True
    return state["virtual_time"]
