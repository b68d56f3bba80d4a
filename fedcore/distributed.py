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
(`fedcore.snapshot`, `fedcore.deployed_resume`).
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from fedcore import registry
from fedcore.comm.stream import INSECURE_NOTED_ENV, INSECURE_WARNING, REFUSED_NOTICE, TOKEN_ENV
from fedcore.config import declare, non_negative, positive, validator
from fedcore.checkpoint import interrupted_message
from fedcore.course import Course, StartEvent, collector_for_run, raise_if_diverged
from fedcore.deployed_resume import not_aggregated_yet, resume_server
from fedcore.executor import apply_torch_threads
from fedcore.errors import EXIT_OK, ConfigError, FedcoreError
from fedcore.form_boundary import make_trainer
from fedcore.hooks import deployment_refusal
from fedcore.scheduler import PRIORITY_TIMER, WallClockScheduler
from fedcore.state import make_state_store
from fedcore.timing import TimeModel
from fedcore.wire.census import values_bound
from fedcore.worker import Client

__all__ = ["ServerCourse", "ClientCourse", "run_distributed", "run_client", "own_data_config",
           "deployed_process"]

log = logging.getLogger("fedcore.deploy")


declare("distribute.role", str, None, "this process's part in a distributed course (setting it "
        "implies federate.mode: distributed); edge: an edge aggregator of a hierarchical course",
        choices=("server", "client", "edge"))
declare("distribute.server_host", str, "127.0.0.1", "server: address to listen on (0.0.0.0 for all "
        "interfaces); client: the server's host name or address")
declare("distribute.server_port", int, 50051, "server: port to listen on (0 picks a free one and "
        "writes host:port to <outdir>/server_address); client: the server's port",
        check=lambda v: None if 0 <= v <= 65535 else "must be in 0..65535")
declare("distribute.client_id", int, 0, "client: the id to join as (1..federate.client_num; its data "
        "partition), or 0 to be assigned one", check=non_negative)
declare("distribute.own_data", bool, False, "client: all of this machine's data.root is its own data "
        "(split train/val/test by data.splits) instead of partition distribute.client_id of the "
        "shared dataset")
declare("distribute.min_clients", int, None, "server: start once this many clients have joined and "
        "distribute.join_timeout has passed (default: wait for federate.client_num)", check=positive)
declare("distribute.join_timeout", float, 60.0, "server: seconds to wait for all clients before "
        "starting with distribute.min_clients", check=positive)
declare("distribute.token", str, None, "shared secret a client presents (server: the one it accepts); "
        "prefer distribute.token_file or the FEDCORE_TOKEN environment variable, which keep it off "
        "command lines")
declare("distribute.token_file", str, None, "file holding distribute.token (read when the key is "
        "unset; then FEDCORE_TOKEN is tried)")
declare("distribute.tokens", dict, None, "server: per-client tokens {client_id: token}; a client "
        "with its own token must present it (and may omit distribute.client_id)")
declare("distribute.tokens_file", str, None, "server: YAML file mapping client ids to their tokens "
        "(read when distribute.tokens is unset)")
declare("distribute.tls.cert", str, None, "PEM certificate of this process (server: required for TLS; "
        "client: for mutual TLS)")
declare("distribute.tls.key", str, None, "PEM private key matching distribute.tls.cert")
declare("distribute.tls.ca", str, None, "PEM CA certificate(s). Server: require and verify client "
        "certificates (mutual TLS). Client: verify the server (default: system roots)")
declare("distribute.tls.server_name", str, None, "client: the name the server's certificate is "
        "issued to, when it differs from distribute.server_host")
declare("distribute.insecure", bool, False, "allow plaintext gRPC without TLS (trusted networks only; "
        "logs a warning)")
declare("distribute.chunk_size", int, 2 * 1024 * 1024, "bytes per chunk of a streamed message",
        check=lambda v: None if 1024 <= v <= 64 * 1024 * 1024 else "must be in 1 KiB..64 MiB")
declare("distribute.stream_window", int, 256 * 1024, "server: bytes a client's stream may send ahead "
        "of the server's reading (HTTP/2 flow control). Every client waiting for its turn to upload "
        "a large update holds about twice this in the server; an upload moves at most this much per "
        "round trip (256 KiB over 50 ms: 5 MB/s): raise it for large models over long links. 0: "
        "gRPC's bandwidth probe sizes it (about 8 MB a waiting client), as it does wherever the course's "
        "messages are too small to take turns (under 16 MiB)",
        check=lambda v: None if v == 0 or 64 * 1024 <= v <= 64 * 1024 * 1024 else "must be 0 or in 64 KiB..64 MiB")
declare("distribute.max_message_bytes", int, None, "largest encoded message accepted; larger "
        "ones are refused (INVALID_ARGUMENT) before being buffered (default: 4 x the model's "
        "encoded size + 1 MiB)", check=positive)
declare("distribute.max_connections", int, None, "server: connections taken at once; more are "
        "closed as they come (default: the open-files limit less 64, kept for the server's own "
        "files)", check=positive)
declare("distribute.max_connections_per_address", int, None, "server: connections one peer address "
        "may hold; those beyond it that never carried an admitted call are closed within a second "
        "(default: a quarter of distribute.max_connections' value, at least 16; Linux only)",
        check=positive)
declare("distribute.max_streams_per_connection", int, None, "server: calls one connection may have "
        "open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; gRPC refuses more itself). Each "
        "client needs at most 3; clients in one process share one connection (default: 3 per "
        "client + 16, the server's limit on calls; 4 where every client has its own process "
        "makes a flood of calls cost the server about half as much)", check=positive)
declare("distribute.max_message_values", int, None, "largest number of values (fields and list "
        "entries of the encoding) a message may hold; more is refused before it is decoded "
        "(default: 64 per model tensor + 32 per client + 4096)", check=positive)
declare("distribute.min_bytes_per_second", float, 10_000.0, "slowest link served: a half-received "
        "message must keep arriving at this rate (it may take a chunk's time at this rate between "
        "frames), or its stream is closed and its memory freed", check=positive)
declare("distribute.heartbeat_interval", float, 2.0, "seconds between heartbeats on an idle stream",
        check=positive)
declare("distribute.heartbeat_timeout", float, 10.0, "seconds without any frame after which a peer "
        "counts as dead", check=positive)
declare("distribute.round_deadline", float, None, "server, sync course: seconds after a round starts "
        "after which clients that have not replied are dropped from it (default: derived, see "
        "distribute.deadline_factor)", check=positive)
declare("distribute.deadline_factor", float, 5.0, "server, sync course without round_deadline: a "
        "client still not replying after this many times the other clients' median reply time (at "
        "least distribute.heartbeat_timeout, at most distribute.max_round_deadline) is dropped from "
        "the round and not sampled again until it replies", check=lambda v: None if v >= 1 else
        "must be at least 1")
declare("distribute.max_round_deadline", float, 600.0, "server, sync course without round_deadline: "
        "ceiling in seconds on the derived deadline (plus the model's transfer time at "
        "distribute.min_bytes_per_second), whatever the clients' reply times; also the deadline "
        "before any client has replied", check=positive)
declare("distribute.retry_timeout", float, 60.0, "client: seconds without a server before giving up "
        "(exit code 4)", check=positive)
declare("distribute.backoff_initial", float, 0.5, "client: first reconnect delay in seconds (doubles "
        "on each failure, with jitter)", check=positive)
declare("distribute.backoff_max", float, 10.0, "client: longest reconnect delay in seconds",
        check=positive)


@validator
def _check_distribute(cfg) -> None:
    role = cfg["distribute.role"]
    if role is None:  # a role makes the run distributed, whatever federate.mode says
        return
    if role == "client" and cfg["resume_from"]:
        raise ConfigError("resume_from: a client resumes through its server (distribute.role=server "
                          "resume_from=latest); drop resume_from from the client's command")
    cert, key, ca = cfg["distribute.tls.cert"], cfg["distribute.tls.key"], cfg["distribute.tls.ca"]
    insecure = cfg["distribute.insecure"]
    if bool(cert) != bool(key):
        raise ConfigError("distribute.tls.cert and distribute.tls.key go together: set both or neither")
    if insecure and (cert or ca):
        raise ConfigError("distribute.insecure: true conflicts with distribute.tls.*; drop one of them")
    if cfg["distribute.heartbeat_interval"] >= cfg["distribute.heartbeat_timeout"]:
        raise ConfigError("distribute.heartbeat_timeout must exceed distribute.heartbeat_interval")
    n = cfg["federate.client_num"]
    if role == "server":
        if not insecure and not cert:
            raise ConfigError("distribute.tls.cert: the server needs a TLS certificate and key "
                              "(distribute.tls.cert, distribute.tls.key), or distribute.insecure: true "
                              "to run plaintext on a trusted network")
        if not (cfg["distribute.token"] or cfg["distribute.tokens"] or cfg["distribute.token_file"]
                or cfg["distribute.tokens_file"] or os.environ.get(TOKEN_ENV) or ca or insecure):
            raise ConfigError("distribute.token: the server cannot authenticate clients: set "
                              "distribute.tokens_file, distribute.token_file, FEDCORE_TOKEN or "
                              "distribute.tls.ca (client certificates)")
        for k, v in (cfg["distribute.tokens"] or {}).items():
            if not isinstance(k, int) or not 1 <= k <= n or not isinstance(v, str) or not v:
                raise ConfigError(f"distribute.tokens: entry {k!r}: keys must be client ids 1..{n} "
                                  "and values non-empty strings")
        m = cfg["distribute.min_clients"]
        if m is not None and m > n:
            raise ConfigError(f"distribute.min_clients: {m} exceeds federate.client_num {n}")
    elif role == "client" and cfg["distribute.client_id"] > n:
        raise ConfigError(f"distribute.client_id: {cfg['distribute.client_id']} exceeds "
                          f"federate.client_num {n}")


SECRET_KEYS = ("distribute.token", "distribute.tokens")


def redacted(cfg):
    """`cfg` with its secrets replaced, for the files a run writes."""
    values = {k: ("<redacted>" if k in SECRET_KEYS and v else v) for k, v in cfg._values.items()}
    return type(cfg)(values)


def message_bound(model) -> int:
    """The default distribute.max_message_bytes: room for four copies of the model's encoded
    tensors (an update with deltas or control variates) plus 1 MiB of names and framing."""
    return 4 * sum(t.numel() * t.element_size() for t in model.state_dict().values()) + 2 ** 20


def value_bound(model, cfg) -> int:
    """The default distribute.max_message_values, from the model's tensors and the clients."""
    return values_bound(len(model.state_dict()), cfg["federate.client_num"])


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

    @property
    def client_ids(self) -> list[int]:
        """The clients a handler may address: connected and joined (all ids before assembly)."""
        if self.built:
            live = self.comm.live_ids(self.server.joined)
            benched = self.deployment.benched(self.server)  # missed a deadline, silent since
            if benched and not self.server.finished:
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
        model = self.make_model()
        self.store = make_state_store("memory", None)
        self.trainer = None
        self.timing = _measured_time()
        self.comm = GrpcServerComm(cfg, self.scheduler, self._count_bytes, self._lost,
                                   self._maybe_stop)
        self.comm.device = self.device
        self.comm.on_new_session = self._new_session
        self.comm.update_gate = lambda msg: not_aggregated_yet(self, msg)
        if cfg["distribute.max_message_bytes"] is None:
            self.comm.max_message = message_bound(model)
        if cfg["distribute.max_message_values"] is None:
            self.comm.max_values = value_bound(model, cfg)
        self.make_server(model, self._all_ids)
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

    def _new_session(self, client_id: int) -> None:
        """A new process joins as `client_id`: what an earlier session declared is not its
        (a squatter's num_samples 0 would void the real client's updates)."""
        from fedcore.admission import AdmissionState
        self.server.state(AdmissionState).declared.pop(client_id, None)

    def updates_refused(self, received: list, admitted: list) -> None:
        """Admission refused some of `received`: each of their clients is told, with the kinds of
        refusal counted since the last time, so that it says so (log and exit status)."""
        from fedcore.admission import AdmissionState
        state = self.server.state(AdmissionState)
        counts, told = state.counts, state.told
        state.told = dict(counts)
        why = "; ".join(k for k in counts if counts[k] > told.get(k, 0)) or "refused by admission"
        kept = {id(u) for u in admitted}
        for u in received:
            if id(u) not in kept:
                self.comm.tell(u.client_id, REFUSED_NOTICE, u.round, {"why": why})

    def _lost(self, client_id: int, reason: str) -> None:
        if self._awaiting is not None:
            self._awaiting.discard(client_id)
        self.server.now = self.scheduler.now
        self.server.trigger("client_lost", {"client_id": client_id, "reason": reason})
        self._maybe_stop()

    def _watch(self) -> None:
        """Periodic, on the scheduler thread: heartbeat expiry, round checks, finishing."""
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
            self._awaiting = set(self.comm.live_ids())
        # Departures are events on this thread, queued behind the messages sent before them
        # (a client's last metrics), so stopping here loses nothing a leaving client sent.
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
        port = self.comm.start()
        host = self.cfg["distribute.server_host"]
        _warn_if_insecure(self.cfg)
        if self.outdir is not None:
            (self.outdir / "server_address").write_text(f"{host}:{port}\n")
        log.info("server listening on %s:%d for %d clients", host, port, self.num_clients)
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
        comm.on_new_server = StartEvent(self.client, "start")
        comm.attach(self.client)
        return self


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


def run_client(cfg) -> int:
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
        course = ClientCourse(cfg, scheduler).build(cid, comm)
        # until now the client read nothing past the welcome: its bounds come from its own model
        comm.set_bounds(cfg["distribute.max_message_bytes"] or message_bound(course.model),
                        cfg["distribute.max_message_values"] or value_bound(course.model, cfg))
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


def run_distributed(cfg, outdir, check_only: bool = False, command: list[str] | None = None) -> int:
    """`federate.mode: distributed`: run this process's role, server or client (`command`: how it
    was started, for the command that resumes an interrupted server); an edge runs through
    `fedcore.edge_process.run_edge`, which builds on this module."""
    role = cfg["distribute.role"]
    if role is None:
        raise ConfigError("distribute.role: set server or client for federate.mode: distributed "
                          "(e.g. distribute.role=server)")
    if role == "edge":
        raise ConfigError("distribute.role: edge runs through python -m fedcore.run "
                          "(fedcore.edge_process.run_edge)")
    deployed_process()
    if role == "client":
        return run_client(cfg)
    progress = cfg["verbose"]  # a bar on a terminal, periodic round lines elsewhere
    course = ServerCourse(cfg, outdir, progress=progress).build()
    try:
        return course.check_or_run(check_only)
    except KeyboardInterrupt:
        if course.monitor.started:
            print(interrupted_message(course, command), file=sys.stderr)
        raise
