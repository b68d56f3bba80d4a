"""Reading a snapshot back: an input like a message, checked before any of it is used.

A file is refused in one line (a ConfigError naming it and what is wrong) where it does not
load, fails its HMAC tag (`fedcore.kernel.file_tag`), or is not intact: an entry that a
resume restores missing or of another type, the global model not of this course's names,
shapes and dtypes, a tensor of the aggregator's or a plug-in's state not of the layout the
course holds, any tensor NaN or infinite (the check an aggregate passes), a random state
that its generator does not take. Such a file is skipped for the snapshot before it
(`fedcore.runtime.snapshot.newest_loadable`). A snapshot that is intact but not this
course's (another round limit, algorithm, config or plug-in set) is refused as well, with
no fallback: an older one of the same run would not do better.
"""
from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.file_tag import HEADER, TagError, untag
from fedcore.kernel.files import check_folder
from fedcore.kernel.model_ops import first_non_finite, tensors_in
from fedcore.kernel.server_state import StateError, decode
from fedcore.runtime.snapshot import newest_loadable, resolve

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
