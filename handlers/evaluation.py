"""Evaluation: the global model on the server's test set, and on clients' own test splits."""
from __future__ import annotations

import torch

from fedcore.kernel.config import declare, validator
from fedcore.kernel.contract import evaluate_model
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.message import SERVER_ID

__all__ = ["evaluate_global", "load_global", "request_client_evaluation", "evaluate_and_reply", "collect_metrics",
           "install"]

declare("eval.val", bool, False, "also evaluate the global model on the union of the clients' "
        "validation splits (val_loss, val_acc in the records; simulation only: a deployed server "
        "holds no client data)")


@validator
def _check_val(cfg) -> None:
    if cfg["eval.val"] and (cfg["federate.mode"] == "distributed" or cfg.get("distribute.role")):
        raise ConfigError("eval.val: a deployed server holds no client validation data; set "
                          "eval.val=false (clients still report their own test metrics)")


def evaluate_global(server) -> dict[str, float]:
    """Test loss and accuracy of the current global model on the server's held-out set."""
    course = server.course
    test = course.data.server_test
    load_global(server)
    result = evaluate_model(server.model, test.x, test.y, course.cfg["train.loss"],
                            course.cfg["eval.batch_size"])
    metrics = {f"test_{k}": v for k, v in result.items() if k != "n"}
    if course.cfg["eval.val"]:
        val = _validation_split(course)
        result = evaluate_model(server.model, val[0], val[1], course.cfg["train.loss"],
                                course.cfg["eval.batch_size"])
        metrics.update({f"val_{k}": v for k, v in result.items() if k != "n"})
    return metrics


def load_global(server) -> None:
    """Put the global model into the server's module by making it view the global model's
    tensors, not hold a copy: one model less in the server's memory. Nothing writes through
    either side: aggregators replace the global tensors rather than write them, the server only
    evaluates in its module, and a simulation's trainer trains in a copy of its own (`make_trainer`)."""
    server.model.load_state_dict(server.aggregator.global_state, strict=False, assign=True)


def _validation_split(course) -> tuple[torch.Tensor, torch.Tensor]:
    """The clients' validation splits, concatenated once: scores on it are the sample-weighted
    mean of the clients' own validation scores, data no client trains on and the test set
    does not hold."""
    val = getattr(course, "_validation_split", None)
    if val is None:
        splits = [course.data.clients[c].val for c in sorted(course.data.clients)]
        val = (torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))
        course._validation_split = val
    return val


def request_client_evaluation(server) -> int:
    """Send the current model to every client for local evaluation; returns how many were asked."""
    ids = server.course.client_ids
    server.send("eval_request", ids, server.aggregator.evaluation_content(server.round))
    return len(ids)


def evaluate_and_reply(client, msg) -> None:
    """Client `receiving_eval_request`: evaluate the received model on the local test split."""
    metrics = client.course.trainer.evaluate(client.id, client.data, msg.content)
    client.send("metrics", SERVER_ID, metrics, round_=msg.round)


def collect_metrics(server, msg) -> None:
    """Server `receiving_metrics`: attach a client's evaluation to its round's record."""
    server.course.monitor.add_client_metrics(msg.round, msg.sender, msg.content or {})


def install(course) -> None:
    if course.server is not None:
        load_global(course.server)   # the module's own initial copy is let go before any round
    course.monitor.separate_types.update({"eval_request", "metrics"})
    course.client_table.register("receiving_eval_request", evaluate_and_reply, sends=("metrics",))
    course.server_table.register("receiving_metrics", collect_metrics)
