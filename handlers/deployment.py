"""Server handlers that only a deployment needs: join timeout, lost clients, round deadline.

The runtime raises `client_lost` (a client stopped sending heartbeats, left,
or was refused for breaking the protocol) and `round_check` (periodically);
these handlers decide what that means for the course. In a synchronous
course a lost client is dropped from the round it was sampled for, so the
round completes with the others (`all_received`); a round with no one left to
wait for starts again with the clients now connected. Other courses keep
going under their own condition events (goal, time_up): a lost client that
was sent a model is released as if its reply had timed out (it is replaced
by an idle client, and no longer sampled), and when every client in flight
was lost the clients that connect again are sent the current model. Every
drop is logged and listed in the summary (the first `LISTED` of each list;
`*_total` counts them all).

A synchronous round has a deadline for each sampled client even when
`distribute.round_deadline` is unset: max(`distribute.heartbeat_timeout`,
`distribute.deadline_factor` x t), at most `distribute.max_round_deadline`,
plus the time the model takes down and up at `distribute.min_bytes_per_second`,
where t is the lower median of the *other* clients' latest reply times. No
client can lengthen its own deadline by being late, a minority of slow clients
cannot move the median, and the ceiling bounds what any number can do. A client
dropped for its deadline is not sampled again until it sends an update (a late
one), joins again from a new process, or comes back after its session was lost,
so a client whose trainer hangs while its heartbeats flow delays the course
once, by at most its deadline. A new process is sampled only once it has joined
(`ServerCourse.client_ids`): until then it is building its course and could not
answer in time.

A round of several exchanges (secure aggregation's five stages, `time_stages`) is
timed per stage: each stage's request starts its clients' clocks, and t is the
lower median of the other clients' latest reply times *to that stage*, so a stage
that takes milliseconds is not given the time training takes. A client dropped at
the stage that carries the model (`models`: it may be hung in training) is benched
as above; one dropped at a later stage answered the model's stage in this round,
so it is sampled again in the next: withholding a later answer costs each round it
is sampled in at most that stage's deadline.
"""
from __future__ import annotations

import bisect
import logging
import sys
from dataclasses import dataclass, field
from typing import Any

from fedcore.deployment.deployed_resume import check_state_round, listed_in_summary as _listed
from fedcore.kernel.message import SERVER_ID
from fedcore.runtime.quiet import QuietLog
from fedcore.handlers import asyn
from fedcore.kernel.registry import behaviours, components
from fedcore.kernel.server_state import worker_state

__all__ = ["arm", "join_timeout", "client_lost", "round_check", "note_traffic", "ReplyTimes",
           "DeployWatch", "benched", "time_stages", "new_session", "returned", "install"]

log = logging.getLogger("fedcore.deploy")

QUANTILE = 0.5   # of the other clients' reply times: the lower median, which a minority cannot move
TRAINING = "models"   # the request whose reply follows local training: the stage a hung trainer misses


def _quiet(server) -> QuietLog:
    """Per-client lines, each kind at most once every few seconds (a peer may flap on purpose)."""
    return server.state(DeployWatch).quiet


def arm(server, _event=None) -> None:
    """Server `start`: the join timeout (with `distribute.min_clients`, the course may start then)."""
    cfg = server.course.cfg
    server.state(DeployWatch).seen_round = (None, 0.0)
    server.set_timer(cfg["distribute.join_timeout"], "join_timeout")


def join_timeout(server, _event=None) -> None:
    """`join_timeout`: start once `distribute.min_clients` are in; otherwise check again soon.
    Without it the course waits for every client, and says so once."""
    if server.started:
        return
    cfg = server.course.cfg
    live = len(server.course.client_ids)
    if cfg["distribute.min_clients"] is None:
        log.warning("join timeout: %d of the %d clients have joined; the course starts when all have "
                    "(distribute.min_clients lets it start with fewer)", live, cfg["federate.client_num"])
        return
    if live >= cfg["distribute.min_clients"]:
        log.warning("join timeout: starting with %d of %d clients", live, cfg["federate.client_num"])
        server.started = True
        server.trigger("all_joined_in")
    else:
        log.warning("join timeout: %d of the %d clients needed (distribute.min_clients) have joined; waiting",
                    live, cfg["distribute.min_clients"])
        server.set_timer(cfg["distribute.heartbeat_interval"], "join_timeout")


def _sync(server) -> bool:
    return server.course.cfg["course"] == "sync" and isinstance(server.selected, set)


def _async(server) -> bool:
    return server.course.cfg["course"] == "async" and hasattr(server, "in_flight")


def _drop(server, ids: list[int], why: str) -> None:
    """Stop waiting for `ids` this round; complete or restart the round if no one is left."""
    hit = sorted(c for c in ids if c in server.selected)
    if not hit:
        return
    server.selected.difference_update(hit)
    log.warning("round %d: dropped client(s) %s from the round: %s", server.round, hit, why)
    _listed(server, "dropped", {"round": server.round, "clients": hit, "reason": why})
    if not server.selected:
        if server.buffer:
            server.trigger("all_received")
        else:
            server.trigger("all_joined_in")


def client_lost(server, info) -> None:
    """`client_lost` {client_id, reason}: log it; in a sync round, stop waiting for that client."""
    cid, reason = info["client_id"], info["reason"]
    quiet = _quiet(server)
    if server.finished or not server.started:
        quiet(f"gone {cid}", f"client {cid} gone {'after' if server.finished else 'before'} the course: "
                             f"{reason}", logging.INFO)
        return
    quiet(f"lost {cid}", f"client {cid} lost in round {server.round}: {reason}")
    _listed(server, "lost_clients",
            {"client": cid, "round": server.round, "time": round(server.now, 3), "reason": reason})
    if _sync(server):
        _drop(server, [cid], f"client {cid} {reason}")
    elif _async(server):
        asyn.release(server, [cid], f"lost ({reason})")


def round_check(server, _event=None) -> None:
    """Periodic: drop the sampled clients past their deadline; restart a round no one was sampled for."""
    if not server.started or server.finished:
        return
    if _async(server):
        if not server.in_flight and server.course.client_ids:
            asyn.restart_idle(server)
        return
    if not _sync(server):
        return
    this_round = (server.round, id(server.buffer))  # a round run again gets a new buffer
    watch = server.state(DeployWatch)
    seen_round, since = watch.seen_round
    first_look = seen_round != this_round
    if first_look:
        watch.seen_round, since = (this_round, server.now), server.now
    late = _overdue(server, since)
    if late:   # dropped together: dropping completes the round, and the next has other clients
        lo, hi = min(_deadline(server, c) for c in late), max(_deadline(server, c) for c in late)
        span = f"{lo:.3g}s" if lo == hi else f"{lo:.3g}-{hi:.3g}s"
        stage = watch.asked
        if server.course.cfg["distribute.round_deadline"] is not None:
            why = f"no reply{_to(stage)} within distribute.round_deadline={lo:g}s"
        elif stage == TRAINING:
            why = f"no reply within the derived round deadline of {span} (distribute.deadline_factor)"
        else:
            why = f"no reply{_to(stage)} within the derived deadline of {span} (distribute.deadline_factor)"
        if stage == TRAINING:   # it may hang in training (silent at a later stage, it answered this round)
            benched(server).update(late)   # not sampled again until it shows life (`note_traffic`)
        _drop(server, late, why)
    if not late and not first_look and not server.selected and not server.buffer \
            and server.course.client_ids:
        log.warning("round %d: restarting with the clients now connected", server.round)
        watch.seen_round = (this_round, server.now)
        server.trigger("all_joined_in")


def _to(stage: str) -> str:
    return "" if stage == TRAINING else f" to {stage}"


class ReplyTimes:
    """How long each client's latest reply to one stage took, from its request (the model, for
    a plain round) sent to its reply received: what the derived deadline is measured on. One
    value per client, so no client weighs more than one vote, and a client's own value is left
    out of its own deadline."""

    __slots__ = ("sent", "took", "first", "_sorted")

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, float]] = {}   # client -> (round, when its request was sent)
        self.took: dict[int, float] = {}
        self.first = (None, 0.0)                       # (round, its first request sent)
        self._sorted: list[float] | None = []

    def asked(self, cid: int, round_: int, now: float) -> None:
        self.sent[cid] = (round_, now)
        if self.first[0] != round_:
            self.first = (round_, now)

    def replied(self, cid: int, round_: int, now: float) -> None:
        sent = self.sent.get(cid)
        if sent is not None and sent[0] == round_:
            self.took[cid] = now - sent[1]
            self._sorted = None

    def since(self, cid: int, round_: int) -> float | None:
        """When `cid` was sent round `round_`'s request (None: not known)."""
        sent = self.sent.get(cid)
        return sent[1] if sent is not None and sent[0] == round_ else None

    def of_others(self, cid: int) -> float | None:
        """The QUANTILE of the other clients' latest reply times (None: none has replied yet)."""
        if self._sorted is None:
            self._sorted = sorted(self.took.values())
        values, own = self._sorted, self.took.get(cid)
        n = len(values) - (own is not None)
        if n <= 0:
            return None
        j = int(QUANTILE * (n - 1))
        if own is None:
            return values[j]
        return values[j] if j < bisect.bisect_left(values, own) else values[j + 1]

    def lowest(self) -> float | None:
        """The least `of_others` gives any client (None: some client may get None)."""
        if self._sorted is None:
            self._sorted = sorted(self.took.values())
        n = len(self._sorted)
        return self._sorted[int(QUANTILE * max(n - 2, 0))] if n else None


@worker_state("deployment")
@dataclass
class DeployWatch:
    """What the deployed server watches its live clients with. Transient, none of it is
    saved: it times replies and connections of the running processes (wall-clock instants
    of this incarnation), and a resumed server's clients join it again anyway."""
    transient = True
    quiet: QuietLog = field(default_factory=lambda: QuietLog(log))
    seen_round: tuple[Any, float] = (None, 0.0)      # the round round_check last saw, since when
    stages: dict[str, ReplyTimes] = field(default_factory=lambda: {TRAINING: ReplyTimes()})  # request -> times
    replies: dict[str, str] = field(default_factory=lambda: {"updates": TRAINING})   # reply type -> request
    asked: str = TRAINING                            # the request last sent: the stage the round waits on
    benched: set[int] = field(default_factory=set)   # missed a deadline, not sampled until heard from
    new_sessions: set[int] = field(default_factory=set)   # a new process each, whose join is to come
    model_bytes: int | None = None                   # the global model's size, measured once
    stage_bytes: int = 0                             # a stage's largest message, if above the model's


def _times(server, stage: str | None = None) -> ReplyTimes:
    """The reply times of `stage` (a request type; None: the stage the round waits on)."""
    watch = server.state(DeployWatch)
    return watch.stages[stage or watch.asked]


def time_stages(server, stages: list[tuple[str, str]], nbytes: int = 0) -> None:
    """A round made of the exchanges `stages` ((request type, reply type), in order, the first
    `models`), each timed on its own replies and given its own derived deadline; `nbytes`: the
    most one of their messages carries, where that is more than the model (a slow link's
    allowance is sized on it)."""
    if not stages or stages[0][0] != TRAINING:
        raise ValueError(f"a round's first stage is its {TRAINING!r}, not {stages[:1]}")
    watch = server.state(DeployWatch)
    watch.stages = {request: ReplyTimes() for request, _ in stages}
    watch.replies = {reply: request for request, reply in stages}
    watch.asked = TRAINING
    watch.stage_bytes = nbytes


def benched(server) -> set[int]:
    """Clients dropped for missing a deadline: not sampled until they send an update, or join
    from a new process."""
    return server.state(DeployWatch).benched


def new_session(server, client_id: int) -> None:
    """A new process connected as `client_id`: its join may bring it back from the bench (a
    join sent again on a session already in does not: a hung client would be waited for anew
    at every deadline)."""
    server.state(DeployWatch).new_sessions.add(client_id)


def returned(server, client_id: int) -> None:
    """The process of `client_id` is back after its session was lost (the same session id):
    off the bench, so it is asked again. A hung trainer's heartbeats keep its session, so
    this does not let one be waited for anew; a process silent past `heartbeat_timeout` each
    time costs the course at most one deadline per return, as a restart does."""
    benched(server).discard(client_id)
    _joined_during_course(server, client_id, "session back")


def note_traffic(server, msg, receiver: int, now: float) -> None:
    """Every message the deployed server sends or receives: a stage's requests sent (models,
    for a plain round) and replies received (updates) time the clients' replies; a reply, or
    the first join of a new process, from a benched client brings it back."""
    watch = server.state(DeployWatch)
    if receiver != SERVER_ID:
        times = watch.stages.get(msg.msg_type)
        if times is not None:
            times.asked(receiver, msg.round, now)
            watch.asked = msg.msg_type
        return
    request = watch.replies.get(msg.msg_type)
    if request is not None:
        watch.stages[request].replied(msg.sender, msg.round, now)
    elif msg.msg_type == "join_in":
        check_state_round(server, msg)
        if msg.sender not in watch.new_sessions:
            return
        watch.new_sessions.discard(msg.sender)
        _joined_during_course(server, msg.sender, "new process joined")
    else:
        return
    watch.benched.discard(msg.sender)


def _joined_during_course(server, cid: int, how: str) -> None:
    """A client that joins a running course, or comes back to it, is asked from the next round
    on: listed in the summary (`joined_during_course`) with the round then in progress."""
    if server.started and not server.finished:
        _listed(server, "joined_during_course",
                {"client": cid, "round": server.round, "how": how})


def _overdue(server, since: float) -> list[int]:
    """The sampled clients still waited for whose deadline has passed."""
    times = _times(server)
    first = times.first[1] if times.first[0] == server.round else since
    if server.now - min(first, since) <= _deadline(server, None):   # no one's yet (a fleet's rounds)
        return []
    overdue = []
    for cid in server.selected:
        sent = times.since(cid, server.round)
        elapsed = server.now - (since if sent is None else sent)
        if elapsed > _deadline(server, cid):
            overdue.append(cid)
    return sorted(overdue)


def _deadline(server, cid: int | None, stage: str | None = None) -> float:
    """Client `cid`'s deadline at `stage` (None: the stage the round waits on), in seconds from
    its request sent. Derived, it is measured on the other clients' latest reply times to that
    stage (their QUANTILE, so neither this client's own lateness nor a minority of slow ones can
    lengthen it), bounded by distribute.max_round_deadline whatever they do; and it leaves room
    for two model-sized transfers (the model down and its update up; a stage's largest message,
    where larger) on the slowest link served (distribute.min_bytes_per_second), so a slow link
    is not mistaken for a hung client."""
    cfg = server.course.cfg
    if cfg["distribute.round_deadline"] is not None:
        return cfg["distribute.round_deadline"]
    watch = server.state(DeployWatch)
    if watch.model_bytes is None:
        watch.model_bytes = sum(t.numel() * t.element_size() for t in server.aggregator.global_state.values())
    transfer = 2 * max(watch.model_bytes, watch.stage_bytes) / cfg["distribute.min_bytes_per_second"]
    times, ceiling = _times(server, stage), cfg["distribute.max_round_deadline"]
    took = times.lowest() if cid is None else times.of_others(cid)   # None: the least of anyone's
    if took is None:
        return ceiling + transfer
    return min(ceiling, max(cfg["distribute.heartbeat_timeout"], cfg["distribute.deadline_factor"] * took)) + transfer


def least_deadline(server) -> float:
    """The least deadline any client has now: how long a round's record waits for the
    evaluations it asked for before it is written without the missing ones (measured on the
    stage that trains)."""
    return _deadline(server, None, TRAINING)


@behaviours.register("deployment")
def install(course) -> None:
    s = course.server_table
    if course.cfg["course"] == "async":  # lost clients are released to the async strategy
        again = ("models", "reply_timeout")
    else:
        again = ("all_received", "all_joined_in")
    s.register("start", arm, sends=("join_timeout", "client_lost", "round_check"))
    s.register("join_timeout", join_timeout, sends=("all_joined_in", "join_timeout"))
    s.register("client_lost", client_lost, sends=again)
    s.register("round_check", round_check, sends=again)


components.register("deployment", sys.modules[__name__])   # the core's deployed server calls these
