"""An attacker that steers centered clipping: the project's own client with the update it
sends changed (loaded by tests through `plugins: [tests.drift_adversary_plugin]`).

Client `drift_test.bad_client` trains as every client does; in place of its delta it sends
`center + drift_test.reach * tau * e`, e a unit vector drawn once from the seed, tau =
`aggregator.cc_tau`, so that it lies just inside the clipping radius around its estimate of
the round's center:
- `drift_test.track: last` — the last combined delta (the model it receives minus the one it
  received the round before: what FedAvg applied), the center of the paper's rule;
- `drift_test.track: own` — its own honest delta, the best estimate it has of a center that
  is a robust statistic of this round's updates.
Its honest delta is kept (`course.drift_test_honest[round]`) for the tests.
"""
from __future__ import annotations

import torch

from fedcore.algorithms.attacks import fixed_direction
from fedcore.algorithms.combine import float_names
from fedcore.kernel.config import declare
from fedcore.kernel.registry import behaviours

declare("drift_test.bad_client", int, 0, "tests: the client that steers the center (0: none)")
declare("drift_test.track", str, "last", "tests: the center it tracks", choices=("last", "own"))
declare("drift_test.reach", float, 0.99, "tests: how far past its center it sends, in units of tau")


def _steer(client, content: dict, received: dict, round_: int) -> dict:
    course, cfg = client.course, client.course.cfg
    ref, model = received["model"], content["model"]
    names = float_names(ref)
    honest = {n: model[n].to(torch.float64) - ref[n].to(torch.float64) for n in names}
    course.drift_test_honest[round_] = honest
    if course.drift_test_direction is None:
        course.drift_test_direction = fixed_direction(ref, torch.Generator().manual_seed(cfg["seed"] + 424242))
    last = course.drift_test_last
    if cfg["drift_test.track"] == "own":
        center = honest
    elif last is None:
        center = {n: torch.zeros_like(honest[n]) for n in names}
    else:
        center = {n: ref[n].to(torch.float64) - last[n].to(torch.float64) for n in names}
    course.drift_test_last = {n: ref[n].clone() for n in names}
    push = cfg["drift_test.reach"] * cfg["aggregator.cc_tau"]
    sent = dict(model)
    for n in names:
        sent[n] = (ref[n].to(torch.float64) + center[n] + push * course.drift_test_direction[n]).to(model[n].dtype)
    return dict(content, model=sent)


def install(course) -> None:
    bad_id = course.cfg["drift_test.bad_client"]
    course.drift_test_honest, course.drift_test_direction, course.drift_test_last = {}, None, None
    reg = course.client_table.get("receiving_models")

    def stage(client, msg):
        if client.id != bad_id:
            return reg.fn(client, msg)
        send = client.send

        def steered(msg_type, receiver, content, round_=None, **kw):
            if msg_type == "updates":
                content = _steer(client, content, msg.content, msg.round)
            return send(msg_type, receiver, content, round_=round_, **kw)
        client.send = steered
        try:
            reg.fn(client, msg)
        finally:
            client.send = send
    course.client_table.register("receiving_models", stage, sends=reg.sends)


install.enabled = lambda cfg: cfg["drift_test.bad_client"] != 0
behaviours.register("drift_adversary", install)
