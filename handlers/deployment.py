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

A synchronous round has a deadline even when `distribute.round_deadline` is
unset: once half of its clients have replied, taking t seconds, the others
are dropped after max(`distribute.heartbeat_timeout`,
`distribute.deadline_factor` x t) plus the time the model takes down and up
at `distribute.min_bytes_per_second`; until half have replied, t is the slowest
earlier round's. A client whose trainer hangs while its heartbeats flow cannot
hold the course (in the first round, only `distribute.round_deadline` bounds a
hung majority).
"""
from __future__ import annotations

import logging

from fedcore.quiet import QuietLog
from fedcore.handlers import asyn
from fedcore.registry import behaviours

__all__ = ["arm", "join_timeout", "client_lost", "round_check", "install"]

log = logging.getLogger("fedcore.deploy")

LISTED = 50  # entries kept in each summary list; the counts go on


def _quiet(server) -> QuietLog:
    """Per-client lines, each kind at most once every few seconds (a peer may flap on purpose)."""
    q = getattr(server, "deploy_log", None)
    if q is None:
        q = server.deploy_log = QuietLog(log)
    return q


def _listed(server, key: str, entry: dict) -> None:
    """Append `entry` to the summary's list `key` (bounded) and count it in `key_total`."""
    extra = server.course.monitor.extra_summary
    entries = extra.setdefault(key, [])
    if len(entries) < LISTED:
        entries.append(entry)
    extra[f"{key}_total"] = extra.get(f"{key}_total", 0) + 1


def arm(server, _event=None) -> None:
    """Server `start`: with `distribute.min_clients`, start after the join timeout."""
    cfg = server.course.cfg
    server.deploy_round, server.deploy_from = (None, 0.0), server.round
    if cfg["distribute.min_clients"] is not None:
        server.set_timer(cfg["distribute.join_timeout"], "join_timeout")


def join_timeout(server, _event=None) -> None:
    """`join_timeout`: start once `distribute.min_clients` are in; otherwise check again soon."""
    if server.started:
        return
    cfg = server.course.cfg
    live = len(server.course.client_ids)
    if live >= cfg["distribute.min_clients"]:
        log.warning("join timeout: starting with %d of %d clients", live, cfg["federate.client_num"])
        server.started = True
        server.trigger("all_joined_in")
    else:
        log.warning("join timeout: %d of the %d clients needed (distribute.min_clients) have joined; waiting",
                    live, cfg["distribute.min_clients"])
        server.set_timer(cfg["distribute.heartbeat_interval"], "join_timeout")


def _sync(server) -> bool:
    return server.course.cfg["course"] == "sync" and isinstance(getattr(server, "selected", None), set)


def _async(server) -> bool:
    return server.course.cfg["course"] == "async" and hasattr(server, "in_flight")


def _drop(server, ids: list[int], why: str) -> None:
    """Stop waiting for `ids` this round; complete or restart the round if no one is left."""
    hit = sorted(c for c in ids if c in server.selected)
    if not hit:
        return
    server.selected.difference_update(hit)
    server.deploy_dropped = (server.round, id(server.buffer))   # its time measures no one
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
    """Periodic: enforce `distribute.round_deadline`; restart a round no one was sampled for."""
    last_check, server.deploy_checked = getattr(server, "deploy_checked", None), server.now
    if not server.started:
        server.deploy_from = server.round   # the round the course will start from
        return
    if server.finished:
        return
    if _async(server):
        if not server.in_flight and server.course.client_ids:
            asyn.restart_idle(server)
        return
    if not _sync(server):
        return
    this_round = (server.round, id(server.buffer))  # a round run again gets a new buffer
    seen_round, since = getattr(server, "deploy_round", (None, 0.0))
    if seen_round != this_round:
        # Rounds that completed with every reply between two checks, too fast for a check to
        # see half of them in: their whole time (at most the time since then) is the measure
        # for a later round in which no one replies (one sampled client that hangs).
        if seen_round is None:   # the first check since the start: rounds done since the last
            if server.round > getattr(server, "deploy_from", server.round) and last_check is not None \
                    and getattr(server, "deploy_dropped", None) is None:
                _note_round_time(server, server.now - last_check)
        elif getattr(server, "deploy_half", None) is None \
                and getattr(server, "deploy_dropped", None) != seen_round:
            _note_round_time(server, server.now - since)
        server.deploy_round, server.deploy_half = (this_round, server.now), None
        return
    replied, waiting = len(server.buffer), len(server.selected)
    if getattr(server, "deploy_half", None) is None and replied and replied >= waiting:
        server.deploy_half = server.now
        _note_round_time(server, server.now - since)
    deadline = _deadline(server, since)
    if deadline is not None and server.selected and server.now - since > deadline:
        if server.course.cfg["distribute.round_deadline"] is not None:
            why = f"no reply within distribute.round_deadline={deadline:g}s"
        else:
            why = f"no reply within the derived round deadline of {deadline:.3g}s (distribute.deadline_factor)"
        _drop(server, sorted(server.selected), why)
    elif not server.selected and not server.buffer and server.course.client_ids:
        log.warning("round %d: restarting with the clients now connected", server.round)
        server.deploy_round = (this_round, server.now)
        server.trigger("all_joined_in")


def _note_round_time(server, seconds: float) -> None:
    """Remember the slowest time to half a round's replies (or, where the checks saw a round
    only once it was over, to all of them)."""
    server.deploy_slowest = max(getattr(server, "deploy_slowest", 0.0), seconds)


def _deadline(server, since: float) -> float | None:
    """This round's deadline in seconds (None: none yet). Derived, it is measured on the time
    half of this round's clients took to reply, or, until they have, on the slowest earlier
    round's that completed without drops (a round whose clients mostly hang would otherwise
    never get one); and it leaves room for the model to go down and its update to come up on
    the slowest link served (distribute.min_bytes_per_second), so a slow link is not mistaken
    for a hung client."""
    cfg = server.course.cfg
    if cfg["distribute.round_deadline"] is not None:
        return cfg["distribute.round_deadline"]
    half = getattr(server, "deploy_half", None)
    took = half - since if half is not None else getattr(server, "deploy_slowest", None)
    if took is None:
        return None
    if not hasattr(server, "model_bytes"):
        server.model_bytes = sum(t.numel() * t.element_size() for t in server.aggregator.global_state.values())
    transfer = 2 * server.model_bytes / cfg["distribute.min_bytes_per_second"]
    return max(cfg["distribute.heartbeat_timeout"], cfg["distribute.deadline_factor"] * took) + transfer


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
