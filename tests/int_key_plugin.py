"""A trainer whose per-client record has int keys: fine in memory, but it cannot be serialized.

Loaded through `plugins: [tests.int_key_plugin]`, so the processes executor's workers, which
build the course from its config, know the algorithm too.
"""
from fedcore.kernel.contract import Aggregator, Algorithm, Trainer
from fedcore.kernel.registry import algorithms


class IntKeyState(Trainer):
    def begin(self, client_state, received):
        client_state["seen"] = {1: client_state.get("seen", {}).get(1, 0) + 1}


algorithms.register("_test_intkeys", Algorithm(IntKeyState, Aggregator))
