"""Reading a snapshot back: an input like a message, checked before any of it is used.

A file is refused in one line (a ConfigError naming it and what is wrong) where it does not
load, fails its HMAC tag (`fedcore.kernel.file_tag`), or is not intact: an entry that a
resume restores missing, of another type or of other contents (`_check_contents`: a round
not its file's, a non-finite time, records that are not records, an aggregator entry not
the course's or of another kind, a sparse tensor, a client state not a dict), the global
model not of this course's names, shapes and dtypes, a tensor of the aggregator's or a plug-in's state not of the layout the
course holds, any tensor NaN or infinite (the check an aggregate passes), a random state
that its generator does not take. Such a file is skipped for the snapshot before it
(`fedcore.runtime.snapshot.newest_loadable`). A snapshot that is intact but not this
course's (another round limit, algorithm, config or plug-in set) is refused as well, with
no fallback: an older one of the same run would not do better.
"""
from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path
from typing import Any

import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.file_tag import HEADER, TagError, untag
from fedcore.kernel.files import check_folder
from fedcore.kernel.model_ops import first_non_finite, tensors_in
from fedcore.kernel.server_state import StateError, decode
from fedcore.runtime.snapshot import newest_loadable, resolve, round_of

__all__ = ["FORMAT", "load", "load_tensor_file"]

FORMAT = 1


def load_tensor_file(path: str | Path | io.BytesIO, key: str, what: str, shown: str | None = None) -> Any:
    """`torch.load(path, weights_only=True)`; a file that is not one becomes a one-line
    ConfigError naming `key` (never torch's advice to load it with weights_only=False).
    `shown`: the file's name where `path` is its content in memory."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:
        text = str(exc)
        if "Unsupported global" in text:
            reason = ("it holds Python objects besides tensors, numbers and containers; "
                      "fedcore never unpickles those")
        elif "Weights only load failed" in text or "invalid load key" in text or "zip archive" in text:
            reason = "not a file written by torch.save"
        else:
            reason = (text.strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{key}: '{shown or path}' is not {what} ({reason})") from None


def load(course, path: str) -> tuple[str, dict[str, Any]]:
    """The checkpoint `path` (or `latest`) checked against `course`: (the file used, its state).
    A file that does not load or is not intact (see `_intact`) is refused in one line, and a
    snapshot before it used instead."""
    folder = course.checkpointer.folder
    path = resolve(path, folder)
    check_folder(Path(path).parent, "resume_from")   # whoever may write it chooses what resumes
    key = course.checkpointer.key
    path, state = newest_loadable(path, lambda p: _intact(course, p, _readable(p, key)))
    return path, _checked(course, path, state)


def _readable(path: str, key: bytes | None = None) -> Any:
    """The file's content; a truncated, corrupted, untagged or mis-tagged one is refused
    (ConfigError). Without a key the file is loaded as it is (no copy in memory)."""
    if key is None:
        with open(path, "rb") as fh:
            tagged = fh.read(len(HEADER)) == HEADER
        if not tagged:
            return load_tensor_file(path, "resume_from", "a fedcore checkpoint")
    try:
        with open(path, "rb") as fh:
            body = untag(fh.read(), key)
    except TagError as exc:
        raise ConfigError(f"resume_from: '{path}' {exc}") from None
    return load_tensor_file(io.BytesIO(body), "resume_from", "a fedcore checkpoint", shown=path)


# entry -> the types it must be of: what `restore` reads from every snapshot
_ENTRIES: dict[str, tuple[type, ...]] = {
    "round": (int,), "virtual_time": (int, float), "global_state": (dict,), "aggregator": (dict,),
    "sampler_rng": (dict,), "torch_rng": (torch.Tensor,), "client_states": (dict,),
    "records": (str, list), "pending": (dict,), "bytes": (list, tuple), "best": (list, tuple),
    "target": (list, tuple)}


def _intact(course, path: str, state: Any) -> dict[str, Any]:
    """`state` as a snapshot of this course's model, every entry present and of its type, every
    tensor finite and the model's of its shape and dtype (an aggregate is checked the same way,
    `fedcore.runtime.admission`), the random states usable: else a one-line ConfigError."""
    if isinstance(state, dict) and state and "format" not in state \
            and all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"resume_from: '{path}' is not a fedcore checkpoint but a model's weights "
                          f"only; {_snapshot_advice(Path(path))}")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"resume_from: '{path}' is not a fedcore checkpoint (format {FORMAT})")
    for name, types in _ENTRIES.items():
        if name not in state:
            raise ConfigError(f"resume_from: '{path}' is incomplete (no entry '{name}')")
        value = state[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(f"resume_from: '{path}' is damaged (entry '{name}' is a "
                              f"{type(value).__name__})")
    _check_contents(course, path, state)
    server = course.server
    missing = set(server.aggregator.global_state) ^ set(state["global_state"])
    if missing:
        raise ConfigError(f"resume_from: '{path}' was written for another model (entry "
                          f"'{sorted(missing)[0]}' differs)")
    for name, t in server.aggregator.global_state.items():
        saved = state["global_state"][name]
        if not isinstance(saved, torch.Tensor) or saved.shape != t.shape or saved.dtype != t.dtype:
            shown = f"{saved.dtype} {tuple(saved.shape)}" if isinstance(saved, torch.Tensor) \
                else f"a {type(saved).__name__}"
            raise ConfigError(f"resume_from: '{path}' was written for another model (entry '{name}' "
                              f"is {shown}, this course's is {t.dtype} {tuple(t.shape)}); resume "
                              "with the model.* keys that wrote it")
    live = {"aggregator": server.aggregator.state_dict(),
            "extras": {name: get() for name, (get, _) in course.checkpointer.extras.items()}}
    for where, tree in live.items():   # a tensor the course holds now: the saved one has its layout
        saved = dict(tensors_in(state.get(where), where))
        for name, t in tensors_in(tree, where):
            s = saved.get(name)
            if s is not None and (s.shape != t.shape or s.dtype != t.dtype):
                raise ConfigError(f"resume_from: '{path}' is damaged ({name} is {s.dtype} "
                                  f"{tuple(s.shape)}, not {t.dtype} {tuple(t.shape)})")
    for where in ("global_state", "aggregator", "client_states", "extras", "states"):
        bad = first_non_finite(state.get(where), where)
        if bad is not None:
            raise ConfigError(f"resume_from: '{path}' is damaged ({bad} holds NaN or infinite values)")
    _check_rng(path, server, state)
    try:
        state["states"] = decode(state.get("states", {}))
    except StateError as exc:
        raise ConfigError(f"resume_from: '{path}' is not a usable snapshot: {exc}") from None
    return state


def _number(x: Any, least: float = 0.0) -> bool:
    """A finite int or float (not a bool) of at least `least`."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= least


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _record(r: Any) -> bool:
    """A round's record as the monitor keeps it: a dict with its round."""
    return isinstance(r, dict) and all(isinstance(k, str) for k in r) and _count(r.get("round"))


def _records_fault(records: str | list) -> str | None:
    if isinstance(records, str):
        try:
            records = [json.loads(line) for line in records.splitlines()]
        except ValueError as exc:
            return f"a line is not JSON: {(str(exc).splitlines() or ['?'])[0]}"
    bad = next((i for i, r in enumerate(records) if not _record(r)), None)
    return None if bad is None else f"record {bad} is not a dict with its round"


def _pending_fault(pending: dict) -> str | None:
    for r, p in pending.items():
        if not (_count(r) or isinstance(r, str) and r.isdigit()) or not isinstance(p, dict) \
                or not isinstance(p.get("record"), dict) or not _count(p.get("expected")):
            return f"round {r!r} is not {{record: dict, expected: count}}"
    return None


def _pair_fault(value: list | tuple, n: int, ok: Any, what: str) -> str | None:
    return None if len(value) == n and all(ok(x) for x in value) else f"not {what}"


# entry -> its contents' fault (None: none), beyond its container type: what `restore` assumes
_CONTENTS: dict[str, Any] = {
    "virtual_time": lambda v: None if _number(v) else f"{v!r} is not a finite time >= 0",
    "records": _records_fault,
    "pending": _pending_fault,
    "bytes": lambda v: _pair_fault(v, 3, _number, "3 byte totals >= 0"),
    # the best accuracy may be NaN (a first evaluation of NaN is kept), never infinite
    "best": lambda v: _pair_fault(v, 2, lambda x: x is None or _number(x, -math.inf)
                                  or isinstance(x, float) and math.isnan(x), "[best accuracy, count]")
    or (None if _count(v[1]) else "its count is not an int >= 0"),
    "target": lambda v: _pair_fault(v, 2, lambda x: x is None or _number(x), "[time or None, round or None]"),
}


def _check_contents(course, path: str, state: dict[str, Any]) -> None:
    """Every entry's contents of the kind `restore` puts in place, so that a resume never
    fails halfway (or goes on from a round other than its file's): else a one-line ConfigError."""
    def damaged(what: str) -> ConfigError:
        return ConfigError(f"resume_from: '{path}' is damaged ({what})")
    k, r = round_of(Path(path)), state["round"]
    if r < 0 or (k is not None and r != k):
        raise damaged(f"entry 'round' is {r}" + (f", its file's is {k}" if k is not None else ""))
    for name, fault in _CONTENTS.items():
        why = fault(state[name])
        if why is not None:
            raise damaged(f"entry '{name}': {why}")
    sparse = next(((n, t) for n, t in tensors_in(state) if t.layout != torch.strided), None)
    if sparse is not None:
        raise damaged(f"{sparse[0]} is a {str(sparse[1].layout).removeprefix('torch.')} tensor, "
                      "not a dense one")
    if _foreign(course, state):   # refused as another course's by `_checked`, not as damaged
        return
    live = {"aggregator": course.server.aggregator.state_dict(),
            "extras": {name: get() for name, (get, _) in course.checkpointer.extras.items()}}
    if set(state["aggregator"]) != set(live["aggregator"]):
        differ = sorted(map(str, set(state["aggregator"]) ^ set(live["aggregator"])))
        raise damaged(f"aggregator entry '{differ[0]}' is not the course's")
    for where, tree in live.items():
        why = _kind_fault(state.get(where, {}), tree, where)
        if why is not None:
            raise damaged(why)
    for cid, cs in state["client_states"].items():
        if not (_count(cid) or isinstance(cid, str) and cid.isdigit()) or not isinstance(cs, dict) \
                or not all(isinstance(key, str) for key in cs):
            raise damaged(f"client state {cid!r} is not a client's id and a dict of named entries")


def _foreign(course, state: dict[str, Any]) -> bool:
    """The snapshot names another algorithm or config than this course's: its states need
    not be of this course's layout."""
    from fedcore.comm.fingerprint import differing_keys
    theirs = state.get("course")
    return state.get("algorithm", course.cfg["algorithm.name"]) != course.cfg["algorithm.name"] \
        or (isinstance(theirs, str) and bool(differing_keys(course.cfg, theirs)))


_KINDS = (torch.Tensor, dict, (list, tuple), str, bool, (int, float))


def _kind_fault(saved: Any, live: Any, where: str) -> str | None:
    """Where `saved` is not of the kind of what the course holds now (`live`): a tensor for a
    tensor, a dict for a dict (compared entry by entry where both have it), a list for a list, a
    number for a number. None in the course (a state not made yet) takes anything."""
    kind = next((k for k in _KINDS if isinstance(live, k)), None)
    if kind is None:   # None (a state not made yet) or an object of no kind here
        return None
    if not isinstance(saved, kind) or (isinstance(saved, bool) and kind is not bool):
        return f"{where} is a {type(saved).__name__}, the course holds a {type(live).__name__}"
    if isinstance(live, dict):
        for key in live.keys() & saved.keys():
            why = _kind_fault(saved[key], live[key], f"{where}.{key}")
            if why is not None:
                return why
    return None


def _check_rng(path: str, server, state: dict[str, Any]) -> None:
    """The random states are ones a generator takes (tried on copies, not on the live ones)."""
    try:
        copy.deepcopy(server.sampler.rng.bit_generator).state = state["sampler_rng"]
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"resume_from: '{path}' is damaged (entry 'sampler_rng': "
                          f"{(str(exc).splitlines() or [type(exc).__name__])[0]})") from None
    rng, live = state["torch_rng"], torch.get_rng_state()
    if rng.dtype != live.dtype or rng.shape != live.shape:
        raise ConfigError(f"resume_from: '{path}' is damaged (entry 'torch_rng' is {rng.dtype} "
                          f"{tuple(rng.shape)}, not {live.dtype} {tuple(live.shape)})")


def _checked(course, path: str, state: dict[str, Any]) -> dict[str, Any]:
    """An intact snapshot that this course may resume from (its round, algorithm, config and
    plug-ins'): else a one-line ConfigError (no older snapshot would do better)."""
    total = course.cfg["federate.total_round_num"]
    if state["round"] >= total:
        raise ConfigError(f"resume_from: '{path}' is of round {state['round']}, the course's last "
                          f"(federate.total_round_num={total}); raise it to train further")
    algorithm = course.cfg["algorithm.name"]
    if state.get("algorithm", algorithm) != algorithm:
        raise ConfigError(f"resume_from: '{path}' was written by algorithm.name {state['algorithm']}, "
                          f"not {algorithm}; resume with the algorithm that wrote it")
    if "course" in state:
        from fedcore.comm.fingerprint import differing_keys
        differ = differing_keys(course.cfg, state["course"])
        if differ:
            raise ConfigError(f"resume_from: '{path}' is a snapshot of another course (keys "
                              f"{', '.join(differ[:4])} differ from this config's); resume with "
                              "the config that wrote it, or start a new course in a new outdir")
    extras = state.get("extras", {})
    absent = sorted(set(course.checkpointer.extras) - set(extras))
    if absent:
        raise ConfigError(f"resume_from: '{path}' holds no state for '{absent[0]}', which this "
                          "course keeps; resume with the config that wrote the checkpoint")
    return state


def _snapshot_advice(model_file: Path) -> str:
    """Where a run's snapshots would be, for one that names its final model instead."""
    folder = model_file.parent / "checkpoints"
    rounds = sorted(int(f.stem[6:]) for f in folder.glob("round_*.pt") if f.stem[6:].isdigit())
    if rounds:
        return f"resume from its newest snapshot, resume_from={folder / f'round_{rounds[-1]}.pt'}"
    return (f"that run left no snapshot in {folder} (written every checkpoint.every rounds, and "
            f"on Ctrl-C); to start a new course from these weights use model.init_from={model_file}")
