"""Durability of a vertical course: snapshots every `checkpoint.every` rounds, and resuming.

What is saved where (a round is an epoch; every party saves at the end of the same rounds):
- the active party writes `round_<r>.pt` to `checkpoint.path` (default `<outdir>/checkpoints`)
  through fedcore.runtime.snapshot (temporary file, fsync, rename, `latest`, `checkpoint.keep`,
  the HMAC tag of `checkpoint.hmac_key_file`): its models' parameters and optimizer states as
  they were when round r's last batch was stepped, the simulation's gradient-noise generator,
  the records, the byte counts and the virtual time;
- each passive party writes its own part of round r (parameters and optimizer state) to its
  state folder (`distribute.state_dir`, default `<outdir>/client_state/<k>`) as a client state
  file (fedcore.comm.client_state: checksum, course fingerprint, party and round in its header,
  HMAC tag), before it sends that round's test activations, so that every snapshot the active
  party holds has each passive party's part on that party's disk.

Resuming (`resume_from`): the active party checks the snapshot before using any of it (an input
like a message: every entry present and of its kind, tensors of the course's names, shapes and
dtypes and finite, optimizer states of the parameters' shapes, records that are records; a file
that fails is refused in one line and the one before it used). The course then starts as a new
one (join, PSI); `psi_result` tells every passive party the round r, each restores its state of
round r (and drops its later ones: a history undone), and training goes on from epoch r + 1.
The batches come from (seed, epoch), so the resumed course computes what the uninterrupted one
would have. A passive party without a usable state of round r stops with one line.
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch

from fedcore.comm.client_state import ClientStateDir, default_state_dir
from fedcore.comm.fingerprint import fingerprint
from fedcore.kernel.errors import ConfigError, FedcoreError
from fedcore.kernel.file_tag import TagError, load_key, untag
from fedcore.kernel.files import check_folder, make_folder
from fedcore.kernel.scheduler import HandlerError
from fedcore.runtime.monitor import StopRun
from fedcore.runtime.snapshot import LATEST, newest_loadable, resolve, round_of, snapshots, write_snapshot
from fedcore.runtime.snapshot_input import load_tensor_file

__all__ = ["VerticalSnapshots", "PassiveState", "capture", "fault", "apply", "load_snapshot",
           "restore_records", "course_print", "check_round", "StateMissing", "SetupRefused"]

log = logging.getLogger("fedcore.checkpoint")

FORMAT = 1
KIND = "vertical"
ENTRIES = {"format", "kind", "course", "round", "virtual_time", "wall_time", "parts", "records",
           "metrics_lines", "bytes", "party_bytes"}
# what else a snapshot must agree on besides the runtime's fingerprint (model/data/algorithm)
COURSE_KEYS = ("federate.total_round_num", "train.batch_size", "train.optimizer.type",
               "train.optimizer.lr", "train.optimizer.momentum", "train.optimizer.weight_decay")


class StateMissing(FedcoreError, HandlerError):
    """A passive party asked to go on from round r holds no usable state of it (exit 1, one line)."""


def course_print(cfg) -> str:
    """The runtime's fingerprint, the vertical keys and the training keys a snapshot must share."""
    extra = {k: cfg[k] for k in COURSE_KEYS}
    extra.update({f"vertical.{k}": v for k, v in cfg.section("vertical").items()
                  if k not in ("files", "party_model")})   # paths are machine-local
    digest = json.dumps(extra, sort_keys=True, default=str)
    return fingerprint(cfg) + ";vertical=" + hashlib.sha256(digest.encode()).hexdigest()[:16]


# ------------------------------------------------------------------ a party's part
def capture(part) -> dict[str, Any]:
    """A copy of `part`'s state (a BottomParty, TopParty, LrPassive or LrActive)."""
    out: dict[str, Any] = {
        "tensors": {k: v.detach().clone() for k, v in part.tensors().items()},
        "optimizers": {k: copy.deepcopy(o.state_dict()["state"]) for k, o in part.optimizers().items()},
    }
    noise = getattr(part, "noise", None)
    if noise is not None:
        out["noise"] = noise.get_state()
    return out


def fault(saved: Any, part) -> str | None:
    """Why `saved` is not a state of `part`'s layout (None: it is)."""
    live = part.tensors()
    if not isinstance(saved, dict) or set(saved) != set(capture_keys(part)):
        return f"its state is not {sorted(capture_keys(part))}"
    tensors = saved["tensors"]
    if not isinstance(tensors, dict) or set(tensors) != set(live):
        return "its parameters are not this course's (names differ)"
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.shape != live[name].shape \
                or t.dtype != live[name].dtype:
            return f"its parameter '{name}' is not of the course's shape and dtype"
        if not torch.isfinite(t).all():
            return f"its parameter '{name}' holds NaN or infinite values"
    opts = saved["optimizers"]
    if not isinstance(opts, dict) or set(opts) != set(part.optimizers()):
        return "its optimizer states are not this course's"
    for name, opt in part.optimizers().items():
        problem = _optimizer_fault(opts[name], [p for g in opt.param_groups for p in g["params"]], name)
        if problem:
            return problem
    if "noise" in saved:
        n = saved["noise"]
        if not isinstance(n, torch.Tensor) or n.dtype != torch.uint8 or n.shape != part.noise.get_state().shape:
            return "its noise generator state is not a generator's"
    return None


def capture_keys(part) -> list[str]:
    return ["tensors", "optimizers"] + (["noise"] if getattr(part, "noise", None) is not None else [])


def _optimizer_fault(state: Any, params: list[torch.Tensor], name: str) -> str | None:
    """An optimizer's per-parameter state: entries of existing parameters, each a dict of named
    finite float tensors shaped like its parameter (Adam's `step`: a scalar)."""
    if not isinstance(state, dict):
        return f"optimizer state '{name}' is not a dict"
    for index, entry in state.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params) \
                or not isinstance(entry, dict):
            return f"optimizer state '{name}' names no parameter of the course ({index!r})"
        for key, t in entry.items():
            if t is None and key == "momentum_buffer":
                continue
            if not isinstance(key, str) or not isinstance(t, torch.Tensor) or not t.is_floating_point() \
                    or t.layout != torch.strided or not _shaped(t, params[index], key):
                return f"optimizer state '{name}' of parameter {index} ('{key}') is not of its shape"
            if not torch.isfinite(t).all():
                return f"optimizer state '{name}' of parameter {index} holds NaN or infinite values"
    return None


def _shaped(t: torch.Tensor, param: torch.Tensor, key: str) -> bool:
    return t.shape == param.shape or (key == "step" and t.numel() == 1)


def apply(saved: dict[str, Any], part) -> None:
    """Put a checked state (`fault` found nothing) into `part`."""
    live = part.tensors()
    with torch.no_grad():
        for name, t in saved["tensors"].items():
            live[name].copy_(t)
    for name, opt in part.optimizers().items():
        opt.load_state_dict({"state": copy.deepcopy(saved["optimizers"][name]),
                             "param_groups": opt.state_dict()["param_groups"]})   # the config's
    if "noise" in saved:
        part.noise.set_state(saved["noise"])


# ------------------------------------------------------------------ the active party's snapshots
class VerticalSnapshots:
    """The active party's snapshots (`course.checkpointer`): every `checkpoint.every` rounds
    (default: 0 in simulation, 1 deployed), `checkpoint.keep` of them (default: all, 2 deployed)."""

    def __init__(self, course, deployed: bool):
        cfg = course.cfg
        self.course, self.deployed = course, deployed
        every, keep = cfg["checkpoint.every"], cfg["checkpoint.keep"]
        self.every = (1 if deployed else 0) if every is None else every
        self.keep = (2 if deployed else 0) if keep is None else keep
        folder = cfg["checkpoint.path"] or (Path(course.outdir) / "checkpoints" if course.outdir else None)
        self.folder = Path(folder) if folder is not None else None
        if self.every and self.folder is None:
            if every is not None:
                raise ConfigError("checkpoint.every: set checkpoint.path or outdir so checkpoints have a place")
            self.every = 0
        self.key = load_key(cfg)
        if self.every:
            try:
                make_folder(self.folder, "checkpoint.path")
            except OSError as exc:
                raise ConfigError(f"checkpoint.path: cannot create '{self.folder}' "
                                  f"({exc.strerror or exc}); choose a writable folder") from None
        self.stop_requested = False
        self.last_path: Path | None = None
        self.last_round = 0
        self.captured: dict[int, dict[str, Any]] = {}   # round -> the active's state at its end

    def due(self, round_: int) -> bool:
        return bool(self.every) and round_ % self.every == 0

    def save_last_completed(self) -> None:
        """An interrupted deployment writes nothing more: only rounds every party saved resume."""

    def stop_if_asked(self, round_: int) -> None:
        """A simulation asked to stop (Ctrl-C, SIGTERM: fedcore.runtime.checkpoint.stop_at_round_end)
        stops after a round whose snapshot every party wrote (any round where none are due)."""
        if self.stop_requested and (self.due(round_) or not self.every):
            raise StopRun("interrupted")

    def capture(self, active, round_: int) -> None:
        """Round `round_`'s last batch stepped: keep the active party's state of its end."""
        if self.due(round_):
            self.captured[round_] = capture(active.model)

    def write(self, active, round_: int) -> None:
        """Round `round_` recorded: write its snapshot (its state captured at its end)."""
        parts = self.captured.pop(round_, None)
        if parts is None:
            return
        course, monitor = self.course, self.course.monitor
        state = {"format": FORMAT, "kind": KIND, "course": course_print(course.cfg), "round": round_,
                 "virtual_time": float(active.now), "wall_time": monitor.wall_time, "parts": parts,
                 "records": "\n".join(json.dumps(r) for r in monitor.records),
                 "metrics_lines": monitor.lines_written,
                 "bytes": [monitor.total_up, monitor.total_down, monitor.total_other],
                 "party_bytes": dict(course.party_bytes.total)}
        self.last_path = write_snapshot(state, self.folder, round_, self.keep, self.key)
        self.last_round = round_
        log.info("vertical: snapshot of round %d written to %s", round_, self.last_path)


def load_snapshot(course, template) -> dict[str, Any] | None:
    """The checked snapshot `resume_from` names (None: `latest` in a deployment with none yet,
    the course starts at round 1). `template`: the active party's part, of the course's layout."""
    value, checkpointer = course.cfg["resume_from"], course.checkpointer
    folder = checkpointer.folder
    if value == LATEST and checkpointer.deployed and (folder is None or not snapshots(folder)):
        log.warning("resume_from=latest: no snapshot in %s yet; the course starts from round 1",
                    checkpointer.folder)
        return None
    path = resolve(value, checkpointer.folder)
    check_folder(Path(path).parent, "resume_from")
    used, state = newest_loadable(path, lambda p: _intact(course, p, _read(p, checkpointer.key), template))
    checkpointer.last_path, checkpointer.last_round = Path(used), state["round"]
    course.monitor.add_summary("resume", {"resumed_from": {"round": state["round"], "snapshot": used}})
    log.warning("vertical: resuming from the snapshot of round %d (%s); round %d runs next",
                state["round"], used, state["round"] + 1)
    return state


def _read(path: str, key: bytes | None) -> Any:
    try:
        with open(path, "rb") as fh:
            raw = untag(fh.read(), key)
    except TagError as exc:
        raise ConfigError(f"resume_from: '{path}' {exc}") from None
    except OSError as exc:
        raise ConfigError(f"resume_from: cannot read '{path}' ({exc.strerror or exc})") from None
    return load_tensor_file(io.BytesIO(raw), "resume_from", "a fedcore checkpoint", shown=path)


def _int(x: Any, least: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= least


def _intact(course, path: str, state: Any, template) -> dict[str, Any]:
    """`state` if it is a vertical snapshot of this course, else a one-line ConfigError."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"resume_from: '{path}' is not an intact snapshot of this vertical course ({why})")
    if not isinstance(state, dict) or set(state) != ENTRIES:
        raise bad("its entries are not a vertical snapshot's")
    if state["format"] != FORMAT or state["kind"] != KIND:
        raise bad(f"format {state['format']!r} of kind {state['kind']!r}")
    if state["course"] != course_print(course.cfg):
        raise bad("it is another course's: its config differs")
    r = state["round"]
    if not _int(r, 1) or r > course.cfg["federate.total_round_num"] or round_of(Path(path)) not in (None, r):
        raise bad(f"round {r!r} is not a round of the course, or not its file's")
    for key in ("virtual_time", "wall_time"):
        t = state[key]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad(f"{key} {t!r}")
    records = state["records"]
    try:
        rows = [json.loads(line) for line in records.splitlines()] if isinstance(records, str) else None
    except ValueError:
        rows = None
    if rows is None or len(rows) != r or any(not isinstance(x, dict) or x.get("round") != i + 1
                                             for i, x in enumerate(rows)):
        raise bad("its records are not one per round up to its round")
    if not _int(state["metrics_lines"], r):
        raise bad("metrics_lines")
    if not isinstance(state["bytes"], list) or len(state["bytes"]) != 3 or not all(_int(b) for b in state["bytes"]):
        raise bad("bytes")
    pb = state["party_bytes"]
    if not isinstance(pb, dict) or set(pb) != set(course.client_ids) or not all(_int(b) for b in pb.values()):
        raise bad("party_bytes are not one count per passive party")
    problem = fault(state["parts"], template)
    if problem:
        raise bad(problem)
    return state


def restore_records(course, state: dict[str, Any], keep_lines: bool) -> None:
    """The records, byte counts and clock of a checked snapshot (`keep_lines`: the outdir's
    metrics.jsonl holds them already, a deployment resuming in place)."""
    rows = [json.loads(line) for line in state["records"].splitlines()]
    course.monitor.preload(rows, {}, state["bytes"], [None, None],
                           keep_lines=state["metrics_lines"] if keep_lines else None,
                           wall_time=state["wall_time"])
    course.party_bytes.total.update({int(p): n for p, n in state["party_bytes"].items()})


# ------------------------------------------------------------------ a passive party's state
class PassiveState:
    """A passive party's parts of its rounds in its own folder (client state files)."""

    def __init__(self, cfg, party: int, folder: Path | None, deployed: bool):
        every, keep = cfg["checkpoint.every"], cfg["checkpoint.keep"]
        self.every = (1 if deployed else 0) if every is None else every
        keep = (2 if deployed else 0) if keep is None else keep
        self.keep = 0 if keep == 0 else max(keep, 2)
        self.party = party
        self.files = ClientStateDir(folder, cfg, party) if folder is not None else None
        self.previous = -1

    @classmethod
    def of(cls, course, party: int, process_cfg, deployed: bool) -> "PassiveState":
        """Deployed: the process's `distribute.state_dir` (default `<outdir>/client_state/<k>`);
        simulated: `<outdir>/client_state/<k>`. None of them (or keep_client_state off): no files."""
        cfg = course.cfg
        if not cfg["distribute.keep_client_state"]:
            folder = None
        elif deployed:
            folder = default_state_dir(process_cfg, party)
        else:
            folder = Path(course.outdir) / "client_state" / str(party) if course.outdir else None
        return cls(cfg, party, folder, deployed)

    def save(self, part, round_: int) -> None:
        """Round `round_` stepped: keep this party's state of its end (before its test activations)."""
        if self.files is None or not self.every or round_ % self.every:
            return
        self.files.write(round_, self.previous, {"part": capture(part)})
        self.previous = round_
        if self.keep:
            self.files.drop(self.files.rounds()[:-self.keep])

    def restore(self, part, round_: int) -> None:
        """Go on from round `round_` (0: the start): its state put into `part`; later ones dropped."""
        if self.files is not None:
            self.files.drop(r for r in self.files.rounds() if r > round_)   # a history undone
        if round_ == 0:
            return
        where = self.files.folder if self.files is not None else "no state folder"
        found = self.files.load(round_) if self.files is not None else None
        if found is not None:
            problem = fault(found[2].get("part"), part)
            if problem is None:
                apply(found[2]["part"], part)
                self.previous = round_
                log.warning("vertical: party %d goes on from its state of round %d", self.party, round_)
                return
            self.files.refuse(round_, problem)
        raise StateMissing(f"vertical: party {self.party} holds no usable state of round {round_} "
                           f"({where}), which the course resumes from; restore that folder, or start "
                           "the course again")


def check_round(content: Any, total: int) -> int:
    """The round of a `psi_result` a passive party is told to go on from (0: the start)."""
    r = content.get("round", 0) if isinstance(content, dict) else None
    if not _int(r) or r > total:
        raise SetupRefused(f"vertical: the active party's psi_result names round {r!r}, not a "
                           f"round of this course (0..{total})")
    return r


class SetupRefused(FedcoreError, HandlerError):
    """What the active party told a passive one at setup is not usable (exit 1, one line)."""

