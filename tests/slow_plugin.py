"""FedAvg and FedAsync whose clients pause before training, so fault tests can act mid-round.

Loaded by deployment tests through `plugins: [tests.slow_plugin]`; the pause
is a sleep, so a slow round costs no CPU.
"""
from __future__ import annotations

import time

from fedcore.contract import Algorithm
from fedcore.algorithms.fedavg import FedAvgAggregator, FedAvgTrainer
from fedcore.config import declare
from fedcore.registry import algorithms

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


class Pausing:
    """Put before a trainer class: its fit pauses, stalls or hangs as the config says."""

    def fit(self, client_id, data, received, round_):
        time.sleep(self.cfg["slow_test.pause"])
        if client_id in (self.cfg["slow_test.stall_clients"] or ()):
            time.sleep(self.cfg["slow_test.stall"])
            while round_ > self.cfg["slow_test.stall_rounds"]:
                time.sleep(60)
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
