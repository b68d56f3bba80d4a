"""A deployed vertical course: one party per process (`federate.mode: distributed`).

The active party is the server role, passive party k the client with id k; each builds only
its own table (`vertical_table`) and installs the simulation's handlers, plus:

- a join stage before PSI: every passive party sends `join_in` when it connects, and the
  active party starts PSI once all P-1 are in (in simulation the parties exist from the start);
- `client_lost`: a passive party that leaves before the course finished stops it, naming the
  party (its columns cannot be trained without it);
- checks of what a passive party sends (`MESSAGE_CHECKS`, read by fedcore.comm.validation), so
  that a malformed message is refused on the wire instead of raising in a handler;
- message bounds from the party's own row count and the cut width (`party_bounds`);
- a passive party's trained bottom model stays with it: written to `vertical.party_model` at the
  end (the active party's final_model.pt holds the top model and its own bottom model).
"""
from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any, Callable

import torch

from fedcore.handlers import vertical as v
from fedcore.handlers import vertical_snapshot as vs
from fedcore.kernel.config import declare
from fedcore.kernel.files import write_atomic
from fedcore.kernel.errors import FedcoreError
from fedcore.kernel.registry import components, courses
from fedcore.kernel.scheduler import HandlerError
from fedcore.kernel.state import make_state_store
from fedcore.kernel.worker import Client, Server

__all__ = ["build_party", "MESSAGE_CHECKS", "party_bounds", "PartyLost"]

log = logging.getLogger("fedcore.deploy")

ACTIVE = v.ACTIVE
POINT_BYTES = 32          # a blinded Curve25519 u-coordinate
MAX_ID_CHARS = 256        # a sample id's characters
OTHER_SET_FACTOR = 4      # the other party's id set may be up to 4x this party's (bounds)


declare("vertical.party_model", str, None, "vertical, deployed passive party: a file to write its "
        "trained part to when the course finishes (torch state dict: SplitNN bottom<p>.*, HE-LR w<p>); "
        "{party} in the path is replaced by the party's number; default: not written")


class PartyLost(FedcoreError, HandlerError):
    """A passive party left before the course finished: the course stops (exit 1) naming it."""


@components.register("vertical_party")
def build_party(course, party: int):
    """Build party `party`'s half of a deployed vertical course: its table, its worker (the
    server worker for the active party; returned, for its communicator to attach), the course's
    handlers and the deployment's."""
    cfg = course.cfg
    parties = cfg["vertical.parties"]
    course.client_ids = list(range(1, parties))
    course.num_clients = parties - 1
    course.data, course.trainer = None, None
    course.store = make_state_store("memory", None)
    course.party_bytes = v.PartyBytes(course.monitor, course.client_ids)
    table = components.get("vertical_table")(cfg, party)
    course.clients = {}
    if party == ACTIVE:
        server = course.server = Server(course.server_table, course)
        server.table, server.aggregator = table, v.PartyModels(course)
        server.finished, server.started, server.round, server.selected = False, False, 1, set()
        server.joined = set()
        server.aggregator.states = lambda: {}   # until alignment: nothing trained yet
        worker = server
    else:
        worker = course.client = Client(party, course.client_table, course, None)
        worker.table, worker.finished = table, False
        # its own state folder: the process's config has the outdir (the course's has none)
        worker.durable = vs.PassiveState.of(course, party, getattr(course, "process_cfg", cfg), deployed=True)
        course.clients[party] = worker
    courses.get(cfg["course"])(course)
    install(course)
    course.behaviours = []
    course.resumed_at = None
    course.table = table
    if party == ACTIVE:
        course.checkpointer = vs.VerticalSnapshots(course, deployed=True)
        v.prepare_resume(course, table, deployed=True)
    course.built = True
    return worker


def party_bounds(cfg, table) -> tuple[int, int]:
    """(bytes, values) one message to a party holding `table` may carry: the PSI sets (this
    party's and the other's, taken as at most OTHER_SET_FACTOR times as many ids) or as many
    ciphertexts (HE-LR, each below n^2), the shared ids, and one float64 tensor of a cut (or
    logit) row per id; plus 4096 values and 1 MiB of framing."""
    n = OTHER_SET_FACTOR * len(table.ids)
    item = MAX_ID_CHARS + 16                                # an id string, or a PSI point
    if cfg["vertical.method"] == "he_lr":
        item = max(item, 2 * ((cfg["vertical.he.key_bits"] + 7) // 8) + 16)   # a ciphertext
    values = 2 * n + 4096
    width = max(cfg["vertical.cut"], table.num_classes, 1)
    return (cfg["distribute.max_message_bytes"] or values * item + 8 * n * width + 2 ** 20,
            cfg["distribute.max_message_values"] or values)


# ------------------------------------------------------------------ the join stage
def join_party(party, _event=None) -> None:
    """Passive `start` (connected to the active party): announce ourselves."""
    party.send("join_in", ACTIVE, {"client_id": party.id})


def admit_party(active, msg) -> None:
    """Active `receiving_join_in`: once every passive party joined, align (PSI). A party that
    joins once the course has started is a new process (one that is in joins again only after
    a redial, which the communicator does not pass on): the state it trained is gone, so the
    course stops, naming it, to be resumed from its last snapshot with every party."""
    if active.started and not active.finished:
        raise PartyLost(f"vertical: party {msg.sender} joined again as a new process (its part of the "
                        f"course in progress is lost); {_stops(active)}")
    active.joined.add(msg.sender)
    log.info("vertical: party %d joined (%d of %d)", msg.sender, len(active.joined), active.course.num_clients)
    if len(active.joined) == active.course.num_clients and not active.started:
        active.started = True
        v.psi_start(active)


def party_lost(active, event: dict) -> None:
    """Active `client_lost`: before the course finished, a lost party stops it."""
    if active.finished:
        return
    raise PartyLost(f"vertical: party {event['client_id']} left before the course finished "
                    f"({event['reason']}); {_stops(active)}")


def _stops(active) -> str:
    """What a stopped course tells its operator: where it stopped, and where it can resume."""
    last = active.course.checkpointer.last_path
    resume = (f"; start the active party again with resume_from=latest (the snapshot of round "
              f"{active.course.checkpointer.last_round}) and the lost party, to go on from there"
              if last is not None else "")
    return f"the course stops (round {active.round}){resume}"


def wait_for_parties(active, _event=None) -> None:
    """Active `start` (listening): PSI waits for every passive party's `join_in`."""
    log.info("vertical: waiting for %d passive parties to join", active.course.num_clients)


def leave(party, msg) -> None:
    """Passive `receiving_finish`: the course is over; keep our trained bottom model."""
    v.finished(party, msg)
    path = party.course.cfg["vertical.party_model"]
    if not path or not hasattr(party, "total_steps"):   # nothing trained (or nowhere to keep it)
        return
    if hasattr(party, "bottom"):   # SplitNN: the bottom model
        state = {f"bottom{party.id}.{k}": t for k, t in party.bottom.model.state_dict().items()}
    else:                          # HE-LR: the party's weights
        state = {f"w{party.id}": party.model.w}
    if state:
        buf = io.BytesIO()
        torch.save(state, buf)
        path = Path(path.replace("{party}", str(party.id))).expanduser()
        write_atomic(path, buf.getvalue())
        log.info("vertical: party %d wrote its bottom model to %s", party.id, path)


def install(course) -> None:
    s, c = course.server_table, course.client_table
    s.register("start", wait_for_parties, sends=("client_lost",))
    c.register("start", join_party, sends=("join_in",))
    c.register("receiving_finish", leave)
    s.register("receiving_join_in", admit_party, sends=("psi_request",))
    s.register("client_lost", party_lost)


# ------------------------------------------------------------------ what a passive party may send
def _points(value: Any, what: str) -> str | None:
    if not isinstance(value, list) or any(not isinstance(p, bytes) or len(p) != POINT_BYTES for p in value):
        return f"{what} must be a list of {POINT_BYTES}-byte points"
    return None


def check_psi_reply(content: Any, active) -> str | None:
    if not isinstance(content, dict) or set(content) != {"reblinded", "own"}:
        return "psi_reply content must be {reblinded: [points], own: [points]}"
    problem = _points(content["reblinded"], "psi_reply reblinded") or _points(content["own"], "psi_reply own")
    if problem:
        return problem
    psi = getattr(active, "psi", None)
    if psi is not None and len(content["reblinded"]) != len(psi.order):
        return f"psi_reply reblinded holds {len(content['reblinded'])} points, {len(psi.order)} were sent"
    return None


def _cut_tensor(h: Any, rows: int | None, cut: int, dtype: torch.dtype, what: str) -> str | None:
    """`h` is a finite (rows, cut) tensor of the course's dtype (`rows` None: at most a batch;
    a message may be checked before the active party's own rows are aligned)."""
    if not isinstance(h, torch.Tensor) or h.dim() != 2 or h.shape[1] != cut or h.dtype != dtype \
            or (rows is not None and h.shape[0] != rows):
        got = f"{tuple(h.shape)} {h.dtype}" if isinstance(h, torch.Tensor) else type(h).__name__
        return f"{what} is {got}, expected {('rows' if rows is None else rows, cut)} {dtype}"
    if not torch.isfinite(h).all():
        return f"{what} has non-finite values"
    return None


def _cut(active) -> tuple[int, torch.dtype]:
    """The width and dtype of a passive party's rows: SplitNN's cut, HE-LR's partial logits."""
    cfg = active.course.cfg
    if cfg["vertical.method"] == "he_lr":
        return active.table.num_classes, torch.float64
    return cfg["vertical.cut"], getattr(torch, cfg["model.dtype"])


def check_activations(content: Any, active) -> str | None:
    """`activations` (SplitNN) and `partial_logits` (HE-LR): a step's rows of the batch."""
    if not isinstance(content, dict) or set(content) != {"step", "h"}:
        return "activations content must be {step: int, h: tensor}"
    step, total = content["step"], _total(active)
    if not _step(step, total):
        return f"activations step {step!r} is not a step of this course"
    cfg = active.course.cfg
    rows = None
    if total is not None:
        rows = len(components.get("batch_rows")(cfg["seed"], len(active.train_rows.ids), cfg["train.batch_size"], step))
    problem = _cut_tensor(content["h"], rows, *_cut(active), "activations h")
    if problem is None and rows is None and len(content["h"]) > cfg["train.batch_size"]:
        return f"activations h holds {len(content['h'])} rows, more than train.batch_size"
    return problem


def check_test_activations(content: Any, active) -> str | None:
    """`test_activations` (SplitNN) and `test_logits` (HE-LR): one row per test id."""
    if not isinstance(content, dict) or set(content) != {"h"}:
        return "test_activations content must be {h: tensor}"
    rows = len(active.test_rows.ids) if hasattr(active, "test_rows") else None
    return _cut_tensor(content["h"], rows, *_cut(active), "test_activations h")


def check_masked_gradient(content: Any, active) -> str | None:
    """HE-LR `masked_gradient`: ciphertexts below n^2, each in the key's fixed width."""
    if not isinstance(content, dict) or set(content) != {"step", "c"}:
        return "masked_gradient content must be {step: int, c: [ciphertexts]}"
    model = getattr(active, "model", None)
    if not hasattr(model, "n"):
        return "masked_gradient before the Paillier key (or in a course without one)"
    if not _step(content["step"], _total(active)):
        return f"masked_gradient step {content['step']!r} is not a step of this course"
    nsquare = model.n * model.n
    width = (nsquare.bit_length() + 7) // 8
    c = content["c"]
    if not isinstance(c, list) or not c or any(not isinstance(x, bytes) or len(x) != width for x in c):
        return f"masked_gradient c must be a non-empty list of {width}-byte ciphertexts"
    if any(int.from_bytes(x, "big") >= nsquare for x in c):
        return "masked_gradient c holds a value not below n^2"
    return None


def _total(active) -> int | None:
    """The course's steps, once the active party has aligned (None before)."""
    per_epoch = getattr(active, "per_epoch", None)
    return None if per_epoch is None else per_epoch * active.course.cfg["federate.total_round_num"]


def _step(step: Any, total: int | None) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0 and (total is None or step < total)


MESSAGE_CHECKS: dict[str, Callable[[Any, Any], "str | None"]] = {
    "psi_reply": check_psi_reply,
    "activations": check_activations,
    "test_activations": check_test_activations,
    "partial_logits": check_activations,
    "test_logits": check_test_activations,
    "masked_gradient": check_masked_gradient,
}
components.register("vertical_message_checks", MESSAGE_CHECKS)
components.register("vertical_party_bounds", party_bounds)
