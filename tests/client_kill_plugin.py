"""SCAFFOLD whose clients can be held before training and can say when an update left them,
so that a test can kill a client between two of its rounds at a moment it chooses.

Loaded through `plugins: [tests.client_kill_plugin]`. `kill_test.hold_clients` wait, before
training round `kill_test.hold_round`, until the file `<kill_test.folder>/go` exists (at most
`kill_test.hold_max` seconds: their heartbeats flow meanwhile); `kill_test.mark_clients`
write `<kill_test.folder>/sent_<id>_<round>` (holding their pid, so that a test finds the
process whatever started it) once their update of `kill_test.mark_round` has been handed to
the connection. Neither changes what is computed.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from fedcore.algorithms.scaffold import ScaffoldAggregator, ScaffoldTrainer, update_layout
from fedcore.kernel.config import declare
from fedcore.kernel.contract import Algorithm
from fedcore.handlers.training import train_and_reply
from fedcore.kernel.registry import algorithms, behaviours

declare("kill_test.folder", str, None, "tests: folder of the go and sent_* files")
declare("kill_test.hold_clients", list, [], "tests: clients that wait for <folder>/go")
declare("kill_test.hold_round", int, 0, "tests: the round before which they wait")
declare("kill_test.hold_max", float, 120.0, "tests: the longest they wait")
declare("kill_test.mark_clients", list, [], "tests: clients that write <folder>/sent_<id>_<round>")
declare("kill_test.mark_round", int, 0, "tests: the round whose update they mark")


class HeldScaffoldTrainer(ScaffoldTrainer):
    def fit(self, client_id, data, received, round_):
        cfg = self.cfg
        if client_id in cfg["kill_test.hold_clients"] and round_ == cfg["kill_test.hold_round"]:
            go, deadline = Path(cfg["kill_test.folder"]) / "go", time.monotonic() + cfg["kill_test.hold_max"]
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().fit(client_id, data, received, round_)


# its updates are SCAFFOLD's
algorithms.register("scaffold_held", Algorithm(HeldScaffoldTrainer, ScaffoldAggregator,
                                              update_layout=update_layout))


def _train_and_mark(client, msg) -> None:
    train_and_reply(client, msg)
    cfg = client.course.cfg
    if client.id in cfg["kill_test.mark_clients"] and msg.round == cfg["kill_test.mark_round"]:
        client.course.comm.outbox.wait_empty(10.0)
        (Path(cfg["kill_test.folder"]) / f"sent_{client.id}_{msg.round}").write_text(str(os.getpid()))


def install(course) -> None:
    if course.trainer is not None:   # a client
        course.client_table.register("receiving_models", _train_and_mark, sends=("updates",))


install.enabled = lambda cfg: bool(cfg["kill_test.mark_clients"])
behaviours.register("kill_test_marks", install)
