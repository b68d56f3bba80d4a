"""A curious deployed server: it keeps every update it receives, with the model it sent.

Loaded by deployment tests through `plugins: [tests.dp_spy_plugin]` with `dp_test.spy: true`:
the project's own server with one stage changed (its `receiving_updates` handler first
saves `{"sent": global model, "received": the client's model}` to
`<outdir>/dp_spy/r<round>_c<client>.pt`, then runs as before), so a test can try to
strip the clients' local DP noise as such a server would. The model the course starts from is
kept in `<outdir>/dp_spy/initial.pt`, as a round may sample no client at all.
"""
from __future__ import annotations

import torch

from fedcore.kernel.config import declare
from fedcore.kernel.registry import behaviours

declare("dp_test.spy", bool, False, "tests: the server saves every update it receives")


def install(course) -> None:
    if course.server is None:
        return
    reg = course.server_table.get("receiving_updates")
    folder = course.outdir / "dp_spy"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.clone() for k, v in course.server.aggregator.global_state.items()},
               folder / "initial.pt")

    def keep_then_collect(server, msg):
        sent = {k: v.clone() for k, v in server.aggregator.global_state.items()}
        torch.save({"sent": sent, "received": dict(msg.content["model"])},
                   folder / f"r{msg.round}_c{msg.sender}.pt")
        reg.fn(server, msg)
    course.server_table.register("receiving_updates", keep_then_collect, sends=reg.sends)


install.enabled = lambda cfg: cfg["dp_test.spy"]
behaviours.register("dp_spy", install)
