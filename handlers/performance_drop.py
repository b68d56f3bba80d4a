"""A client-side condition event: `performance_drop`.

When a client receives a global model, it first compares it on its local
validation split with its own model (the one it ended its last round with, or
its Ditto personal model). If the global model is worse by more than
`personalization.drop_margin` (accuracy; loss for mse), the client raises
`performance_drop`. The default handler marks the client for
personalization (`personalization.finetune_on: performance_drop` then
fine-tunes only those clients) and counts the drops in the summary.

The check runs around the trainer, inside the clients' unchanged
`receiving_models` handler, whose declared sends are extended by the event so
that the completeness graph shows the edge.
"""
from __future__ import annotations

import torch

from fedcore.kernel import registry
from fedcore.kernel.contract import evaluate_model
from fedcore.handlers.derived_role import DerivedTable
from fedcore.kernel.hooks import Wrapper

__all__ = ["global_is_worse", "note_performance_drop", "install"]


def _score(result: dict) -> float:
    return result["acc"] if "acc" in result else -result["loss"]


def global_is_worse(trainer, client_id: int, data, received: dict, margin: float) -> dict | None:
    """The two validation results when the received model is worse than the client's own."""
    state = trainer.store.load(client_id)
    own = state.get("ditto_model") or state.get("own_model")
    if own is None or not len(data.val):
        return None
    bs = trainer.cfg["eval.batch_size"]
    trainer.load_global(received["model"], state)
    glob = evaluate_model(trainer.model, data.val.x, data.val.y, trainer.loss, bs)
    with torch.no_grad():
        for name, t in own.items():
            trainer.entries[name].copy_(t)
    with_own = evaluate_model(trainer.model, data.val.x, data.val.y, trainer.loss, bs)
    if _score(glob) + margin < _score(with_own):
        return {"global": glob, "own": with_own}
    return None


def note_performance_drop(client, info) -> None:
    """`performance_drop`: mark this client for personalization; count the drop."""
    store = client.course.trainer.store
    state = store.load(client.id)
    state["personalize"] = True
    state["performance_drops"] = state.get("performance_drops", 0) + 1
    store.save(client.id, state)
    client.course.monitor.tally("personalization", "performance_drops")


def install(course) -> None:
    """Behaviour: clients check each received model and raise `performance_drop`."""
    trainer, margin = course.trainer, course.cfg["personalization.drop_margin"]

    def checked_fit(fit, client_id, data, received, round_):
        info = global_is_worse(trainer, client_id, data, received, margin)
        if info is not None:
            course.clients[client_id].trigger("performance_drop", dict(info, round=round_))
        result = fit(client_id, data, received, round_)
        state = trainer.store.load(client_id)
        if "ditto_model" not in state:
            state["own_model"] = {k: v.detach().clone() for k, v in trainer.entries.items()}
            trainer.store.save(client_id, state)
        return result
    if trainer is not None:  # None: a deployed server
        # it raises an event on the course's client and keeps the trained model: it needs
        # the trainer as the plain fit left it, in this process
        trainer.wrap(Wrapper("performance_drop", "fit", checked_fit))
    course.client_table.register("performance_drop", note_performance_drop)
    for table in course.tables:  # clients, and roles derived from them that train their own way
        if table is course.server_table or (isinstance(table, DerivedTable)
                                            and "receiving_models" not in table.own):
            continue
        train = table.get("receiving_models")
        if train is not None and "performance_drop" not in train.sends:
            # the same handler, declared to raise the event it now can raise: not a replacement
            table.register("receiving_models", train.fn, sends=(*train.sends, "performance_drop"))


install.enabled = lambda cfg: (cfg["personalization.drop_check"]
                               or cfg["personalization.finetune_on"] == "performance_drop")
registry.behaviours.register("performance_drop", install)
