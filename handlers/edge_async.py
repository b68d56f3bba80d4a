"""An asynchronous cloud over synchronous edges: FedAsync or FedBuff at the cloud, FedAvg at
the edges (`topology.cloud_aggregator`).

Each edge runs its kappa_2 synchronous edge rounds from the cloud model it was sent, exactly as
in HierFAVG, and sends its edge model up. The cloud does not wait for every edge: it buffers
edge updates as they arrive and, once `topology.cloud_buffer` (K) are in, aggregates them with
the rule, each with its staleness tau = (cloud round now) - (cloud round of the model the edge
started from), discounted by `asyn.staleness_discount`; it records that cloud round and sends
the new model to the edges it just heard from. The other edges keep working on older models,
so their updates arrive stale.

- FedAsync (Xie et al., 2019): w <- (1 - alpha s(tau)) w + alpha s(tau) w_l, edge by edge.
- FedBuff (Nguyen et al., 2022): an edge sends Delta_l = w_l - (the cloud model it started
  from), as a FedBuff client does; w <- w + eta_g (1/K) sum_l s(tau_l) Delta_l.
"""
from __future__ import annotations

import logging

from fedcore.runtime import admission

from fedcore.kernel import registry
from fedcore.algorithms.staleness import discount_function
from fedcore.kernel.contract import ReceivedUpdate
from fedcore.handlers import rounds

__all__ = ["CLOUD_RULES", "install_cloud", "edge_content", "contributing"]

CLOUD_RULES = ("sync", "fedasync", "fedbuff")


def edge_content(edge, model: dict) -> dict:
    """What an edge sends the cloud: its model, or (FedBuff at the cloud) its float entries'
    change from the cloud model it started from, the others as they are."""
    content = {"model": model, "num_samples": edge.update_weight()}
    if edge.course.cfg["topology.cloud_aggregator"] != "fedbuff":
        return content
    start = edge.cloud_model
    delta = {k: t - start[k] for k, t in model.items() if t.is_floating_point() and k in start}
    content["delta"] = delta
    content["model"] = {k: t for k, t in model.items() if k not in delta}
    return content


def contributing(updates: list[ReceivedUpdate]) -> list[ReceivedUpdate]:
    """The edge updates that carry some client's work: an edge that admitted no client's update in
    the cloud round sends num_samples 0 and is left out of the aggregation, not refused."""
    return [u for u in updates if not (isinstance(u.content, dict) and u.content.get("num_samples") == 0)]


def _send_to(server, edges: list[int]) -> None:
    server.selected.update(edges)
    server.send("models", edges, server.aggregator.broadcast(server.round))


def start(server, _event=None) -> None:
    """Cloud `all_joined_in`: every edge gets the current model."""
    server.buffer = []
    _send_to(server, sorted(server.course.topology.edges))


def collect(server, msg) -> None:
    """Cloud `receiving_updates`: buffer an edge's update with its staleness; K of them
    make a cloud round."""
    if server.finished or msg.sender not in server.selected:
        admission.note(server, "update from an edge not waited for",
                       f"round {server.round}: dropped an update from edge {msg.sender}", logging.INFO)
        return
    server.selected.discard(msg.sender)
    server.buffer.append(ReceivedUpdate(msg.sender, msg.content, msg.round, server.round - msg.round))
    if len(server.buffer) >= server.course.cfg["topology.cloud_buffer"]:
        server.trigger("goal_achieved")


def aggregate(server, _event=None) -> None:
    """Cloud `goal_achieved`: aggregate the buffered edge updates with the async rule, record the
    cloud round (with the updates' staleness), send the new model to the edges just heard from."""
    updates, server.buffer = server.buffer, []
    taus = [u.staleness for u in updates]
    extra = {**server.course.links.take_round(), "staleness_min": min(taus),
             "staleness_max": max(taus), "staleness_mean": sum(taus) / len(taus)}
    if rounds.aggregate(server, contributing(updates), extra):
        _send_to(server, sorted(u.client_id for u in updates))


def install_cloud(course) -> None:
    """The cloud's aggregator and handlers for `topology.cloud_aggregator: fedasync|fedbuff`."""
    cfg, server = course.cfg, course.server
    rule = registry.algorithms.get(cfg["topology.cloud_aggregator"])
    server.aggregator = rule.aggregator(server.model, cfg, len(course.topology.edges))
    server.aggregator.discount = discount_function(cfg)
    s = course.server_table
    s.register("all_joined_in", start, sends=("models",))
    s.register("receiving_updates", collect, sends=("goal_achieved",))
    s.register("goal_achieved", aggregate,
               sends=("models", "eval_request", "max_rounds_reached", "early_stop"))
