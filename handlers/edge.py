"""Edge aggregators: HierFAVG's middle tier (Liu et al., ICC 2020, Algorithm 1).

An edge is one worker holding a server's handlers towards its clients and a
client's towards the cloud. Per cloud round it receives the cloud model, runs
`topology.edge_rounds` (kappa_2) edge rounds (broadcast to its sampled clients, who
each do their kappa_1 of local work; collect; sample-weighted average) and sends the
result upward weighted by all of its clients' samples, as the paper's |D^l|. The
cloud is the course's server: it waits for every edge, aggregates with the same
aggregator, evaluates and records the round, then starts the next one. Clients are
unchanged: they report to their `parent`, their edge.
"""
from __future__ import annotations

from fedcore import admission, registry
from fedcore.errors import ConfigError
from fedcore.handlers import evaluation, join, rounds, sync, training
from fedcore.schema import clients_per_round
from fedcore.topology import TierLinks, assign, check
from fedcore.worker import HandlerTable, Worker

__all__ = ["Edge", "HIERARCHICAL_ALGORITHMS", "install"]

# algorithms whose aggregator is FedAvg's sample-weighted mean, the rule HierFAVG runs at both tiers
HIERARCHICAL_ALGORITHMS = ("fedavg", "fedprox")


class Edge(Worker):
    """An edge aggregator: a server to its `children`, a client to the cloud."""

    role = "edge"

    def __init__(self, edge_id: int, index: int, children: list[int], table: HandlerTable, course):
        super().__init__(edge_id, table, course)
        cfg = course.cfg
        self.children = children
        self.aggregator = course.algorithm.aggregator(course.server.model, cfg, len(children))
        # edge i draws from the stream seed + 1009 i (the first edge's is the flat server's)
        self.sampler = registry.samplers.get(cfg["federate.sampler"])(children, cfg["seed"] + 1009 * index,
                                                                      course.timing)
        if hasattr(self.sampler, "configure"):
            self.sampler.configure(course)
        share = clients_per_round(cfg) * len(children) / course.num_clients
        self.per_round = max(1, int(round(share)))
        self.joined: set[int] = set()
        self.declared_samples: dict[int, int] = {}
        self.selected: set[int] = set()
        self.buffer: list = []
        self.started = self.finished = False
        self.cloud_round = self.edge_round = 0


# ---------------------------------------------------------------- edge handlers
def admit_to_edge(edge: Edge, msg) -> None:
    """Edge `receiving_join_in`: once all its clients are in, join the cloud declaring their
    samples together (the cloud's weight for this edge, |D^l|)."""
    join.note_join(edge, msg)
    if len(edge.joined) == len(edge.children) and not edge.started:
        edge.started = True
        edge.send("join_in", edge.parent, {"client_id": edge.id,
                                           "num_samples": sum(edge.declared_samples.values())})


def start_edge_rounds(edge: Edge, msg) -> None:
    """Edge `receiving_models`: adopt the cloud model and start kappa_2 edge rounds from it."""
    edge.cloud_round = msg.round
    edge.aggregator.global_state = {**edge.aggregator.global_state, **msg.content["model"]}
    edge.edge_round = 0
    _next_edge_round(edge)


def _next_edge_round(edge: Edge) -> None:
    """Sample this edge's clients and send them the edge model; their replies carry the
    course-wide edge-round index t = (cloud round - 1) kappa_2 + j (t = cloud round when kappa_2 = 1)."""
    edge.edge_round += 1
    edge.round = (edge.cloud_round - 1) * edge.course.cfg["topology.edge_rounds"] + edge.edge_round
    edge.selected = set(edge.sampler.sample(edge.per_round, edge.children))
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
    if edge.edge_round < edge.course.cfg["topology.edge_rounds"]:
        _next_edge_round(edge)
        return
    content = {"model": edge.aggregator.broadcast(edge.cloud_round)["model"],
               "num_samples": sum(edge.declared_samples.values())}
    edge.send("updates", edge.parent, content, round_=edge.cloud_round)


def pass_finish_down(edge: Edge, msg) -> None:
    """Edge `receiving_finish`: the course is over; tell its clients."""
    edge.finished = True
    edge.send("finish", edge.children, {})


# ---------------------------------------------------------------- cloud handlers
def admit_edge(server, msg) -> None:
    """Cloud `receiving_join_in`: an edge joins for its clients; start when every edge is in."""
    join.note_join(server, msg)
    if len(server.joined) == len(server.course.topology.edges) and not server.started:
        server.started = True
        server.trigger("all_joined_in")


def start_cloud_round(server, _event=None) -> None:
    """Cloud `all_joined_in` (and after each aggregation): send the model to every edge."""
    edges = sorted(server.course.topology.edges)
    server.selected = set(edges)
    server.buffer = []
    server.send("models", edges, server.aggregator.broadcast(server.round))


def aggregate_at_cloud(server, _event=None) -> None:
    """Cloud `all_received`: aggregate the edge models, record the round with its bytes and
    link time per tier, then finish or start the next cloud round."""
    if rounds.aggregate(server, server.buffer, server.course.links.take_round()):
        start_cloud_round(server)


def finish_through_edges(server, _event) -> None:
    """Cloud `max_rounds_reached` / `early_stop`: tell the edges, who tell their clients."""
    rounds.note_finish(server)
    server.send("finish", sorted(server.course.topology.edges), {})


# ---------------------------------------------------------------- assembly
def install(course) -> None:
    """The hierarchical course: assign clients to edges, make the edge workers, route time and
    bytes per tier, and register the cloud's, the edges' and the clients' handlers."""
    cfg = course.cfg
    if cfg["algorithm.name"] not in HIERARCHICAL_ALGORITHMS:
        raise ConfigError(f"topology.edges: HierFAVG averages by samples at both tiers; algorithm "
                          f"{cfg['algorithm.name']} is not supported with edges "
                          f"(use one of {', '.join(HIERARCHICAL_ALGORITHMS)})")
    topology = course.topology = assign(cfg, course.client_ids, course.data, course.timing)
    course.tier_graph = check(topology, course.client_ids)
    course.links = TierLinks(topology, course.timing, cfg, course.comm.count_bytes,
                             course.monitor.separate_types)
    course.comm.timing, course.comm.count_bytes = course.links, course.links.count_bytes
    edge_table = HandlerTable("edge")
    course.extra_tables.append(edge_table)
    course.edges = {}
    for index, (edge_id, children) in enumerate(sorted(topology.edges.items())):
        edge = course.edges[edge_id] = Edge(edge_id, index, children, edge_table, course)
        course.comm.attach(edge)
        for cid in children:
            course.clients[cid].parent = edge_id
    course.monitor.extra_summary["topology"] = topology.describe()
    course.monitor.extra_summary["tiers"] = course.links.totals   # live: written at the end

    course.client_table.register("start", join.join_in, sends=("join_in",))
    training.install(course)
    evaluation.install(course)
    s = course.server_table
    s.register("receiving_join_in", admit_edge, sends=("all_joined_in",))
    s.register("all_joined_in", start_cloud_round, sends=("models",))
    s.register("receiving_updates", sync.collect_update, sends=("all_received",))
    s.register("all_received", aggregate_at_cloud,
               sends=("models", "eval_request", "max_rounds_reached", "early_stop"))
    s.register("max_rounds_reached", finish_through_edges, sends=("finish",))
    s.register("early_stop", finish_through_edges, sends=("finish",))
    edge_table.register("receiving_join_in", admit_to_edge, sends=("join_in",))
    edge_table.register("receiving_models", start_edge_rounds, sends=("models", "all_received"))
    edge_table.register("receiving_updates", sync.collect_update, sends=("all_received",))
    edge_table.register("all_received", aggregate_at_edge, sends=("models", "all_received", "updates"))
    edge_table.register("receiving_finish", pass_finish_down, sends=("finish",))

