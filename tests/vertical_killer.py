"""A passive SplitNN party that SIGKILLs its own process once, at a chosen step: the project's own
bottom model with one stage added. `FEDCORE_TEST_KILL_PARTY=PARTY:STEP:MARKER` kills party PARTY
when it has stepped STEP and the file MARKER does not exist yet (it is created first, so the
restarted process goes on). Loaded through `plugins: [tests.vertical_killer]`
(tests/test_deploy_vertical_durability.py)."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from fedcore.algorithms.splitnn import BottomParty
from fedcore.kernel.registry import components

ENV = "FEDCORE_TEST_KILL_PARTY"


class DyingBottom(BottomParty):
    steps = 0

    def backward(self, grad) -> None:
        super().backward(grad)
        self.steps += 1
        party, step, marker = (os.environ.get(ENV, "") + "::").split(":")[:3]
        if party and int(party) == self.party and self.steps == int(step) and not Path(marker).exists():
            Path(marker).write_text("")
            print(f"test: party {self.party} kills itself after step {self.steps}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


components.register("splitnn_bottom", DyingBottom)
