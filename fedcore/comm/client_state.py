"""A deployed client's state on its own disk: a restarted client goes on with the algorithm
it was running instead of silently starting it again.

Everything a client keeps between rounds (SCAFFOLD's control variate, FedDyn's duals,
Ditto's and pFedMe's personal models, FedRep's head, DiLoCo's inner
optimizer, its batch order's position) lives in its course's state store (`fedcore.kernel.state`).
After each round it trains, and before its update is sent, the client writes that state to
`distribute.state_dir` (default `<outdir>/client_state/<client id>`; with neither set, nowhere)
as `round_<r>.state`, atomically (a temporary file, fsync, rename), and keeps its last two.
A file is:

    FCCS1\n  <sha-256 of the rest, hex>\n  {"fingerprint", "client_id", "round", "previous"}\n
    <the state, torch.save of tensors, numbers and containers; read with weights_only=True>

so a torn or altered file, another course's state (its config fingerprint differs) or
another client's is refused with one line (the file is renamed `*.refused`) and the
previous one is used. A restarted client (the same command) loads its newest good state.

Agreement on rounds with the server (whose round numbers are authoritative): a client
holding a saved state declares its round when it joins (`state_round` in `join_in`); asked
to train round r, it needs the state it had after round r-1. Its states form a chain (each
file names the round it was trained from): where the state held is of round r or later (the
server resumed from an earlier snapshot, or runs the round again), it goes back along the chain to the state of a
round before r, or, where that is no longer on its disk, starts round r with fresh client
state, as a new client would, and says so in one line: never a mix of two histories. In an
asynchronous course a client may train several times in one server round: its state is
saved and loaded the same way, and rounds are not checked.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
from pathlib import Path
from typing import Any

import torch

from fedcore.comm.fingerprint import differing_keys, fingerprint
from fedcore.kernel.file_tag import TagError, load_key, tag, untag
from fedcore.kernel.files import make_folder, write_atomic
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.model_ops import first_non_finite

__all__ = ["ClientStateDir", "StateRefused", "DurableClientState", "keep_client_state", "default_state_dir"]

log = logging.getLogger("fedcore.deploy")

MAGIC = b"FCCS1"
KEEP = 2          # states kept on disk: the newest and the one before it
FRESH = -1        # the round of no state at all


class StateRefused(Exception):
    """A state file this client must not use (the message says why, in one line)."""


def default_state_dir(cfg, client_id: int) -> Path | None:
    """`distribute.state_dir`, else `<outdir>/client_state/<id>`; None without either (a
    client started by hand without an outdir keeps no state: a folder shared by every such
    client would hand one course's state to the next course of the same config)."""
    if cfg["distribute.state_dir"]:
        return Path(cfg["distribute.state_dir"])
    return Path(cfg["outdir"]) / "client_state" / str(client_id) if cfg["outdir"] else None


class ClientStateDir:
    """The files of one client's states of one course: `round_<r>.state`."""

    def __init__(self, folder: Path, cfg, client_id: int):
        self.folder, self.cfg, self.client_id = Path(folder), cfg, client_id
        self.fingerprint = fingerprint(cfg)
        self.key = load_key(cfg)   # checkpoint.hmac_key_file: tag the files, refuse untagged ones
        make_folder(self.folder, "distribute.state_dir")

    def path(self, round_: int) -> Path:
        return self.folder / f"round_{round_}.state"

    def rounds(self) -> list[int]:
        """The rounds with a state file, oldest first."""
        out = []
        for f in self.folder.glob("round_*.state"):
            stem = f.name[6:-6]
            if stem.isascii() and stem.isdigit():   # "²".isdigit() holds, int("²") fails
                out.append(int(stem))
        return sorted(out)

    def write(self, round_: int, previous: int, state: dict[str, Any]) -> Path:
        buf = io.BytesIO()
        torch.save(state, buf)
        meta = {"fingerprint": self.fingerprint, "client_id": self.client_id, "round": round_,
                "previous": previous}
        body = json.dumps(meta, sort_keys=True).encode() + b"\n" + buf.getvalue()
        path = self.path(round_)
        data = MAGIC + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
        write_atomic(path, tag(data, self.key) if self.key is not None else data)
        return path

    def read(self, round_: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(meta, state) of round `round_`'s file, or StateRefused saying why not."""
        path = self.path(round_)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise StateRefused(f"cannot be read ({exc.strerror or exc})") from None
        try:
            raw = untag(raw, self.key)
        except TagError as exc:
            raise StateRefused(str(exc)) from None
        magic, _, rest = raw.partition(b"\n")
        digest, _, body = rest.partition(b"\n")
        if magic != MAGIC:
            raise StateRefused("is not a fedcore client state file")
        if hashlib.sha256(body).hexdigest().encode() != digest:
            raise StateRefused("is damaged or cut short (its checksum does not match)")
        line, _, payload = body.partition(b"\n")
        try:
            meta = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            meta = None
        if not isinstance(meta, dict):
            raise StateRefused("has a header that is not a JSON object")
        # compared as the server compares a joining client's: keys that only one side declares
        # (a module the other process never imported) are not the course's difference
        theirs = str(meta.get("fingerprint") or "")
        keys = differing_keys(self.cfg, theirs)
        if not theirs or keys:
            raise StateRefused("belongs to another course (its config differs"
                               + (f": {', '.join(keys[:6])})" if keys else ")"))
        if meta.get("client_id") != self.client_id or meta.get("round") != round_:
            raise StateRefused(f"is client {meta.get('client_id')}'s state of round {meta.get('round')}, "
                               f"not client {self.client_id}'s of round {round_}")
        try:
            state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - whatever torch says, one line
            raise StateRefused(f"does not load ({(str(exc).strip().splitlines() or [type(exc).__name__])[0]})"
                               ) from None
        if not isinstance(state, dict):
            raise StateRefused("does not hold a state dict")
        bad = first_non_finite(state)
        if bad is not None:
            raise StateRefused(f"holds NaN or infinite values (in '{bad}')")
        return meta, state

    def refuse(self, round_: int, why: str) -> None:
        """Log one line and move the file aside (`*.refused`), so it is neither read again nor lost."""
        path = self.path(round_)
        log.warning("client %d: client state %s %s; refused (renamed *.refused)", self.client_id, path, why)
        try:
            path.replace(path.with_name(path.name + ".refused"))
        except OSError:
            pass

    def load(self, round_: int) -> tuple[int, int, dict[str, Any]] | None:
        """(round, previous, state) of round `round_`'s file; None (refused, or no file) if unusable."""
        if not self.path(round_).exists():
            return None
        try:
            meta, state = self.read(round_)
            previous = meta.get("previous", FRESH)
            if isinstance(previous, bool) or not isinstance(previous, int):
                raise StateRefused(f"names its previous round {str(previous)[:20]!r}, not a round")
        except StateRefused as why:
            self.refuse(round_, str(why))
            return None
        return round_, previous, state

    def newest(self) -> tuple[int, int, dict[str, Any]] | None:
        """The newest good state; the bad ones met on the way are refused."""
        for r in reversed(self.rounds()):
            found = self.load(r)
            if found is not None:
                return found
        return None

    def drop(self, rounds) -> None:
        for r in rounds:
            self.path(r).unlink(missing_ok=True)


class DurableClientState:
    """Keeps one deployed client's store entry on disk and in step with the server's rounds."""

    def __init__(self, course, client, folder: Path):
        self.course, self.client = course, client
        self.files = ClientStateDir(folder, course.cfg, client.id)
        # In a synchronous course a round is trained once from the state after the round before
        # (a round run again discarded its updates); in an asynchronous one a client may train
        # several times in one server round, so rounds say nothing of its state there.
        self.rounds_checked = course.cfg["course"] == "sync"
        self.round = FRESH        # the round of the state in the store
        self.previous = FRESH     # the round of the state that one was trained from
        client.state_round = FRESH   # told to the server when joining
        found = self.files.newest()
        if found is not None:
            self._use(*found)
            log.info("client %d: loaded its state of round %d from %s", client.id, self.round,
                     self.files.folder)

    def _use(self, round_: int, previous: int, state: dict[str, Any]) -> None:
        self.course.store.save(self.client.id, state)
        self.round = self.client.state_round = round_
        self.previous = previous

    def before_training(self, round_: int) -> None:
        """Asked to train `round_`: make the store hold the state this client had after round
        `round_` - 1. Its states form a chain (each file names the round it was trained from),
        so that state is the newest of the chain before `round_`: the one held, or the one it
        was trained from (kept on disk), or none at all if it had trained first after that."""
        if self.round < round_ or not self.rounds_checked:
            return
        cid, held = self.client.id, self.round
        target = self.previous if self.previous < round_ else None
        found = self.files.load(target) if target is not None and target != FRESH else None
        if found is not None:
            log.warning("client %d: the server asks for round %d and this client's state is of round %d "
                        "(the course resumed from an earlier round): going on from its saved state of "
                        "round %d", cid, round_, held, target)
            self._use(*found)
            self.files.drop(r for r in self.files.rounds() if r >= round_)   # a history undone
            return
        if target == FRESH:
            log.warning("client %d: the server asks for round %d; this client first trained in round %d, "
                        "after it: it starts round %d with fresh client state, as it did then",
                        cid, round_, held, round_)
        else:
            log.warning("client %d: no saved state consistent with round %d (this client's is of round "
                        "%d, trained from round %d's, and %s holds none older): it starts round %d with "
                        "fresh client state, as a new client would", cid, round_, held, self.previous,
                        self.files.folder, round_)
        self.course.store.save(cid, {})
        self.round = self.client.state_round = self.previous = FRESH
        self.files.drop(self.files.rounds())   # none of them is this course's history any more

    def resume_at(self, resumed_round: int) -> None:
        """The server resumed its course after round `resumed_round`: hold the state this client
        had after that round, the one its next round is trained from (the rule of
        `before_training`), so that the round it declares when joining is one the server expects."""
        self.before_training(resumed_round + 1)

    def after_training(self, round_: int) -> None:
        """Trained `round_`: write the store's state (before the update is sent) and keep two."""
        state = self.course.store.load(self.client.id)
        self.files.write(round_, self.round, state)
        self.previous, self.round = self.round, round_
        self.client.state_round = round_
        self.files.drop(self.files.rounds()[:-KEEP])


def keep_client_state(course, cfg) -> DurableClientState | None:
    """Install durability on a deployed client's course (`cfg`: the process's config, with its
    outdir; the course's own has none): its trainer's `fit` is wrapped (last, around every
    behaviour's own wrapper) to agree on the round before training and to write the state
    after it. None where `distribute.keep_client_state` is off or no folder is known."""
    if not cfg["distribute.keep_client_state"] or course.trainer is None:
        return None
    (cid,) = course.client_ids
    folder = default_state_dir(cfg, cid)
    if folder is None:
        return None
    durable = DurableClientState(course, course.clients[cid], folder)

    def durable_fit(fit, client_id, data, received, round_):
        durable.before_training(round_)
        result = fit(client_id, data, received, round_)
        durable.after_training(round_)
        return result
    course.trainer.wrap(Wrapper("distribute.keep_client_state", "fit", durable_fit))
    return durable
