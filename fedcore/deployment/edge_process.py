"""An edge aggregator's own process, for a deployed hierarchical course (HierFAVG over gRPC).

`python -m fedcore.run --cfg X distribute.role=edge distribute.edge_id=E
distribute.cloud_port=P` serves the edge's clients with fedcore's gRPC server (on
`distribute.server_host`/`server_port`, as any server) and dials the cloud with fedcore's
gRPC client (to `distribute.cloud_host`/`cloud_port`) under its edge id. The edge worker
and its handlers are the simulation's (`handlers/edge.py`); only the two communicators and
the wall clock are the deployment's. The cloud is a plain `distribute.role=server` process
with `topology.edges`, the clients plain clients that dial their edge.

Faults: a client lost mid-round is dropped from its edge's round, as a star's server
drops it (`handlers/deployment.py`, the same handlers on the edge's table); the cloud drops
a lost edge the same way (its clients' work for that round is lost). An edge that comes
back, on the same port, is rejoined by its clients (they redial it and join again) and then
joins the cloud again, which sends it the next cloud round.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from fedcore.comm.stream import host_port
from fedcore.deployment.deploy_config import message_bound, value_bound
from fedcore.deployment.distributed import ServerCourse, _measured_time, deployed_process
from fedcore.kernel import registry
from fedcore.kernel.errors import EXIT_OK, FedcoreError
from fedcore.kernel.files import make_folder, write_atomic
from fedcore.kernel.message import SERVER_ID
from fedcore.kernel.scheduler import PRIORITY_TIMER
from fedcore.kernel.state import make_state_store
from fedcore.runtime.log_format import set_context
from fedcore.runtime.topology import assign
from fedcore.kernel.worker import HandlerTable, Worker

__all__ = ["EdgeCourse", "run_edge", "CLOUD_TOKEN_ENV", "address_file"]

log = logging.getLogger("fedcore.deploy")

CLOUD_TOKEN_ENV = "FEDCORE_CLOUD_TOKEN"   # the token an edge presents to the cloud


def address_file(outdir: Path, edge_id: int) -> Path:
    """Where an edge listening on a free port (server_port 0) writes its host:port."""
    return Path(outdir) / f"edge_{edge_id}_address"


class _Router:
    """The edge's communicator: what goes to the cloud (id 0) goes up, the rest down."""

    def __init__(self, up, down):
        self.up, self.down = up, down

    def send(self, msg) -> None:
        (self.up if tuple(msg.receivers) == (SERVER_ID,) else self.down).send(msg)

    def live_ids(self, joined=None, joining: bool = False) -> list[int]:   # the edge's clients, as a server's
        return self.down.live_ids(joined, joining)

    def expire(self, timeout: float) -> list[tuple[int, str]]:
        return self.down.expire(timeout)


class _FromCloud:
    """What the client comm delivers to: the edge, without the client's rule that `finish`
    ends the process (an edge first passes it on and waits for its clients to leave)."""

    def __init__(self, edge: Worker):
        self.deliver = edge.deliver


class _Rejoin:
    """A restarted cloud, or the same one after a redial: join it again for the clients
    already in (`GrpcClientComm.on_readmitted`)."""

    def __init__(self, edge: Worker):
        self.edge = edge

    def __call__(self) -> None:
        edge = self.edge
        if edge.started and not edge.finished:
            edge.send("join_in", SERVER_ID, {"client_id": edge.id, "num_samples": edge.weight()})


def check_edge_round(edge: Worker, event=None) -> None:
    """Edge `round_check` (periodic): a star server's deadline checks, while the edge runs a cloud
    round (between rounds it waits for the cloud, not for its clients)."""
    if edge.in_cloud_round:
        registry.components.get("deployment").round_check(edge, event)


def rerun_edge_round(edge: Worker, _event=None) -> None:
    """Edge `all_joined_in` (raised by the deployment handlers when every client waited for was
    lost before replying): run this edge round again with the clients connected, if any."""
    if edge.in_cloud_round and edge.course.client_ids and not edge.finished:
        edge.edge_round -= 1
        registry.components.get("edge")._next_edge_round(edge)


def cloud_config(cfg):
    """The config the edge's client comm dials the cloud with: the cloud's address, the edge's id
    and the token for the cloud (`distribute.cloud_token_file`, else FEDCORE_CLOUD_TOKEN, else
    the edge's own token)."""
    from fedcore.comm.stream import read_token
    d = cfg.section("distribute")
    token = os.environ.get(CLOUD_TOKEN_ENV) or read_token(d)
    if d["cloud_token_file"]:
        token = read_token({"token_file": d["cloud_token_file"]})
    return cfg.with_overrides(distribute__server_host=d["cloud_host"], distribute__server_port=d["cloud_port"],
                              distribute__client_id=d["edge_id"], distribute__token=token,
                              distribute__token_file=None)


class EdgeCourse(ServerCourse):
    """One edge process: the edge worker between a gRPC server (its clients) and a gRPC client
    (the cloud), on a wall clock. To its clients it is a server: the edge worker stands where
    a server's worker does (`self.server`), so a server's watch (heartbeats, deadlines, lost
    clients, stopping once they have left after `finish`) serves it unchanged."""

    def __init__(self, cfg, outdir: str | Path | None = None):
        super().__init__(cfg.with_overrides(outdir=None), None, False)   # the cloud writes the outputs
        self.address_dir = Path(outdir) if outdir is not None else None
        self.edge: Worker | None = None

    def build(self) -> "EdgeCourse":
        from fedcore.comm.grpc_client import GrpcClientComm
        from fedcore.comm.grpc_server import GrpcServerComm
        cfg = self.cfg
        edge_id = cfg["distribute.edge_id"]
        topology = assign(cfg, self._all_ids)
        children = topology.edges[edge_id]
        # as a star's server: no client declares more samples than the largest partition of its
        # edge (`Edge.client_cap`), so an honest edge never declares more than the cloud's bound
        data, sizes = registry.components.get("server_data")(cfg)
        test = data.server_test
        self.data = type(data)({}, type(test)(test.x[:0], test.y[:0]), data.input_shape, data.num_classes)
        model = self.make_model()
        self.store = make_state_store("memory", None)
        self.trainer = None
        self.timing = _measured_time()
        self.down = GrpcServerComm(cfg, self.scheduler, self._count_bytes, self._lost, self._maybe_stop)
        self.up = GrpcClientComm(cloud_config(cfg), self.scheduler, bounds_from_course=True)
        self.up.num_clients = self.num_clients + cfg["topology.edges"]   # edges follow the clients
        for comm in (self.down, self.up):
            comm.device = self.device
        nbytes = cfg["distribute.max_message_bytes"] or message_bound(model)
        values = cfg["distribute.max_message_values"] or value_bound(model, cfg)
        self.down.max_message, self.down.max_values = nbytes, values
        self.up.set_bounds(nbytes, values)
        self.comm = _Router(self.up, self.down)
        table = HandlerTable("edge")
        self.extra_tables.append(table)
        edge_handlers = registry.components.get("edge")
        self.deployment = deployment = registry.components.get("deployment")
        edge_handlers.install_edge(table)
        table.register("client_lost", deployment.client_lost, sends=("all_received", "all_joined_in"))
        table.register("round_check", check_edge_round, sends=("all_received", "all_joined_in"))
        table.register("all_joined_in", rerun_edge_round, sends=("models", "all_received"))
        index = sorted(topology.edges).index(edge_id)
        self.server = self.edge = edge_handlers.Edge(edge_id, index, children, table, self, model, sizes)
        self.edge.selected = set()
        self.down.attach(self.edge)
        self.up.attach(_FromCloud(self.edge))
        self.up.on_new_server = self.up.on_readmitted = _Rejoin(self.edge)
        self.built = True
        return self

    def run(self) -> int:
        from fedcore.deployment.ops_http import start_ops
        port = self.down.start()
        self.listening = True
        host = self.cfg["distribute.server_host"]
        try:
            ops = start_ops(self, "edge", self.address_dir, f"edge_{self.edge.id}_metrics_address")
        except BaseException:
            self.down.stop()
            raise
        if self.address_dir is not None and self.cfg["distribute.server_port"] == 0:
            make_folder(self.address_dir)
            write_atomic(address_file(self.address_dir, self.edge.id), f"{host_port(host, port)}\n")
        log.info("edge %d listening on %s for clients %s; cloud at %s", self.edge.id,
                 host_port(host, port), self.edge.children, self.up.address)
        self.up.start()
        self.scheduler.schedule(0.0, PRIORITY_TIMER, self._watch)
        try:
            self.scheduler.run()
        finally:
            if not self.up.closed:
                self.up.close("finished" if self.edge.finished else "stopped")
            if ops is not None:
                ops.stop()
            self.down.stop()
        if not self.edge.finished:
            raise FedcoreError(f"edge {self.edge.id} stopped before the course finished")
        print(f"edge {self.edge.id}: course finished (last cloud round {self.edge.cloud_round})")
        return EXIT_OK


def run_edge(cfg, outdir, check_only: bool = False) -> int:
    """`distribute.role: edge`: serve this edge's clients and dial the cloud until `finish`."""
    deployed_process()
    course = EdgeCourse(cfg, outdir).build()
    set_context(lambda: {"worker": f"edge {course.edge.id}", "round": course.edge.cloud_round})
    if check_only:
        return EXIT_OK
    try:
        return course.run()
    except KeyboardInterrupt:
        course.up.close("interrupted", timeout=2.0)
        raise
