"""FedAvg, FedAsync and SCAFFOLD whose clients pause before training, and a server that
pauses at a chosen moment, so fault tests can act mid-round.

Loaded by deployment tests through `plugins: [tests.slow_plugin]`; every pause is a
sleep, so a slow round costs no CPU. Nothing here changes what is computed.

`<name>_pausing` is algorithm `<name>` with `Pausing` before its trainer; its updates
are `<name>`'s (the server checks them against `<name>`'s layout, without which it would
refuse every SCAFFOLD update for lacking a `model` map).

The server's pause is set by the environment of that one process, so that a server
started again with the same config does not pause again:
`FEDCORE_TEST_PAUSE_SERVER=MOMENT:ROUND:SECONDS`, MOMENT one of
- `aggregation`: the aggregator of round ROUND sleeps before it aggregates (every update
  of the round is in, nothing of its aggregation is on disk);
- `broadcast`: round ROUND's models reach the first client sampled, and the server sleeps
  before it sends them to the others.
It says `fedcore: test pause ...` on stdout when it starts sleeping.

`slow_test.resume_delay` makes a server resumed from a snapshot (`resume_from`, as a launcher
restarts it) sleep that many seconds while its course is built, before it listens: a restart
that takes at least that long, however fast its process starts (a fork server's takes
milliseconds).

`FEDCORE_TEST_UPDATE_LOG=<file>` makes a process log the updates it handles, one JSON
line each, with a digest of the update's content: a client each update it sends
(`client`, `digest`), a server each update it aggregates (`round`, `client`, `digest`),
so a test can follow every update from the client that sent it into the rounds that
counted it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import time

import torch

from fedcore.algorithms.fedavg import FedAvgAggregator, FedAvgTrainer
from fedcore.kernel.config import declare
from fedcore.kernel.contract import Algorithm
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.registry import algorithms, behaviours

declare("slow_test.pause", float, 0.3, "tests: seconds a client sleeps before each local training")
declare("slow_test.hang_clients", list, None, "tests: clients whose training never returns (their "
        "heartbeats go on: a hung trainer)")
declare("slow_test.stall_clients", list, None, "tests: clients that take slow_test.stall seconds to "
        "train in their first slow_test.stall_rounds rounds, then hang (heartbeats on)")
declare("slow_test.inflate_clients", list, None, "tests: clients whose updates claim ten times the "
        "samples they declared when they joined (admission refuses them)")
declare("slow_test.hang_eval_clients", list, None, "tests: clients whose evaluation never returns "
        "(their heartbeats go on: a trainer hung in its evaluation)")
declare("slow_test.stall", float, 0.0, "tests: seconds a stalling client takes (just under its deadline)")
declare("slow_test.stall_rounds", int, 0, "tests: rounds a stalling client replies in before it hangs")
declare("slow_test.resume_delay", float, 0.0, "tests: seconds a server resumed from a snapshot "
        "sleeps before it listens")
declare("slow_test.stall_once_in_round", int, 0, "tests: if set, stalling clients stall only the first "
        "time they train this round (once more, after a server restart, it goes at once) and never hang")


class Pausing:
    """Put before a trainer class: its fit pauses, stalls or hangs as the config says."""

    def fit(self, client_id, data, received, round_):
        time.sleep(self.cfg["slow_test.pause"])
        once = self.cfg["slow_test.stall_once_in_round"]
        if client_id in (self.cfg["slow_test.stall_clients"] or ()):
            if not once:
                time.sleep(self.cfg["slow_test.stall"])
                while round_ > self.cfg["slow_test.stall_rounds"]:
                    time.sleep(60)
            elif round_ == once and not getattr(self, "stalled_once", False):
                self.stalled_once = True
                time.sleep(self.cfg["slow_test.stall"])
        while client_id in (self.cfg["slow_test.hang_clients"] or ()):
            time.sleep(60)
        result = super().fit(client_id, data, received, round_)
        if client_id in (self.cfg["slow_test.inflate_clients"] or ()):
            result.content = {**result.content, "num_samples": 10 * result.content["num_samples"]}
        return result

    def evaluate(self, client_id, data, received):
        while client_id in (self.cfg["slow_test.hang_eval_clients"] or ()):
            time.sleep(60)
        return super().evaluate(client_id, data, received)


class PausingTrainer(Pausing, FedAvgTrainer):
    pass


algorithms.register("fedavg_pausing", Algorithm(PausingTrainer, FedAvgAggregator))


from fedcore.algorithms.fedasync import FedAsyncAggregator  # noqa: E402

algorithms.register("fedasync_pausing", Algorithm(PausingTrainer, FedAsyncAggregator))


def _register_pausing(name: str) -> None:
    """`<name>_pausing`: `name`'s trainer with `Pausing` before it, `name`'s aggregator and
    update layout."""
    importlib.import_module(f"fedcore.algorithms.{name}")   # registers it, whatever was loaded before
    base = algorithms.get(name)
    trainer = type(f"Pausing{base.trainer.__name__}", (Pausing, base.trainer), {})
    algorithms.register(f"{name}_pausing", Algorithm(trainer, base.aggregator,
                                                     update_layout=base.update_layout))


_register_pausing("scaffold")


# ---------------------------------------------------------------- the server's pause

SERVER_PAUSE_ENV = "FEDCORE_TEST_PAUSE_SERVER"


def _server_pause() -> tuple[str, int, float]:
    moment, round_, seconds = os.environ[SERVER_PAUSE_ENV].split(":")
    return moment, int(round_), float(seconds)


def _pause(what: str, seconds: float) -> None:
    print(f"fedcore: test pause {what}", flush=True)
    time.sleep(seconds)


def install_resume_delay(course) -> None:
    if course.server is not None and course.cfg["resume_from"]:
        _pause(f"before the resumed server listens ({course.cfg['slow_test.resume_delay']:g} s)",
               course.cfg["slow_test.resume_delay"])


install_resume_delay.enabled = lambda cfg: cfg["slow_test.resume_delay"] > 0
behaviours.register("slow_test_resume_delay", install_resume_delay)


def install_server_pause(course) -> None:
    """Wrap the server's aggregation or its sending of models (see the module's docstring)."""
    server = course.server
    if server is None:
        return
    moment, pause_round, seconds = _server_pause()
    if moment == "aggregation":
        def pausing_aggregate(aggregate, updates, round_):
            if round_ == pause_round:
                _pause(f"in the aggregation of round {round_}", seconds)
            return aggregate(updates, round_)
        server.aggregator.wrap(Wrapper("slow_test_server_pause", "aggregate", pausing_aggregate))
    elif moment == "broadcast":
        send = course.comm.send

        def pausing_send(msg):
            if msg.msg_type != "models" or msg.round != pause_round or len(msg.receivers) < 2:
                return send(msg)
            first, *rest = msg.receivers
            send(dataclasses.replace(msg, receivers=(first,)))
            _pause(f"while broadcasting round {msg.round}: sent to client {first} only", seconds)
            return send(dataclasses.replace(msg, receivers=tuple(rest)))
        course.comm.send = pausing_send
    else:
        raise ValueError(f"{SERVER_PAUSE_ENV}: unknown moment '{moment}' (aggregation or broadcast)")


install_server_pause.enabled = lambda cfg: bool(os.environ.get(SERVER_PAUSE_ENV))
behaviours.register("slow_test_server_pause", install_server_pause)



# ---------------------------------------------------------------- the updates' log

UPDATE_LOG_ENV = "FEDCORE_TEST_UPDATE_LOG"


def digest(content) -> str:
    """A digest of an update's content (tensors by their bytes, in key order)."""
    h = hashlib.sha256()

    def walk(value):
        if isinstance(value, dict):
            for key in sorted(value):
                h.update(str(key).encode())
                walk(value[key])
        elif isinstance(value, torch.Tensor):
            h.update(value.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(repr(value).encode())
    walk(content)
    return h.hexdigest()[:24]


def _log_updates(entries) -> None:
    with open(os.environ[UPDATE_LOG_ENV], "a") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in entries)


def install_update_log(course) -> None:
    """Log what a client sends (its comm's send) or what a server aggregates (the updates
    its checkpointer is told of after each aggregation)."""
    if course.server is not None:
        after = course.checkpointer.after_aggregation

        def logged_after(server, updates=()):
            _log_updates({"round": server.round, "client": u.client_id, "digest": digest(u.content)}
                         for u in updates)
            return after(server, updates)
        course.checkpointer.after_aggregation = logged_after
    else:
        send = course.comm.send

        def logged_send(msg):
            if msg.msg_type == "updates":
                _log_updates([{"client": msg.sender, "digest": digest(msg.content)}])
            return send(msg)
        course.comm.send = logged_send


install_update_log.enabled = lambda cfg: bool(os.environ.get(UPDATE_LOG_ENV))
behaviours.register("slow_test_update_log", install_update_log)
