"""Edge aggregators: HierFAVG's middle tier (Liu et al., ICC 2020, Algorithm 1).

An edge is one worker holding a server's handlers towards its clients and a
client's towards the cloud. Per cloud round it receives the cloud model, runs
`topology.edge_rounds` (kappa_2) edge rounds (broadcast to its sampled clients, who
each do their kappa_1 of local work; collect; sample-weighted average) and sends the
result upward weighted by all of its clients' samples, as the paper's |D^l|. The
cloud is the course's server: it waits for every edge, aggregates with the same
aggregator, evaluates and records the round, then starts the next one. Clients are
unchanged: they report to their `parent`, their edge.

Edges hold tokens, not the course: the cloud bounds what each edge may declare by what
the topology assigns it (`topology.edge_bounds`), refuses a larger declaration at the
join (the edge then counts for nothing), screens edge models with the admission layer
and `aggregator.robust_rule` as a star's server screens clients, and leaves out an edge
none of whose clients' updates it admitted in the cloud round.
"""
from __future__ import annotations

import sys

from fedcore.runtime import admission

from fedcore.kernel import registry
from fedcore.algorithms import robust
from fedcore.algorithms.combine import replace_combination
from fedcore.algorithms.fedavg import FedAvgAggregator
from fedcore.kernel.errors import ConfigError
from fedcore.handlers import edge_async, evaluation, join, rounds, sync, training
from fedcore.kernel.schema import clients_per_round
from fedcore.runtime.topology import TIERS, TierLinks, assign, check, client_cap, edge_bounds
from fedcore.kernel.worker import HandlerTable, Worker

__all__ = ["Edge", "HIERARCHICAL_ALGORITHMS", "install", "install_edge"]

# algorithms whose aggregator is FedAvg's sample-weighted mean, the rule HierFAVG runs at both tiers
HIERARCHICAL_ALGORITHMS = ("fedavg", "fedprox")


class Edge(Worker):
    """An edge aggregator: a server to its `children`, a client to the cloud."""

    role = "edge"

    def __init__(self, edge_id: int, index: int, children: list[int], table: HandlerTable, course, model,
                 sizes: dict[int, int]):
        super().__init__(edge_id, table, course)
        cfg = course.cfg
        self.children = children
        # what one client counts for here (admission.sample_cap), so that the edge never declares
        # more than the cloud's bound for it, whatever one of its clients declared
        self.client_cap = client_cap(cfg, children, sizes)
        self.contributed = False   # a client's update was admitted in this cloud round
        self.aggregator = course.algorithm.aggregator(model, cfg, len(children))
        rule = robust.edge_rule(cfg)   # topology.edge_robust_rule; the cloud's is aggregator.robust_rule
        if rule is not None:
            replace_combination(self.aggregator, rule, f"topology.edge_robust_rule {cfg['topology.edge_robust_rule']}")
        # edge i draws from the stream seed + 1009 i (the first edge's is the flat server's)
        self.sampler = registry.samplers.get(cfg["federate.sampler"])(children, cfg["seed"] + 1009 * index,
                                                                      course.timing)
        if hasattr(self.sampler, "configure"):
            self.sampler.configure(course)
        share = clients_per_round(cfg) * len(children) / course.num_clients
        self.per_round = max(1, int(round(share)))
        self.joined: set[int] = set()
        self.selected: set[int] = set()
        self.buffer: list = []
        self.started = self.finished = False
        self.in_cloud_round = False   # between the cloud's model and the edge's reply to it
        self.cloud_round = self.edge_round = 0

    def weight(self) -> int:
        """|D^l|: what its clients declared, each counted up to `client_cap`, so that no client can
        raise its edge past the cloud's bound (the cloud would refuse the edge's declaration)."""
        declared = self.state(admission.AdmissionState).declared.values()
        return sum(min(max(n, 0), self.client_cap) for n in declared if isinstance(n, int))

    def update_weight(self) -> int:
        """What this cloud round's edge model counts for: |D^l|, or 0 when no client's update was
        admitted (its model is then the cloud's own, which would only hold the others back)."""
        return self.weight() if self.contributed else 0


# ---------------------------------------------------------------- edge handlers
def admit_to_edge(edge: Edge, msg) -> None:
    """Edge `receiving_join_in`: once all its clients are in, join the cloud declaring their
    samples together (the cloud's weight for this edge, |D^l|)."""
    if msg.sender not in edge.children:   # deployed: a client that dialled the wrong edge
        admission.note(edge, "join from a client of another edge",
                       f"edge {edge.id}: ignored a join from client {msg.sender}, not one of its clients")
        return
    join.note_join(edge, msg)
    if len(edge.joined) == len(edge.children) and not edge.started:
        edge.started = True
        edge.send("join_in", edge.parent, {"client_id": edge.id, "num_samples": edge.weight()})


def start_edge_rounds(edge: Edge, msg) -> None:
    """Edge `receiving_models`: adopt the cloud model and start kappa_2 edge rounds from it."""
    edge.cloud_round, edge.in_cloud_round = msg.round, True
    edge.cloud_model = msg.content["model"]   # what a FedBuff cloud's delta is taken from
    edge.aggregator.global_state = {**edge.aggregator.global_state, **msg.content["model"]}
    edge.edge_round, edge.contributed = 0, False
    _next_edge_round(edge)


def _next_edge_round(edge: Edge) -> None:
    """Sample this edge's clients and send them the edge model; their replies carry the
    course-wide edge-round index t = (cloud round - 1) kappa_2 + j (t = cloud round when kappa_2 = 1)."""
    edge.edge_round += 1
    edge.round = (edge.cloud_round - 1) * edge.course.cfg["topology.edge_rounds"] + edge.edge_round
    # deployed, only the clients connected and joined (`EdgeCourse.client_ids`; in simulation all)
    edge.selected = set(edge.sampler.sample(edge.per_round, edge.children)).intersection(edge.course.client_ids)
    edge.buffer = []
    edge.send("models", sorted(edge.selected), edge.aggregator.broadcast(edge.round))
    if not edge.selected:
        edge.trigger("all_received")


def aggregate_at_edge(edge: Edge, _event=None) -> None:
    """Edge `all_received`: average its clients' admitted models by their samples; after kappa_2
    edge rounds, send the edge model to the cloud, weighted by all of the edge's samples."""
    # the admission layer screens the clients' updates where they arrive, as a star's server does
    updates = admission.admit_updates(edge, sorted(edge.buffer, key=lambda u: u.client_id))
    if updates:
        edge.aggregator.aggregate(updates, edge.round)
        edge.contributed = True
    if edge.edge_round < edge.course.cfg["topology.edge_rounds"]:
        _next_edge_round(edge)
        return
    content = edge_async.edge_content(edge, edge.aggregator.broadcast(edge.cloud_round)["model"])
    edge.in_cloud_round = False
    edge.send("updates", edge.parent, content, round_=edge.cloud_round)


def pass_finish_down(edge: Edge, msg) -> None:
    """Edge `receiving_finish`: the course is over; tell its clients."""
    edge.finished = True
    edge.send("finish", edge.children, {})


# ---------------------------------------------------------------- cloud handlers
def admit_edge(server, msg) -> None:
    """Cloud `receiving_join_in`: an edge joins for its clients; start when every edge is in
    (an edge that joins again after the start is sent the next cloud round's model). An edge
    declaring more samples than its clients may hold is refused that declaration: it joins
    counting for 0 samples, so nothing it sends is aggregated; one already admitted keeps the
    count it was first admitted with."""
    topology = server.course.topology
    if msg.sender not in topology.edges:   # deployed: only edges dial the cloud
        admission.note(server, "join from a worker that is not an edge",
                       f"cloud: ignored a join from {msg.sender}, which is not an edge")
        return
    n = msg.content.get("num_samples") if isinstance(msg.content, dict) else None
    bound = server.state(admission.AdmissionState).bounds[msg.sender]
    if not (type(n) is int and 0 <= n <= bound):
        declared = server.state(admission.AdmissionState).declared
        first = declared.get(msg.sender)
        outcome = ("it counts for 0 samples" if first is None
                   else f"the count it was first admitted with ({first} samples) stands")
        admission.note(server, "edge declaration above its clients' bound",
                       f"cloud: refused edge {msg.sender}'s declaration of {n} samples at its join: its "
                       f"clients {topology.edges[msg.sender]} may hold {bound} together; {outcome}")
        server.joined.add(msg.sender)
        declared.setdefault(msg.sender, 0)
    else:
        join.note_join(server, msg)
    if len(server.joined) == len(server.course.topology.edges) and not server.started:
        server.started = True
        server.trigger("all_joined_in")


def start_cloud_round(server, _event=None) -> None:
    """Cloud `all_joined_in` (and after each aggregation): send the model to every edge (deployed:
    every edge connected and joined, `ServerCourse.client_ids`; a dead edge's round is lost)."""
    edges = sorted(server.course.topology.edges)
    if server.course.cfg["distribute.role"] is not None:
        edges = [e for e in server.course.client_ids if e in server.course.topology.edges]
    server.selected = set(edges)
    server.buffer = []
    server.send("models", edges, server.aggregator.broadcast(server.round))


def aggregate_at_cloud(server, _event=None) -> None:
    """Cloud `all_received`: aggregate the edge models that carry some client's work, record the
    round with its bytes and link time per tier, then finish or start the next cloud round."""
    updates = edge_async.contributing(server.buffer)
    if rounds.aggregate(server, updates, server.course.links.take_round()):
        start_cloud_round(server)


def finish_through_edges(server, _event) -> None:
    """Cloud `max_rounds_reached` / `early_stop`: tell the edges, who tell their clients."""
    rounds.note_finish(server)
    server.send("finish", sorted(server.course.topology.edges), {})


# ---------------------------------------------------------------- assembly
def install(course) -> None:
    """The hierarchical course: assign clients to edges and register the cloud's, the edges' and
    the clients' handlers. In simulation one course holds every tier; deployed, each process
    installs its own: the cloud (role server) the cloud's, each client the client's, and each
    edge process its edge's (`fedcore.deployment.edge_process`, through `install_edge`)."""
    cfg = course.cfg
    # FedAvg's own aggregator also under another name (a plug-in's trainer with FedAvg's mean)
    if cfg["algorithm.name"] not in HIERARCHICAL_ALGORITHMS and course.algorithm.aggregator is not FedAvgAggregator:
        raise ConfigError(f"topology.edges: HierFAVG averages by samples at both tiers; algorithm "
                          f"{cfg['algorithm.name']} is not supported with edges "
                          f"(use one of {', '.join(HIERARCHICAL_ALGORITHMS)})")
    role = cfg["distribute.role"]
    course.client_table.register("start", join.join_in, sends=("join_in",))
    training.install(course)
    evaluation.install(course)
    if role == "client":   # a client process: it reports to its edge as to a server
        return
    topology = course.topology = assign(cfg, course.client_ids, course.data, course.timing)
    course.tier_graph = check(topology, course.client_ids)
    # deployed, the cloud sees only its own tier's bytes (and times no link: time is measured)
    # an edge speaks for many clients: bound by its clients' caps, not one client's
    course.default_sample_cap = None
    sizes = course.client_sizes if role == "server" else {c: len(course.data.clients[c].train)
                                                          for c in course.client_ids}
    course.server.state(admission.AdmissionState).bounds = edge_bounds(topology, cfg, sizes)
    course.links = TierLinks(topology, course.timing, cfg, course.comm.count_bytes,
                             course.monitor.separate_types, TIERS if role is None else ("edge_cloud",))
    course.comm.count_bytes = course.links.count_bytes
    course.monitor.add_summary("topology", {"topology": topology.describe(),
                                            "tiers": course.links.totals})   # live: written at the end
    s = course.server_table
    s.register("receiving_join_in", admit_edge, sends=("all_joined_in",))
    if cfg["topology.cloud_aggregator"] == "sync":
        s.register("all_joined_in", start_cloud_round, sends=("models",))
        s.register("receiving_updates", sync.collect_update, sends=("all_received",))
        s.register("all_received", aggregate_at_cloud,
                   sends=("models", "eval_request", "max_rounds_reached", "early_stop"))
    else:   # FedAsync / FedBuff at the cloud, taking edge updates as they come
        edge_async.install_cloud(course)
    s.register("max_rounds_reached", finish_through_edges, sends=("finish",))
    s.register("early_stop", finish_through_edges, sends=("finish",))
    if role is not None:
        return
    course.comm.timing = course.links
    edge_table = HandlerTable("edge")
    course.extra_tables.append(edge_table)
    install_edge(edge_table)
    course.edges = {}
    for index, (edge_id, children) in enumerate(sorted(topology.edges.items())):
        edge = course.edges[edge_id] = Edge(edge_id, index, children, edge_table, course,
                                            course.server.model, sizes)
        course.comm.attach(edge)
        for cid in children:
            course.clients[cid].parent = edge_id


def install_edge(table: HandlerTable) -> None:
    """An edge's handlers: a server's towards its clients, a client's towards the cloud."""
    table.register("receiving_join_in", admit_to_edge, sends=("join_in",))
    table.register("receiving_models", start_edge_rounds, sends=("models", "all_received"))
    table.register("receiving_updates", sync.collect_update, sends=("all_received",))
    table.register("all_received", aggregate_at_edge, sends=("models", "all_received", "updates"))
    table.register("receiving_finish", pass_finish_down, sends=("finish",))


registry.components.register("edge", sys.modules[__name__])   # the core's edge process builds on it
