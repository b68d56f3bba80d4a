"""The analytics course (`task: analytics`): every client, every round, answers the server's
request with its sums; the server adds them and asks again until the quantiles are refined.

Round 1 asks for counts, exact sums, histograms (and min/max); each later round sends the
intervals the quantiles are refined in. The flow is the synchronous course's (join, a round
of `models` and `updates`, `all_received`, aggregate), with every client in every round: a
statistic of the union needs all of it. After the last round the server writes
`statistics.json` and summarises it in summary.json.
"""
from __future__ import annotations

import json
import logging

from fedcore.handlers import join, rounds, training
from fedcore.kernel.files import write_atomic
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.kernel.registry import courses

log = logging.getLogger("fedcore.analytics")

__all__ = ["ask", "collect_sums", "add_up", "settle", "install"]


def ask(server, _event=None) -> None:
    """`all_joined_in` (and after each round but the last): send every client the request."""
    server.selected = set(server.course.client_ids)
    server.buffer = []
    server.send("models", sorted(server.selected), server.aggregator.broadcast(server.round))


def collect_sums(server, msg) -> None:
    """`receiving_updates`: keep the round's sums; raise `all_received` when every client's is in."""
    if server.finished or msg.round != server.round or msg.sender not in server.selected:
        log.info("round %d: sums from client %d for round %d ignored", server.round, msg.sender, msg.round)
        return
    server.selected.discard(msg.sender)
    server.buffer.append(ReceivedUpdate(msg.sender, msg.content, msg.round, 0))
    if not server.selected:
        server.trigger("all_received")


def add_up(server, _event=None) -> None:
    """`all_received`: add the sums exactly, record the round; ask again or finish."""
    updates, server.buffer = server.buffer, []
    if settle(server, updates, {"num_updates": len(updates)}):
        ask(server)


def settle(server, updates: list[ReceivedUpdate], fields: dict) -> bool:
    """Aggregate the round's sums (each client's, or one already summed securely), record the
    round; True when another round follows, else the statistics are written and the course
    finishes."""
    course = server.course
    fields = {**fields, **server.aggregator.aggregate(updates, server.round)}
    course.monitor.record_round(server.round, server.now, fields)
    if server.round < course.cfg["federate.total_round_num"]:
        server.round += 1
        return True
    _write_statistics(server)
    server.trigger("max_rounds_reached")
    return False


def _write_statistics(server) -> None:
    agg, course = server.aggregator, server.course
    body = {"columns": [c.name for c in agg.plan.columns], "groups": list(agg.plan.groups),
            "rounds": agg.plan.rounds, "statistics": agg.statistics}
    if agg.multiplier is not None:
        body["dp"] = {**agg.privacy(), "sigmas": {str(r): s for r, s in sorted(agg.sigmas.items())}}
    if course.outdir is not None:
        write_atomic(course.outdir / "statistics.json", json.dumps(body, indent=2) + "\n")
    brief = {col: {g: {k: v for k, v in stats.items() if k != "histogram"} for g, stats in per.items()}
             for col, per in agg.statistics.items()}
    course.monitor.add_summary("analytics", {"analytics": brief, **agg.privacy()})


@courses.register("analytics")
def install(course) -> None:
    join.install(course)
    training.install(course)
    s = course.server_table
    s.register("max_rounds_reached", rounds.finish_course, sends=("finish",))
    s.register("all_joined_in", ask, sends=("models",))
    s.register("receiving_updates", collect_sums, sends=("all_received",))
    s.register("all_received", add_up, sends=("models", "max_rounds_reached"))
