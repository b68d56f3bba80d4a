"""The vertical course (`data.partition: vertical`): entity alignment, then split training.

Workers: the active party is the course's server worker (id 0, labels and top model); the
passive parties are clients 1..P-1. Stage 1 aligns the parties (DH-PSI, fedcore.algorithms.psi):
`psi_request` -> `psi_reply` -> `psi_result`. Stage 2 trains (vertical.method):
  splitnn  passive `activations` (step s) -> active top step -> `cut_gradients` (step s); each
           party then steps its bottom model and sends step s+1's activations; at an epoch's
           end it sends `test_activations`, and the active party records the round;
  he_lr    handlers/vertical_lr.py (Paillier-encrypted residuals).
A round is one epoch over the aligned training rows, in the seeded batch order every party
draws alike. metrics.jsonl holds per-party bytes and virtual time; summary.json
`psi_intersection`.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import components, courses
from fedcore.kernel.scheduler import HandlerError
from fedcore.kernel.state import make_state_store
from fedcore.kernel.worker import Client, Server
from fedcore.runtime.timing import TimeModel
from fedcore.comm.inprocess import InProcessComm
from fedcore.handlers import vertical_snapshot as vs

log = logging.getLogger("fedcore.vertical")

__all__ = ["build_vertical", "install", "prepare_resume", "MAX_CLASSES"]

ACTIVE = 0
MAX_CLASSES = 1 << 16   # the most classes a passive party accepts from the active party


class AlignmentRefused(ConfigError, HandlerError):
    """Bad data found during alignment: exits 2 in one line, like any config error (a
    HandlerError, so the worker passes it through unwrapped)."""


class PartyModels:
    """What final_model.pt holds: every party's trained parameters, prefixed by party."""

    def __init__(self, course):
        self.course = course
        # every party's state, once the course's setup has built the parties' models
        self.states: Callable[[], dict[str, torch.Tensor]] | None = None

    @property
    def global_state(self) -> dict[str, torch.Tensor] | None:
        return self.states() if self.states is not None else None


class PartyBytes:
    """Bytes on each passive party's link with the active party, per round and in total."""

    def __init__(self, monitor, parties: list[int]):
        self.monitor = monitor
        self.round = {p: 0 for p in parties}
        self.total = {p: 0 for p in parties}

    def __call__(self, msg, receiver: int, nbytes: int) -> None:
        self.monitor.count_bytes(msg, receiver, nbytes)
        party = msg.sender if msg.sender != ACTIVE else receiver
        self.round[party] += nbytes
        self.total[party] += nbytes

    def take(self) -> dict[str, int]:
        out = {f"bytes_party_{p}": n for p, n in self.round.items()}
        out.update({f"bytes_party_{p}_total": n for p, n in self.total.items()})
        self.round = {p: 0 for p in self.round}
        return out


@components.register("vertical_course")
def build_vertical(course) -> None:
    """Course.build for a vertical course: every party's table, the workers, links and handlers."""
    cfg = course.cfg
    parties = cfg["vertical.parties"]
    course.tables_by_party = components.get("vertical_tables")(cfg)
    course.client_ids = list(range(1, parties))
    course.num_clients = parties - 1
    course.data = None
    course.store = make_state_store("memory", None)
    course.trainer = None
    course.timing = TimeModel.from_config(cfg, course.client_ids)
    course.party_bytes = PartyBytes(course.monitor, course.client_ids)
    course.comm = InProcessComm(course.scheduler, course.timing, course.party_bytes)
    server = course.server = Server(course.server_table, course)
    server.table = course.tables_by_party[ACTIVE]
    server.finished, server.round, server.selected = False, 1, set()
    server.aggregator = PartyModels(course)
    course.comm.attach(server)
    course.clients = {}
    for p in course.client_ids:
        client = Client(p, course.client_table, course, None)
        client.table, client.finished = course.tables_by_party[p], False
        client.durable = vs.PassiveState.of(course, p, cfg, deployed=False)
        course.clients[p] = client
        course.comm.attach(client)
    courses.get(cfg["course"])(course)
    course.behaviours = []   # the horizontal behaviours (DP, compression, ...) do not apply here
    course.checkpointer = vs.VerticalSnapshots(course, deployed=False)
    course.resumed_at = None   # a resumed vertical course starts as a new one: join, PSI (vs)
    prepare_resume(course, server.table, deployed=False)
    course.built = True


def prepare_resume(course, table, deployed: bool) -> None:
    """`resume_from`: the checked snapshot (`course.vertical_resume`, None: from the start), its
    records and clock; its models are put in place once the active party has aligned."""
    course.vertical_resume = None
    if not course.cfg["resume_from"]:
        return
    state = vs.load_snapshot(course, active_template(course.cfg, table, course.num_clients + 1))
    if state is None:
        return
    course.vertical_resume = state
    vs.restore_records(course, state, keep_lines=deployed)
    if deployed:
        course.scheduler.continue_from(state["virtual_time"])
    else:
        course.scheduler.now = course.server.now = state["virtual_time"]
    course.server.round = state["round"]


def active_template(cfg, table, parties: int):
    """The active party's part, of the course's layout and untrained (what a snapshot is checked
    against before the active party has aligned)."""
    x, y = table.x, table.y
    if cfg["vertical.method"] == "he_lr":
        return components.get("lr_active")(cfg, x, x[:0], y, y[:0], table.num_classes, keyed=False)
    own = components.get("splitnn_bottom")(cfg, ACTIVE, x, x[:0])
    return components.get("splitnn_top")(cfg, parties, own, y, y[:0], table.num_classes)


def resume_round(active) -> int:
    """The round the course goes on from (0: the start); a resumed one's models put in place."""
    state = getattr(active.course, "vertical_resume", None)
    if state is None:
        return 0
    vs.apply(state["parts"], active.model)
    active.round = state["round"]
    return state["round"]


def fresh(active, msg) -> bool:
    """A party's training message counts once the active party has aligned and, deployed, once
    that party joined this process's course (one queued for an earlier incarnation of the
    active party and delivered on reconnecting is dropped, with a line)."""
    joined = getattr(active, "joined", None)
    if hasattr(active, "acts") and (joined is None or msg.sender in joined):
        return True
    log.info("vertical: dropped %s from party %d, sent before it joined this course", msg.msg_type, msg.sender)
    return False


# ------------------------------------------------------------------ stage 1: alignment
def psi_start(active, _event=None) -> None:
    """`start`: blind the active party's ids and ask every passive party to re-blind them."""
    psi = components.get("psi")()
    active.psi = psi.PsiActive(list(active.table.ids))
    active.psi_pending = set(active.course.client_ids)
    active.send("psi_request", sorted(active.psi_pending), {"points": active.psi.request()})


def psi_answer(party, msg) -> None:
    """`receiving_psi_request`: re-blind the request, blind and shuffle our own ids."""
    psi = components.get("psi")()
    reblinded, own = psi.passive_reply(party.table.ids, list(msg.content["points"]))
    party.send("psi_reply", ACTIVE, {"reblinded": reblinded, "own": own})


def psi_collect(active, msg) -> None:
    """`receiving_psi_reply`: match one party's reply; raise `psi_done` when all are in."""
    if msg.sender not in active.psi_pending:
        log.warning("vertical: a PSI reply from party %d was not expected; ignored", msg.sender)
        return
    active.psi.receive(msg.sender, list(msg.content["reblinded"]), list(msg.content["own"]))
    active.psi_pending.discard(msg.sender)
    if not active.psi_pending:
        active.trigger("psi_done")


def psi_finish(active, _event=None) -> None:
    """`psi_done`: tell every party the shared ids; align the active party's rows to them."""
    shared = active.psi.shared()
    if not shared:
        raise AlignmentRefused("vertical: the parties' sample ids do not intersect; PSI found no shared "
                          "id (check vertical.files and vertical.id_column)")
    active.course.monitor.add_summary("vertical", {"psi_intersection": len(shared),
                                                   "parties": active.course.num_clients + 1})
    resumed = getattr(active.course, "vertical_resume", None)
    active.send("psi_result", active.course.client_ids, {   # and how to set up: classes, the round
        "ids": shared, "classes": active.table.num_classes, "round": resumed["round"] if resumed else 0})
    align(active, shared)
    active.trigger("aligned")


def psi_learn(party, msg) -> None:
    """`receiving_psi_result`: keep the shared rows, learn the class count (a passive party's
    own file has no labels) and the round to go on from, then start training. A setup this
    party cannot use, or a round it holds no state of, stops it (`stop_party`)."""
    try:
        setup = _setup(msg.content, party.course.cfg["federate.total_round_num"])
        party.table.num_classes, party.resumed_round = setup
        align(party, list(msg.content["ids"]))
        party.trigger("aligned")
    except (vs.SetupRefused, vs.StateMissing) as exc:
        stop_party(party, exc)


def _setup(content, total: int) -> tuple[int, int]:
    """(classes, round) of a `psi_result`, or SetupRefused saying why not, in one line."""
    if not isinstance(content, dict) or set(content) != {"ids", "classes", "round"}:
        raise vs.SetupRefused("vertical: the active party's psi_result is not {ids, classes, round}")
    classes = content["classes"]
    if isinstance(classes, bool) or not isinstance(classes, int) or not 1 <= classes <= MAX_CLASSES:
        raise vs.SetupRefused(f"vertical: the active party's psi_result names {repr(classes)[:40]} "
                              f"classes, not an int in 1..{MAX_CLASSES}")
    return classes, vs.check_round(content, total)


def stop_party(party, exc: Exception) -> None:
    """End this passive party with `exc`'s line: raised in simulation; deployed, through its
    course's `end_with` (a client reports an error raised while handling a message and waits for the
    next one, which would leave the course waiting on this party)."""
    end_with = getattr(party.course, "end_with", None)
    if end_with is None:
        raise exc
    end_with(exc)


def align(worker, shared: list[str]) -> None:
    """The worker's aligned train and test rows (the seeded split every party draws)."""
    train_ids, test_ids = components.get("vertical_train_test_ids")(shared, worker.course.cfg)
    worker.train_rows, worker.test_rows = worker.table.aligned(train_ids), worker.table.aligned(test_ids)
    if worker.course.cfg["vertical.standardize"]:
        components.get("vertical_standardize")(worker.train_rows, worker.test_rows)


# ------------------------------------------------------------------ stage 2: split learning
def split_setup_active(active, _event=None) -> None:
    """`aligned` (active): the bottom and top models; wait for the passive parties' activations."""
    course, cfg = active.course, active.course.cfg
    Bottom, Top = components.get("splitnn_bottom"), components.get("splitnn_top")
    per_epoch = components.get("batches_per_epoch")
    own = Bottom(cfg, ACTIVE, active.train_rows.x, active.test_rows.x)
    active.model = Top(cfg, course.num_clients + 1, own, active.train_rows.y, active.test_rows.y,
                       active.table.num_classes)
    active.per_epoch = per_epoch(len(active.train_rows.ids), cfg["train.batch_size"])
    active.total_steps = active.per_epoch * cfg["federate.total_round_num"]
    active.acts, active.test_acts, active.trained, active.losses = {}, {}, set(), []
    active.party_time = {}
    active.aggregator.states = lambda: {**active.model.state(), **{
        f"bottom{p}.{k}": v for p, c in course.clients.items() if hasattr(c, "bottom")   # set up
        for k, v in c.bottom.model.state_dict().items()}}
    if resume_round(active) >= cfg["federate.total_round_num"]:
        finish(active)   # resumed from the last round's snapshot: nothing left to train


def split_setup_passive(party, _event=None) -> None:
    """`aligned` (passive): the bottom model; send the first batch's activations."""
    party.bottom = components.get("splitnn_bottom")(party.course.cfg, party.id, party.train_rows.x,
                                                    party.test_rows.x)
    start_passive(party, party.bottom, send_activations)


def start_passive(party, model, send_first) -> None:
    """A passive party's start, whatever its model: its steps per epoch and in all, `model` as of
    the resumed round (its own saved state), and the first batch's message unless none is left."""
    cfg = party.course.cfg
    party.per_epoch = components.get("batches_per_epoch")(len(party.train_rows.ids), cfg["train.batch_size"])
    party.total_steps = party.per_epoch * cfg["federate.total_round_num"]
    party.durable.restore(model, party.resumed_round)
    if party.resumed_round * party.per_epoch < party.total_steps:
        send_first(party, party.resumed_round * party.per_epoch)


def send_activations(party, step: int) -> None:
    h = party.bottom.forward(step)
    party.spend(float(len(h)))
    party.send("activations", ACTIVE, {"step": step, "h": h}, round_=step // party.per_epoch + 1)


def collect_activations(active, msg) -> None:
    """`receiving_activations`: keep a party's cut activations; `all_activations` when all are in."""
    if not fresh(active, msg):
        return
    step = int(msg.content["step"])
    active.acts.setdefault(step, {})[msg.sender] = msg.content["h"]
    if len(active.acts[step]) == active.course.num_clients:
        active.trigger("all_activations", step)


def top_step(active, step: int) -> None:
    """`all_activations`: top forward/backward, return each party's cut gradient, step."""
    grads, loss = active.model.step(step, active.acts.pop(step))
    active.losses.append(loss)
    round_ = step // active.per_epoch + 1
    for p, g in grads.items():
        active.send("cut_gradients", p, {"step": step, "g": g}, round_=round_)
    if (step + 1) % active.per_epoch == 0:
        active.course.checkpointer.capture(active, round_)
        active.trained.add(round_)
        active.trigger("round_ready", round_)


def apply_gradients(party, msg) -> None:
    """`receiving_cut_gradients`: step the bottom model; test activations at an epoch's end; next batch."""
    step = int(msg.content["step"])
    party.bottom.backward(msg.content["g"])
    party.spend(float(len(msg.content["g"])))
    if (step + 1) % party.per_epoch == 0:
        party.durable.save(party.bottom, (step + 1) // party.per_epoch)
        party.send("test_activations", ACTIVE, {"h": party.bottom.test_activations()}, round_=msg.round)
    if step + 1 < party.total_steps:
        send_activations(party, step + 1)


def collect_test(active, msg) -> None:
    """`receiving_test_activations`: keep them; `round_ready` when every party's are in."""
    if not fresh(active, msg):
        return
    active.test_acts.setdefault(msg.round, {})[msg.sender] = msg.content["h"]
    active.party_time.setdefault(msg.round, {})[msg.sender] = active.now
    if len(active.test_acts[msg.round]) == active.course.num_clients:
        active.trigger("round_ready", msg.round)


def record(active, round_: int) -> None:
    """`round_ready`: once the epoch is trained and every party's test activations are in,
    evaluate and record the round; after the last, finish."""
    course = active.course
    if round_ not in active.trained or len(active.test_acts.get(round_, {})) < course.num_clients:
        return
    fields = {"num_updates": course.num_clients,
              "train_loss": sum(active.losses) / max(1, len(active.losses)),
              **active.model.evaluate(active.test_acts.pop(round_)), **course.party_bytes.take(),
              **{f"virtual_time_party_{p}": t for p, t in active.party_time.pop(round_).items()}}
    active.losses = []
    course.monitor.record_round(round_, active.now, fields)
    course.checkpointer.write(active, round_)
    active.round = round_
    if round_ >= course.cfg["federate.total_round_num"]:
        finish(active)
    else:
        course.checkpointer.stop_if_asked(round_)


def finish(active) -> None:
    states = active.aggregator.states()
    count = sum(v.numel() for v in states.values())
    active.course.monitor.add_summary("model", {"trainable_params": count, "total_params": count})
    active.finished = True
    active.course.monitor.add_summary("stop", {"stopped_by": "max_rounds"})
    active.send("finish", active.course.client_ids, {})


def finished(party, _msg) -> None:
    """`receiving_finish`: the course is over for this party."""
    party.finished = True


def install_alignment(course) -> None:
    s, c = course.server_table, course.client_table
    if course.cfg["federate.mode"] != "distributed":   # deployed: handlers/vertical_deploy.py
        s.register("start", psi_start, sends=("psi_request",))
        c.register("receiving_finish", finished)
    c.register("receiving_psi_request", psi_answer, sends=("psi_reply",))
    s.register("receiving_psi_reply", psi_collect, sends=("psi_done",))
    s.register("psi_done", psi_finish, sends=("psi_result", "aligned"))
    c.register("receiving_psi_result", psi_learn, sends=("aligned",))


@courses.register("vertical_splitnn")
def install(course) -> None:
    install_alignment(course)
    s, c = course.server_table, course.client_table
    s.register("aligned", split_setup_active)
    c.register("aligned", split_setup_passive, sends=("activations",))
    s.register("receiving_activations", collect_activations, sends=("all_activations",))
    s.register("all_activations", top_step, sends=("cut_gradients", "round_ready"))
    c.register("receiving_cut_gradients", apply_gradients, sends=("activations", "test_activations"))
    s.register("receiving_test_activations", collect_test, sends=("round_ready",))
    s.register("round_ready", record, sends=("finish",))
