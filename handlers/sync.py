"""The synchronous course: sample, broadcast, wait for `all_received`, aggregate, repeat."""
from __future__ import annotations

import logging

from fedcore.runtime import admission, parking
from fedcore.algorithms.spill import spill_in_simulation
from fedcore.algorithms.streaming import FoldingBuffer, fold_when_sent, round_buffer
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.handlers import evaluation, join, rounds, training
from fedcore.kernel.registry import components, courses
from fedcore.kernel.schema import clients_per_round

log = logging.getLogger("fedcore.course")

__all__ = ["start_round", "collect_update", "aggregate_and_move_on", "install"]


def start_round(server, _event=None) -> None:
    """`all_joined_in` (and after each aggregation): sample clients and send them the model.

    An empty sample's round aggregates at once, and its aggregation starts the next round:
    from inside this call, which then only asks for it, and the round is started here once
    this one has returned. So a run of empty samples (a Poisson rate far below one client
    per round) takes turns in a loop instead of nesting one call per round."""
    if server.starting_round:
        server.next_round_asked = True
        return
    server.starting_round = True
    try:
        server.next_round_asked = True
        while server.next_round_asked:
            server.next_round_asked = False
            _start_one_round(server)
    finally:
        server.starting_round = False


def _start_one_round(server) -> None:
    k = clients_per_round(server.course.cfg)
    candidates = server.course.client_ids
    server.selected = set(server.sampler.sample(k, candidates))
    server.buffer = round_buffer(server)   # a list, or a running sum that folds each update
    if isinstance(server.buffer, FoldingBuffer):
        parking.park_global(server)   # deployed: idle in a file until the round's end
    server.send("models", sorted(server.selected), server.aggregator.broadcast(server.round))
    if not server.selected and candidates:   # an empty sample (Poisson): the round aggregates nothing now
        server.trigger("all_received")
    elif not candidates:   # no client to ask (deployed: every one gone or benched for a missed deadline):
        # the round waits, `round_check` starts it again once one is back; aggregating nothing
        # here would run the course's rounds empty, one inside the other
        log.warning("round %d: no client to sample (each has gone or missed a deadline); waiting for one",
                    server.round)


def collect_update(server, msg) -> None:
    """`receiving_updates`: keep this round's updates; raise `all_received` when complete."""
    if server.finished or msg.round != server.round or msg.sender not in server.selected:
        admission.note(server, "update for another round or from a client not waited for",
                       f"round {server.round}: dropped an update from client {msg.sender} for round "
                       f"{msg.round}", logging.INFO)
        return
    server.selected.discard(msg.sender)
    server.buffer.append(ReceivedUpdate(msg.sender, msg.content, msg.round, 0))
    if msg.owned and isinstance(server.buffer, FoldingBuffer):
        # folded: the received copy is let go now, not after the aggregation this may trigger
        for key in server.buffer.keys:
            msg.content.pop(key, None)
    if not server.selected:
        server.trigger("all_received")


def aggregate_and_move_on(server, _event=None) -> None:
    """`all_received`: aggregate, evaluate, then finish or start the next round."""
    if rounds.aggregate(server, server.buffer):
        start_round(server)


@courses.register("sync")
def install(course) -> None:
    if course.cfg["topology.edges"]:   # a tree of edge aggregators: HierFAVG's rounds (edge.py)
        components.get("edge").install(course)
        return
    join.install(course)
    training.install(course)
    evaluation.install(course)
    rounds.install(course)
    s = course.server_table
    s.register("all_joined_in", start_round, sends=("models", "all_received"))
    s.register("receiving_updates", collect_update, sends=("all_received",))
    s.register("all_received", aggregate_and_move_on,
               sends=("models", "all_received", "eval_request", "max_rounds_reached", "early_stop"))
    taps = getattr(getattr(course, "comm", None), "taps", None)
    if taps is not None:   # a simulation: a folding round folds each update as it is sent
        taps.append(fold_when_sent(course.server, collect_update))
        spill_in_simulation(course.server)   # and keeps large models in files meanwhile
