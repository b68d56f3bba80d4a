"""Deployment: the same course, one process per worker, gRPC between them, wall-clock time.

`python -m fedcore.run --cfg X federate.mode=distributed distribute.role=server`
builds the server's half of the course (server worker, aggregator, sampler,
monitor, held-out test set); `... distribute.role=client distribute.client_id=K`
builds one client (its trainer, its own state store, and only partition K of
the data, built exactly as the simulation builds it). Both install the same
handler tables as the simulation; only the communicator (gRPC instead of
in-process), the scheduler (wall clock instead of virtual) and the time model
(measured instead of modelled) differ. The server also installs the
`deployment` behaviour (join timeout, lost clients, round deadline). The server
snapshots its course after every round and resumes one with `resume_from=latest`
(`fedcore.runtime.snapshot`, `fedcore.deployment.deployed_resume`).
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from fedcore.kernel import registry
from fedcore.comm.stream import INSECURE_NOTED_ENV, INSECURE_WARNING, REFUSED_NOTICE, host_port
from fedcore.runtime.checkpoint import interrupted_message
from fedcore.kernel.files import write_atomic
from fedcore.runtime.course import Course, StartEvent, collector_for_run, raise_if_diverged
from fedcore.deployment.deploy_config import message_bound, redacted, value_bound
from fedcore.deployment.deployed_resume import not_aggregated_yet, resume_server
from fedcore.kernel.batch_order import own_randomness
from fedcore.execution.executor import apply_torch_threads
from fedcore.kernel.errors import EXIT_OK, ConfigError, FedcoreError
from fedcore.execution.form_boundary import make_trainer
from fedcore.kernel.hooks import deployment_refusal
from fedcore.kernel.scheduler import PRIORITY_TIMER, WallClockScheduler
from fedcore.kernel.state import make_state_store
from fedcore.runtime.log_format import set_context
from fedcore.runtime.parking import Parking
from fedcore.runtime.timing import TimeModel
from fedcore.kernel.worker import Client

__all__ = ["ServerCourse", "ClientCourse", "run_distributed", "run_client", "own_data_config",
           "deployed_process"]

log = logging.getLogger("fedcore.deploy")


def _raise_open_files_limit(clients: int) -> None:
    """Serve with as many open files as the system allows a process (each client's connection,
    and each idle socket, costs one); warn when that is fewer than the course's clients need."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    except (ImportError, ValueError, OSError):  # no such limit here, or not allowed to change it
        return
    if soft != resource.RLIM_INFINITY and soft < clients + 64:
        log.warning("this process may open %d files, fewer than %d clients' connections need; "
                    "raise the limit (ulimit -n, or LimitNOFILE= for a service) to at least %d",
                    soft, clients, clients + 64)


def _refuse_undeployable(plugin) -> None:
    """A behaviour whose wrapper needs clients and server in one process stops the course here."""
    why = deployment_refusal(plugin)
    if why is not None:
        raise ConfigError(why)


def _measured_time() -> TimeModel:
    return TimeModel({}, mode="measured")  # real seconds: compute is what it took


# ---------------------------------------------------------------- the server's half

class ServerCourse(Course):
    """The server process: server worker, aggregator, sampler, monitor; clients are remote."""

    def __init__(self, cfg, outdir: str | Path | None = None, progress: bool | int = False):
        super().__init__(cfg, outdir, progress)
        self.scheduler = WallClockScheduler()
        self._finish_clock: float | None = None
        self._awaiting: set[int] | None = None  # clients still to leave after the finish
        self._departed: set[int] = set()        # clients whose departure this thread has handled
        self.loop_beat = time.monotonic()       # stamped by each watch: /healthz reads its age
        self.listening = False                  # the gRPC port is bound (/readyz)

    @property
    def client_ids(self) -> list[int]:
        """The clients a handler may address: connected and joined, by the process of the
        session (all ids before assembly; once finished, a member's new process that has not
        joined yet too: it is told the course is over)."""
        if self.built:
            finished = self.server.finished
            live = self.comm.live_ids(self.server.joined, joining=finished)
            benched = self.deployment.benched(self.server)  # missed a deadline, silent since
            if benched and not finished:
                live = [c for c in live if c not in benched]
            return live
        return self._all_ids

    @client_ids.setter
    def client_ids(self, ids) -> None:
        self._all_ids = list(ids)

    def build(self, data: Any = None) -> "ServerCourse":
        from fedcore.comm.grpc_server import GrpcServerComm
        cfg = self.cfg
        # The server builds only its held-out test set; client partitions live with the clients.
        # No client of this course holds more training samples than the largest partition
        # (clients on larger own data need admission.max_num_samples).
        if data is not None:
            sizes = {cid: len(c.train) for cid, c in data.clients.items()}
            self.data = type(data)({}, data.server_test, data.input_shape, data.num_classes)
        else:
            self.data, sizes = registry.components.get("server_data")(cfg)
        self.default_sample_cap = max(sizes.values(), default=None)
        self.client_sizes = sizes   # each client's partition size (a cloud bounds its edges by them)
        model = self.make_model()
        self.store = make_state_store("memory", None)
        self.trainer = None
        self.timing = _measured_time()
        self.comm = GrpcServerComm(cfg, self.scheduler, self._count_bytes, self._lost,
                                   self._maybe_stop)
        self.comm.device = self.device
        if cfg["distribute.spool_dir"] is None and self.outdir is not None:
            self.comm.spool_dir = str(self.outdir)   # on the disk the outputs go to
        self.comm.on_new_session = self._new_session
        self.comm.update_gate = lambda msg: not_aggregated_yet(self, msg)
        if cfg["distribute.max_message_bytes"] is None:
            self.comm.max_message = message_bound(model)
        if cfg["distribute.max_message_values"] is None:
            self.comm.max_values = value_bound(model, cfg)
        self.make_server(model, self._all_ids)
        if cfg["distribute.spool_bytes"]:   # a large global model waits in a file while rounds collect
            self.server.state(Parking).min_bytes = cfg["distribute.spool_bytes"]
            self.server.state(Parking).folder = self.comm.spool_dir
        self.clients = {}
        self.install_handlers()
        _refuse_undeployable(self.server.aggregator)
        # the deployment behaviour, looked up once: its traffic note runs on every message
        self.deployment = deployment = registry.components.get("deployment")
        deployment.install(self)
        apply_torch_threads(cfg)
        self.comm.attach(self.server)
        self.monitor.hold_one_round = True   # a lost client's evaluation holds back no record
        self.monitor.hold_seconds = lambda: deployment.least_deadline(self.server)
        self.resumed_at = None
        if cfg["resume_from"]:
            self.comm.resumed_round = resume_server(self, cfg["resume_from"])
        self.built = True
        return self

    def write_header(self) -> None:
        """As a course's, with secrets redacted from config.yaml."""
        cfg, self.cfg = self.cfg, redacted(self.cfg)
        try:
            super().write_header()
        finally:
            self.cfg = cfg

    # ------------------------------------------------------------ runtime events
    def _count_bytes(self, msg, receiver: int, nbytes: int) -> None:
        """Each message sent or received: counted, and timed for the round deadline."""
        self.monitor.count_bytes(msg, receiver, nbytes)
        self.deployment.note_traffic(self.server, msg, receiver, self.scheduler.now)

    def _new_session(self, client_id: int, returning: bool = False) -> None:
        """A session for `client_id` connected (a candidate for rounds once its process has
        joined: `client_ids`). A new process: what an earlier session declared is not its (a
        squatter's num_samples 0 would void the real client's updates). The process whose
        session was lost, back (`returning`): off the bench, asked again."""
        self._departed.discard(client_id)
        if returning:
            self.deployment.returned(self.server, client_id)
            return
        from fedcore.runtime.admission import AdmissionState
        self.server.state(AdmissionState).declared.pop(client_id, None)
        self.deployment.new_session(self.server, client_id)

    def updates_refused(self, received: list, admitted: list) -> None:
        """Admission refused some of `received`: each of their clients is told, with the kinds of
        refusal counted since the last time, so that it says so (log and exit status)."""
        from fedcore.runtime.admission import AdmissionState
        state = self.server.state(AdmissionState)
        counts, told = state.counts, state.told
        state.told = dict(counts)
        why = "; ".join(k for k in counts if counts[k] > told.get(k, 0)) or "refused by admission"
        kept = {id(u) for u in admitted}
        for u in received:
            if id(u) not in kept:
                self.comm.tell(u.client_id, REFUSED_NOTICE, u.round, {"why": why})

    def _lost(self, client_id: int, reason: str) -> None:
        self._departed.add(client_id)
        if self._awaiting is not None:
            self._awaiting.discard(client_id)
        self.server.now = self.scheduler.now
        self.server.trigger("client_lost", {"client_id": client_id, "reason": reason})
        self._maybe_stop()

    def _watch(self) -> None:
        """Periodic, on the scheduler thread: heartbeat expiry, round checks, finishing."""
        self.loop_beat = time.monotonic()
        d = self.cfg.section("distribute")
        for cid, reason in self.comm.expire(d["heartbeat_timeout"]):
            self._lost(cid, reason)
        self.server.now = self.scheduler.now
        self.server.trigger("round_check")
        self.monitor.close_overdue()
        self._maybe_stop()
        period = min(d["heartbeat_interval"], d["heartbeat_timeout"] / 4)
        self.scheduler.schedule(self.scheduler.clock + period, PRIORITY_TIMER, self._watch)

    def _maybe_stop(self) -> None:
        """Once finished, stop when every client has left, or after a heartbeat timeout's grace
        (the least round deadline while a record still waits for evaluations)."""
        if not self.server.finished:
            return
        if self._finish_clock is None:
            self._finish_clock = self.scheduler.clock
            # Departures are events on this thread, queued behind the messages sent before them
            # (a client's last metrics). A client the event loop already knows gone, whose
            # departure this thread has not handled yet, is still awaited: its last messages
            # may be queued, and stopping now would lose them.
            self._awaiting = set(self.comm.live_ids()) | (set(self.server.joined) - self._departed)
        grace = self.cfg["distribute.heartbeat_timeout"]
        if self.monitor.open_records():   # the last evaluations get their round's deadline too
            grace = max(grace, self.monitor.hold_seconds())
        if not self._awaiting or self.scheduler.clock - self._finish_clock > grace:
            self.scheduler.stop()

    # ------------------------------------------------------------ running
    def run(self) -> dict[str, Any]:
        if not self.built:
            self.build()
        self.write_header()
        self.check()
        _raise_open_files_limit(self.num_clients)
        # What is built so far (model, data, libraries) lives as long as the server, and a
        # fleet's sessions are many long-lived objects: collected first, then frozen, with
        # young objects collected in larger batches (`collector_for_run`).
        gc.collect()
        with collector_for_run():
            return self._serve()

    def _serve(self) -> dict[str, Any]:
        from fedcore.deployment.ops_http import start_ops
        port = self.comm.start()
        self.listening = True
        host = self.cfg["distribute.server_host"]
        _warn_if_insecure(self.cfg)
        try:
            ops = start_ops(self, "cloud" if self.cfg.get("topology.edges") else "server", self.outdir)
        except BaseException:
            self.comm.stop()
            raise
        if self.outdir is not None:
            # whole or absent: a launcher or script polling for it never reads it half-written
            write_atomic(self.outdir / "server_address", f"{host_port(host, port)}\n".encode())
        log.info("server listening on %s for %d clients", host_port(host, port), self.num_clients)
        self.scheduler.schedule(0.0, PRIORITY_TIMER, StartEvent(self.server, "start"))
        self.scheduler.schedule(0.0, PRIORITY_TIMER, self._watch)
        try:
            self.scheduler.run()
        except KeyboardInterrupt:
            self.monitor.add_summary("stop", {"stopped_by": "interrupted"})
            self.checkpointer.save_last_completed()   # whatever checkpoint.every says
            self._finalize()
            raise
        else:
            summary = self._finalize()
            raise_if_diverged(self.server)
            return summary
        finally:
            if ops is not None:
                ops.stop()
            self.comm.stop()
            self.store.close()

    def _finalize(self) -> dict[str, Any]:
        self.monitor.add_summary("deployment", {"deployment": {"clients": self.comm.describe(),
                                                               "refused": self.comm.refusals()}})
        return self.monitor.finalize(self.scheduler.now, self.server.aggregator.global_state)


# ---------------------------------------------------------------- one client

class ClientCourse(Course):
    """One client process: its worker, trainer and state store, and only its own data."""

    def __init__(self, cfg, scheduler: WallClockScheduler):
        super().__init__(cfg.with_overrides(outdir=None), None, False)  # a client writes no outputs
        self.scheduler = scheduler
        self.server = None  # the server lives in its own process (plug-ins install their client half)

    def build(self, client_id: int, comm) -> "ClientCourse":
        cfg = self.cfg
        build_client_data = registry.components.get("client_data")
        if cfg["distribute.own_data"]:  # this machine's data.root, whole, is this client's data
            own = build_client_data(own_data_config(cfg), 1)
            self.data = type(own)({client_id: own.clients[1]}, own.server_test, own.input_shape,
                                  own.num_classes)
        else:  # only our partition, exactly as the simulation builds it
            self.data = build_client_data(cfg, client_id)
        self.model = model = self.make_model()   # the course's model (whatever the trainer's form)
        self.store = make_state_store(cfg["state.store"], cfg["state.path"])
        self.trainer = make_trainer(self.algorithm, model, cfg, self.trainer_store())
        own_randomness(self.trainer, cfg["seed"])   # the client's draws: the simulation's
        self.timing = _measured_time()
        self.comm = comm
        comm.device = self.device          # received tensors go where the model is
        self.client_ids = [client_id]
        self.client = Client(client_id, self.client_table, self, self.data.clients[client_id])
        self.client.finished = False
        self.clients = {client_id: self.client}
        self.install_handlers()
        _refuse_undeployable(self.trainer)
        apply_torch_threads(cfg)
        self.built = True
        comm.on_new_server = comm.on_readmitted = StartEvent(self.client, "start")   # join again
        comm.attach(self.client)
        return self

    def bounds(self) -> tuple[int, int]:
        """(bytes, values) a message to this client may carry: the config's, else its model's."""
        cfg = self.cfg
        return (cfg["distribute.max_message_bytes"] or message_bound(self.model),
                cfg["distribute.max_message_values"] or value_bound(self.model, cfg))


def own_data_config(cfg):
    """The config that builds a client's local data as a one-client federation."""
    return cfg.with_overrides(federate__client_num=1, federate__sample_client_num=None,
                              federate__sample_client_rate=None, data__partition="iid",
                              distribute__client_id=0, distribute__min_clients=None,
                              distribute__tokens=None)


def _warn_if_insecure(cfg) -> None:
    """Warn of a plaintext channel, unless fedcore.launch already did for all its processes."""
    if cfg["distribute.insecure"] and os.environ.get(INSECURE_NOTED_ENV) != "1":
        log.warning(INSECURE_WARNING)


def run_client(cfg, course_class: type[ClientCourse] = ClientCourse) -> int:
    """Connect, build this client's half of the course, and serve until `finish`."""
    from fedcore.comm.grpc_client import GrpcClientComm
    _warn_if_insecure(cfg)
    scheduler = WallClockScheduler()
    comm = GrpcClientComm(cfg, scheduler, bounds_from_course=True)
    comm.start()
    finished = False
    try:
        cid = comm.wait_welcome()
        log.info("client %d admitted by %s", cid, comm.address)
        course = course_class(cfg, scheduler).build(cid, comm)
        set_context(lambda: {"worker": f"client {cid}", "round": course.client.round})
        # until now the client read nothing past the welcome: its bounds come from its own course
        comm.set_bounds(*course.bounds())
        scheduler.schedule(0.0, PRIORITY_TIMER, StartEvent(course.client, "start"))
        scheduler.run()
        finished = course.client.finished
    except KeyboardInterrupt:
        comm.close("interrupted", timeout=2.0)
        raise
    finally:
        if not comm.closed:
            comm.close("finished" if finished else "stopped")
    if not finished:
        raise FedcoreError(f"client {cid} stopped before the course finished")
    if comm.refusals:
        last_round, why = comm.refusals[-1]
        raise FedcoreError(f"client {cid}: the course finished, but the server refused "
                           f"{len(comm.refusals)} of its updates (last in round {last_round}: {why})")
    print(f"client {cid}: course finished (last round {course.client.round})")
    return EXIT_OK


def _sigterm_as_interrupt(*_args) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # once: a second one must not break the stop
    raise KeyboardInterrupt


def deployed_process() -> None:
    """A deployed role's process: its deployment log at info, and SIGTERM as Ctrl-C."""
    logging.getLogger("fedcore.deploy").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    except ValueError:  # not the main thread (embedded use): leave signals alone
        pass


def run_distributed(cfg, outdir, check_only: bool = False, command: list[str] | None = None,
                    courses: tuple[type[ServerCourse], type[ClientCourse]] | None = None) -> int:
    """`federate.mode: distributed`: run this process's role, server or client (`command`: how it
    was started, for the command that resumes an interrupted server; `courses`: the server's and
    the client's course classes, a vertical course's parties'); an edge runs through
    `fedcore.deployment.edge_process.run_edge`, which builds on this module."""
    role = cfg["distribute.role"]
    if role is None:
        raise ConfigError("distribute.role: set server or client for federate.mode: distributed "
                          "(e.g. distribute.role=server)")
    if role == "edge":
        raise ConfigError("distribute.role: edge runs through python -m fedcore.run "
                          "(fedcore.deployment.edge_process.run_edge)")
    deployed_process()
    server_class, client_class = courses or (ServerCourse, ClientCourse)
    if role == "client":
        return run_client(cfg, client_class)
    progress = cfg["verbose"]  # a bar on a terminal, periodic round lines elsewhere
    course = server_class(cfg, outdir, progress=progress).build()
    set_context(lambda: {"worker": "server", "round": course.server.round})
    try:
        return course.check_or_run(check_only)
    except KeyboardInterrupt:
        if course.monitor.started:
            print(interrupted_message(course, command), file=sys.stderr)
        raise
