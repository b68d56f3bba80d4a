"""What a server does around an aggregation, whatever condition triggered it.

`aggregate` turns the buffered updates into the next global model, evaluates,
opens the round's record, then raises `max_rounds_reached` or `early_stop`, or
tells the strategy to start the next round. `resume_course` continues a course
restored from a checkpoint.
"""
from __future__ import annotations

from contextlib import nullcontext

from fedcore.runtime import admission
from fedcore.algorithms.streaming import FoldingBuffer
from fedcore.kernel.config import declare, positive
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.runtime.snapshot import interrupts_deferred
from fedcore.handlers.evaluation import evaluate_global, request_client_evaluation

__all__ = ["aggregate", "finish_course", "note_finish", "stop_diverged", "is_eval_round", "resume_course", "install"]

declare("federate.time_limit", float, None, "finish at the first aggregation at or after this "
        "time (seconds of the course's clock: virtual in simulation); null: rounds only",
        check=positive)


def _out_of_time(server) -> bool:
    limit = server.course.cfg["federate.time_limit"]
    return limit is not None and server.now >= limit


def is_eval_round(server) -> bool:
    cfg = server.course.cfg
    return (server.round % cfg["eval.freq"] == 0 or server.round >= cfg["federate.total_round_num"]
            or _out_of_time(server))


def aggregate(server, updates: list[ReceivedUpdate], extra: dict | None = None) -> bool:
    """Aggregate `updates` (in client-id order, so arrival order cannot matter), evaluate,
    record the round and advance it. Returns True when the course should go on.

    The admission layer refuses updates first, and a non-finite aggregate is not adopted:
    the round is rejected with the previous model kept (and run again, in deployment)."""
    course = server.course
    folded = isinstance(updates, FoldingBuffer)
    if folded:   # admitted and folded one by one as they arrived
        received, admitted = updates.received, updates.admitted
        combined = [updates.combined()] if admitted else []
    else:
        received = sorted(updates, key=lambda u: (u.client_id, u.round))
        admitted = combined = admission.admit_updates(server, received)
    if len(admitted) < len(received) and hasattr(course, "updates_refused"):   # deployment: tell them
        course.updates_refused(received, admitted)
    if received and not admitted:
        return _rejected(server, "every update of the round was refused")
    # a folding round's aggregator replaces the global tensors (streaming.folds): no copy of them
    snapshot = admission.Snapshot(server.aggregator, copy=not folded)
    fields = {"num_updates": len(admitted)}
    # a round with nothing to aggregate (a skipped secure round) keeps the model, unless the
    # aggregator releases something each round (central DP's noise, whoever took part)
    if admitted or getattr(server.aggregator, "releases_empty_rounds", False):
        fields.update(server.aggregator.aggregate(combined, server.round) or {})
        if not admission.finite_state(server.aggregator.global_state):
            snapshot.restore()
            return _rejected(server, "the aggregated model has non-finite values")
    snapshot = combined = None   # the previous model and the round's mean are let go before evaluating
    server.state(admission.AdmissionState).rejected_in_a_row = 0
    fields.update(extra or {})
    expected = 0
    if is_eval_round(server):
        fields.update(evaluate_global(server))
        if course.cfg["eval.clients"]:
            expected = request_client_evaluation(server)
    # deployed, where SIGTERM or Ctrl-C interrupts at once: the round's record and the state a
    # snapshot would hold of it, both or neither, so an interrupted server's "stopped after
    # round N" is the round its snapshot resumes from (a simulation stops at a round's end)
    with interrupts_deferred() if course.wall_clock else nullcontext():
        course.monitor.record_round(server.round, server.now, fields, expected)
        course.checkpointer.after_aggregation(server, admitted)   # whose updates it aggregated
    _track_best(server, fields.get("test_acc"))
    if server.round >= course.cfg["federate.total_round_num"] or _out_of_time(server):
        server.trigger("max_rounds_reached")
        return False
    patience = course.cfg["early_stop.patience"]
    if patience and server.evals_since_best >= patience:
        server.trigger("early_stop")
        return False
    server.round += 1
    return True


def _track_best(server, acc) -> None:
    if acc is None:
        return
    if server.best_acc is None or acc > server.best_acc:
        server.best_acc, server.evals_since_best = acc, 0
    else:
        server.evals_since_best += 1


def finish_course(server, _event) -> None:
    """`max_rounds_reached` / `early_stop`: tell every client the course is over."""
    note_finish(server)
    server.send("finish", server.course.client_ids, {})


def note_finish(server) -> None:
    """Mark the course finished and record why it stopped."""
    server.finished = True
    cfg = server.course.cfg
    server.course.monitor.add_summary("stop", {"stopped_by": (
        "max_rounds" if server.round >= cfg["federate.total_round_num"]
        else "time_limit" if _out_of_time(server) else "early_stop")})


def _rejected(server, why: str) -> bool:
    """A round not adopted: True to run it again, False when the course stopped as diverged."""
    if admission.reject_round(server, why):
        return True
    stop_diverged(server)
    return False


def stop_diverged(server, _event=None) -> None:
    """The global model could not stay finite: end the course with the last finite one."""
    finish_course(server, _event)
    server.course.monitor.add_summary("stop", {"stopped_by": "diverged"})


def resume_course(server, info: dict) -> None:
    """`resume`: re-send the restored round's evaluation requests, then start the next round."""
    if info.get("pending_eval"):
        request_client_evaluation(server)
    server.round += 1
    server.trigger("all_joined_in")


def install(course) -> None:
    course.server_table.register("resume", resume_course, sends=("eval_request", "all_joined_in"))
    course.server_table.register("max_rounds_reached", finish_course, sends=("finish",))
    course.server_table.register("early_stop", finish_course, sends=("finish",))
