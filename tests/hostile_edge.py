"""A hostile edge aggregator: the project's own edge (handlers/edge.py) with two stages changed.

It holds a valid token for the cloud and nothing else. Its join: it joins the cloud at once,
without waiting for any client, declaring `declared` samples (an honest edge joins once its
clients are in, declaring what they declared). Its reply to a cloud model: at once, without
any client's work, `poison(model)` claiming `claimed` samples. Everything else (the wire, the
token, the process, the finish) is the edge's own.

In simulation a test swaps an edge's table for `hostile_table(...)`; deployed,
`python -m tests.hostile_edge --cfg X KEY=VALUE ...` (an edge process's overrides) runs an
edge process with these stages: 10^9 samples declared and claimed, and the class biases
moved +5 (class 0) / -5 (the others) each round, the poisoning an accuracy drop shows.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from fedcore.kernel.message import SERVER_ID
from fedcore.kernel.worker import HandlerTable

DECLARED = 10 ** 9
SHIFT = 5.0


def bias_poison(model: dict) -> dict:
    """The global model with every bias moved +SHIFT for class 0 and -SHIFT for the others."""
    out = dict(model)
    for name, t in model.items():
        if name.endswith("bias") and t.is_floating_point():
            shift = torch.full_like(t, -SHIFT)
            shift[0] = SHIFT
            out[name] = t + shift
    return out


def hostile_table(declared: int, claimed: int, poison: Callable[[dict], dict]) -> HandlerTable:
    """An edge's handler table (`install_edge`) with its join and its reply to the cloud replaced."""
    from fedcore.handlers.edge import install_edge
    table = HandlerTable("edge")
    install_edge(table)

    def join_at_once(edge, _msg=None) -> None:
        if not edge.started:
            edge.started = True
            edge.send("join_in", SERVER_ID, {"client_id": edge.id, "num_samples": declared})

    def answer_with_poison(edge, msg) -> None:
        edge.cloud_round = msg.round
        edge.send("updates", SERVER_ID, {"model": poison(msg.content["model"]), "num_samples": claimed},
                  round_=msg.round)

    table.register("receiving_join_in", join_at_once, sends=("join_in",))
    table.register("receiving_models", answer_with_poison, sends=("updates",))
    return table


def main(argv: list[str] | None = None) -> int:
    from fedcore.deployment.distributed import deployed_process
    from fedcore.deployment.edge_process import EdgeCourse
    from fedcore.kernel.config import load_config
    from fedcore.kernel.scheduler import PRIORITY_TIMER
    p = argparse.ArgumentParser()
    p.add_argument("--cfg", required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config([args.cfg], args.overrides)
    deployed_process()
    course = EdgeCourse(cfg, cfg["outdir"]).build()
    table = hostile_table(DECLARED, DECLARED, bias_poison)
    for event in ("client_lost", "round_check", "all_joined_in"):   # the edge process's own
        table.entries[event] = course.edge.handlers.entries[event]
    course.edge.handlers = table
    join = table.entries["receiving_join_in"].fn   # called at the start: no client ever dials it
    course.scheduler.schedule(0.0, PRIORITY_TIMER, lambda: join(course.edge))
    return course.run()


if __name__ == "__main__":
    sys.exit(main())
