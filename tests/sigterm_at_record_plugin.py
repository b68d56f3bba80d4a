"""A deployed server that gets SIGTERM while it writes a chosen round's record: between the
record and the state a snapshot would hold of that round, the moment an interrupt must not
split (handlers/rounds.py defers it).

Loaded by deployment tests through `plugins: [tests.sigterm_at_record_plugin]` with
`sigterm_test.round: N`: the project's server with one callback added, which sends SIGTERM to
its own process as round N's record is written.
"""
from __future__ import annotations

import os
import signal

from fedcore.kernel.config import declare
from fedcore.kernel.registry import behaviours
from fedcore.runtime.monitor import Callback

declare("sigterm_test.round", int, 0, "tests: the server sends itself SIGTERM at this round's record")


class SigtermAtRecord(Callback):
    def __init__(self, round_: int):
        self.round = round_

    def on_record(self, record) -> None:
        if record.get("round") == self.round:
            os.kill(os.getpid(), signal.SIGTERM)


def install(course) -> None:
    if course.server is not None:
        course.monitor.callbacks.append(SigtermAtRecord(course.cfg["sigterm_test.round"]))


install.enabled = lambda cfg: cfg["sigterm_test.round"] > 0
behaviours.register("sigterm_at_record", install)
