"""Tiers of a course: which edge aggregator each client talks to, and the links between tiers.

A course with `topology.edges: E > 0` is a tree: the cloud server (id 0), E edge
aggregators (ids N+1 .. N+E, after the N clients) and the clients, each under one
edge. `Topology` holds that tree; `assign` builds it from the config (contiguous id
ranges, seeded random, or sorted by a field of the client's profile); `check` refuses
a tree with an unreachable client or an edge without clients. `TierLinks` is the
communicator's view of time and bytes per tier: a client-edge link is the client's
own device link (as a star's client-server link), an edge-cloud link has its own
latency and bandwidth (`topology.edge_link.*`), and bytes and link-seconds are
counted per tier.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from fedcore.kernel.config import validator
from fedcore.kernel.errors import ConfigError, IncompleteCourseError
from fedcore.kernel.message import SERVER_ID

__all__ = ["Topology", "assign", "check", "check_deployable_assignment", "client_cap", "edge_bounds",
           "tier_graph", "TierLinks", "TIERS", "ASSIGNMENTS"]

TIERS = ("client_edge", "edge_cloud")
ASSIGNMENTS = ("contiguous", "random", "by_label", "by_profile")


@validator
def _check_topology_keys(cfg) -> None:
    edges = cfg["topology.edges"]
    if not edges:
        return
    n = cfg["federate.client_num"]
    if edges > n:
        raise ConfigError(f"topology.edges: {edges} edges for {n} clients would leave an edge "
                          "without clients; use at most federate.client_num edges")
    if cfg["course"] != "sync":
        raise ConfigError(f"topology.edges: a hierarchical course runs HierFAVG's synchronous "
                          f"rounds; course={cfg['course']} is not supported with edges (use course=sync)")
    cloud = cfg["topology.cloud_aggregator"]
    if cloud != "sync":
        if cfg.get("distribute.role"):
            raise ConfigError(f"topology.cloud_aggregator: {cloud} at the cloud runs in simulation "
                              "only so far; deployed, use sync")
        plain_step = cfg["server_optimizer.type"] == "sgd" and cfg["server_optimizer.lr"] in (None, 1)
        if not plain_step or cfg["aggregator.robust_rule"] != "none":
            raise ConfigError(f"topology.cloud_aggregator: {cloud} is the cloud's rule; leave "
                              "server_optimizer.* (plain sgd) and aggregator.robust_rule unset")
        if cfg["topology.cloud_buffer"] > edges:
            raise ConfigError(f"topology.cloud_buffer: {cfg['topology.cloud_buffer']} edge updates "
                              f"per aggregation, but only {edges} edges")
    if cfg.get("distribute.role"):
        check_deployable_assignment(cfg)
    if cfg.get("distribute.role") and cfg["eval.clients"]:
        raise ConfigError("eval.clients: deployed, the clients of a hierarchical course talk only to "
                          "their edges, which do not relay evaluation; set eval.clients=false (the "
                          "cloud evaluates the global model on its test set)")
    if cfg.get("distribute.role") == "edge" and not n < cfg["distribute.edge_id"] <= n + edges:
        raise ConfigError(f"distribute.edge_id: an edge's id is one of {n + 1}..{n + edges} "
                          "(edges are numbered after the clients)")
    if cfg["executor"] != "sequential":
        raise ConfigError(f"topology.edges: executor={cfg['executor']} batches one server's "
                          "broadcast; with edges use executor=sequential")
    if cfg["resume_from"] or cfg["checkpoint.every"]:
        raise ConfigError("topology.edges: checkpoints do not hold the edges' state yet; unset "
                          "resume_from and checkpoint.every")
    if cfg["topology.assign"] == "by_profile" and not cfg["topology.profile_field"]:
        raise ConfigError("topology.assign: by_profile needs topology.profile_field (a device "
                          "profile field such as latency or compute_speed)")


@dataclass
class Topology:
    """The tree: edge id -> its clients (in id order), and each client's edge."""

    edges: dict[int, list[int]]
    parent: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.parent:
            self.parent = {c: e for e, members in self.edges.items() for c in members}

    def tier(self, sender: int, receiver: int) -> str | None:
        """The tier of the link a message between `sender` and `receiver` crosses; None for
        the cloud's evaluation requests to clients and their replies, which go past the edges."""
        if sender in self.edges or receiver in self.edges:
            return "edge_cloud" if SERVER_ID in (sender, receiver) else "client_edge"
        return None

    def is_upward(self, sender: int, receiver: int) -> bool:
        return self.parent.get(sender, SERVER_ID if sender in self.edges else None) == receiver

    def describe(self) -> dict[str, Any]:
        """The tree as written to the summary: edge id -> its client ids."""
        return {str(e): members for e, members in self.edges.items()}


def check_deployable_assignment(cfg) -> None:
    """Deployed (or launched), clients can only be placed by id: the other rules read data and
    device profiles that no one process holds."""
    if cfg["topology.assign"] not in ("contiguous", "random"):
        raise ConfigError(f"topology.assign: {cfg['topology.assign']} reads every client's data or "
                          "device profile, which no deployed process holds; deployed, use "
                          "contiguous or random")


def assign(cfg, client_ids: list[int], data=None, timing=None) -> Topology:
    """Place each client under one of `topology.edges` edges, as `topology.assign` says.

    contiguous: equal id ranges (clients 1..N/E under the first edge, ...); random: a seeded
    shuffle cut into equal ranges; by_label: clients sorted by the label most of their
    training samples carry, then cut (so each edge sees a few labels: non-IID by edge);
    by_profile: sorted by a device-profile field (`topology.profile_field`), then cut."""
    n_edges = cfg["topology.edges"]
    ids = sorted(client_ids)
    how = cfg["topology.assign"]
    if how == "random":
        rng = np.random.default_rng([cfg["seed"] % 2**32, 0x70B0])
        ids = [ids[i] for i in rng.permutation(len(ids))]
    elif how == "by_label":
        ids = sorted(ids, key=lambda c: (_majority_label(data.clients[c].train.y), c))
    elif how == "by_profile":
        name = cfg["topology.profile_field"]
        profile = timing.profile(ids[0])
        if not hasattr(profile, name):
            raise ConfigError(f"topology.profile_field: '{name}' is not a device profile field; "
                              "known: compute_speed, upload_bandwidth, download_bandwidth, latency, dropout")
        ids = sorted(ids, key=lambda c: (getattr(timing.profile(c), name), c))
    first = max(ids, default=0) + 1
    groups = np.array_split(np.array(ids, dtype=np.int64), n_edges)
    return Topology({first + i: sorted(int(c) for c in g) for i, g in enumerate(groups)})


def client_cap(cfg, children: list[int], sizes: dict[int, int]) -> int:
    """The most samples one client under an edge counts for: `admission.max_num_samples`, else the
    largest partition among the edge's clients in the course's own build of the data (what a
    deployed server assumes of its clients). An edge caps each client's declaration at this."""
    cap = cfg["admission.max_num_samples"]
    return cap if cap is not None else max((sizes.get(c, 0) for c in children), default=0)


def edge_bounds(topology: Topology, cfg, sizes: dict[int, int]) -> dict[int, int]:
    """The most samples each edge may declare at the cloud: the caps of the clients the topology
    assigns to it, summed. The cloud computes it from the config and its own build of the data,
    so an edge, which holds only its token, cannot raise it."""
    return {e: client_cap(cfg, members, sizes) * len(members) for e, members in topology.edges.items()}


def _majority_label(y) -> int:
    if len(y) == 0:
        return -1
    values, counts = np.unique(np.asarray(y).astype(np.int64), return_counts=True)
    return int(values[np.argmax(counts)])


def tier_graph(topology: Topology, client_ids: list[int]) -> nx.DiGraph:
    """The workers as a tree (cloud -> edges -> clients), each link labelled with its tier."""
    g = nx.DiGraph()
    g.add_node("tier:cloud", kind="cloud")
    for c in client_ids:
        g.add_node(f"tier:client:{c}", kind="client")
    for e, members in topology.edges.items():
        g.add_node(f"tier:edge:{e}", kind="edge")
        g.add_edge("tier:cloud", f"tier:edge:{e}", tier="edge_cloud")
        for c in members:
            g.add_edge(f"tier:edge:{e}", f"tier:client:{c}", tier="client_edge")
    return g


def check(topology: Topology, client_ids: list[int]) -> nx.DiGraph:
    """Refuse a tree with an edge without clients or a client no edge reaches; returns its graph."""
    empty = [e for e, members in topology.edges.items() if not members]
    if empty:
        raise IncompleteCourseError(f"incomplete topology: edge(s) {empty} have no clients")
    g = tier_graph(topology, client_ids)
    reached = nx.descendants(g, "tier:cloud")
    lost = [c for c in client_ids if f"tier:client:{c}" not in reached]
    if lost:
        shown = ", ".join(map(str, lost[:10])) + (", ..." if len(lost) > 10 else "")
        raise IncompleteCourseError(f"incomplete topology: client(s) {shown} are under no edge")
    return g


class TierLinks:
    """The communicator's time model and byte counter for a tree.

    `transfer_time` times a client-edge message on the client's own link (its device
    profile, as in a star) and an edge-cloud message on the edge link; `count_bytes` adds
    each copy to its tier and direction, and hands it on to the run's counter as upward
    (towards the cloud) or downward, so `bytes_up`/`bytes_down` keep counting every link."""

    def __init__(self, topology: Topology, timing, cfg, count_bytes, separate_types: set[str],
                 tiers: tuple[str, ...] = TIERS):
        self.topology = topology
        self.tiers = tiers     # the tiers this process sees (a deployed cloud: only its own)
        self.timing = timing
        self.forward = count_bytes
        self.separate_types = separate_types
        self.latency = cfg["topology.edge_link.latency"]
        self.up_bandwidth = cfg["topology.edge_link.upload_bandwidth"]
        self.down_bandwidth = cfg["topology.edge_link.download_bandwidth"]
        # per tier: bytes each way and link-seconds (the summary's `tiers`)
        self.totals = {t: {"bytes_up": 0, "bytes_down": 0, "link_seconds": 0.0} for t in tiers}
        self.since = {t: dict(v) for t, v in self.totals.items()}

    def transfer_time(self, sender: int, receiver: int, nbytes: int, server_id: int = SERVER_ID) -> float:
        tier = self.topology.tier(sender, receiver)
        if tier is None:   # evaluation between the cloud and a client: the client's own link
            return self.timing.transfer_time(sender, receiver, nbytes, SERVER_ID)
        if tier == "edge_cloud":
            bandwidth = self.up_bandwidth if receiver == SERVER_ID else self.down_bandwidth
            seconds = self.latency + nbytes / bandwidth
        else:   # the client's own link, to or from its edge
            edge = self.topology.parent.get(sender, sender)
            seconds = self.timing.transfer_time(sender, receiver, nbytes, edge)
        self._add(tier, "link_seconds", seconds)
        return seconds

    def count_bytes(self, msg, receiver: int, nbytes: int) -> None:
        if msg.msg_type in self.separate_types:
            self.forward(msg, receiver, nbytes)
            return
        up = self.topology.is_upward(msg.sender, receiver)
        tier = self.topology.tier(msg.sender, receiver)
        if tier is not None:
            self._add(tier, "bytes_up" if up else "bytes_down", nbytes)
        self.forward(msg, SERVER_ID if up else receiver, nbytes)

    def _add(self, tier: str, key: str, amount) -> None:
        self.totals[tier][key] += amount
        self.since[tier][key] += amount

    def take_round(self) -> dict[str, Any]:
        """Fields for a round's record: each tier's bytes and link-seconds since the last
        record, and their running totals; the counters since the last record restart."""
        fields: dict[str, Any] = {}
        for tier in self.tiers:
            since, total = self.since[tier], self.totals[tier]
            fields[f"bytes_{tier}"] = since["bytes_up"] + since["bytes_down"]
            fields[f"bytes_{tier}_total"] = total["bytes_up"] + total["bytes_down"]
            fields[f"link_seconds_{tier}"] = since["link_seconds"]
            fields[f"link_seconds_{tier}_total"] = total["link_seconds"]
            self.since[tier] = {"bytes_up": 0, "bytes_down": 0, "link_seconds": 0.0}
        return fields
