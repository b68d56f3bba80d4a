"""A deployed client that SIGKILLs itself right after the share stage of secure aggregation.

Loaded by deployment tests through `plugins: [tests.secagg_kill_plugin]`: client
`secagg_test.kill_client` dies (no goodbye, no flush) on receiving its routed
shares in round `secagg_test.kill_round`, so its masks must be recovered.
Only a deployed client process installs it; in simulation it does nothing.
"""
from __future__ import annotations

import os
import signal

from fedcore.kernel.config import declare
from fedcore.kernel.registry import behaviours

declare("secagg_test.kill_client", int, 0, "tests: the client that kills itself after sharing (0: none)")
declare("secagg_test.kill_round", int, 1, "tests: the round in which it does")


def install(course) -> None:
    if course.server is not None or course.cfg["secagg_test.kill_client"] not in course.clients:
        return
    event = "receiving_secagg_routed_shares"
    reg = course.client_table.get(event)

    def die_after_sharing(client, msg):
        if msg.round == course.cfg["secagg_test.kill_round"]:
            os.kill(os.getpid(), signal.SIGKILL)
        reg.fn(client, msg)
    course.client_table.register(event, die_after_sharing, sends=reg.sends)


install.enabled = lambda cfg: cfg["secagg_test.kill_client"] > 0
behaviours.register("secagg_kill", install)
