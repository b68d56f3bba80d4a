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


class PausingTrainer(FedAvgTrainer):
    def fit(self, client_id, data, received, round_):
        time.sleep(self.cfg["slow_test.pause"])
        while client_id in (self.cfg["slow_test.hang_clients"] or ()):
            time.sleep(60)
        return super().fit(client_id, data, received, round_)


algorithms.register("fedavg_pausing", Algorithm(PausingTrainer, FedAvgAggregator))


from fedcore.algorithms.fedasync import FedAsyncAggregator  # noqa: E402

algorithms.register("fedasync_pausing", Algorithm(PausingTrainer, FedAsyncAggregator))
