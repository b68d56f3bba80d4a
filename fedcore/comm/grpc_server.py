"""The server's communicator: clients dial in, each holds one bidirectional stream.

Each stream is authenticated from its call metadata before anything is read
(a wrong or missing token gets UNAUTHENTICATED; a second session for an id
whose session is alive gets ALREADY_EXISTS; a client whose course-defining
config differs gets FAILED_PRECONDITION naming the keys), is told its client
id in a `Welcome`, then carries chunked envelopes both ways plus heartbeats.
Bytes that do not decode, fail their integrity check, exceed a limit, stall,
name an unknown message type or carry content of the wrong shape end that
stream with INVALID_ARGUMENT; the server itself keeps serving. Metrics are
kept only as answers to the evaluations the server asked for. Received
messages become events on the server's wall-clock scheduler; handlers never
see gRPC. Refusals are counted and logged at most once per kind every few
seconds.

The server runs on `grpc.aio`: each stream is two coroutines (its writer and
its reader) on one event loop in one thread, so a connected client costs a
few kilobytes and no thread, and a small machine holds a fleet. The course's
scheduler thread only queues messages into the sessions' outboxes; a large
received message is decoded off the loop, so it never delays other clients.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
import threading
import time
from concurrent import futures
from typing import Any, Callable

import grpc

from fedcore.runtime.quiet import QuietLog
from fedcore.comm.allocator import release_large_blocks
from fedcore.comm.ask_pacing import AskPacer
from fedcore.comm.async_outbox import wake_all
from fedcore.comm.connections import HELD_MAX, ConnectionGuard, address_cap, connection_cap
from fedcore.comm.chunking import FRAME_OVERHEAD, Reassembler, SharedContent, first_chunk_size
from fedcore.comm.handover import Arrival
from fedcore.comm.server_inbound import Inbound, StreamStatus
from fedcore.comm.sessions import OPEN_PER_ID, CallAdmission, Refused, Session
from fedcore.comm.stream import (REFUSED, RESEND, allowed_silence, grpc_options, heartbeat_frame, host_port, read_token,
                                 read_tokens, server_credentials, check_tls_files)
from fedcore.comm.metrics_gate import MetricsGate
from fedcore.comm.turns import TURN_BYTES, Turns
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.message import SERVER_ID, Message
from fedcore.runtime.device import CPU
from fedcore.wire.serialization import encode_value
from fedcore.wire.codec import encode_value_parts
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.census import values_bound

__all__ = ["GrpcServerComm", "Session"]

log = logging.getLogger("fedcore.deploy")


# Seconds an expired session's calls have to end by themselves before they are cancelled.
EXPIRED_GRACE = 1.0


class GrpcServerComm(CallAdmission, Inbound):
    """Listens, admits and authenticates clients, and moves messages between them and the server."""

    device = CPU   # where received tensors are put; the course sets its own device

    def __init__(self, cfg, scheduler, count_bytes: Callable[[Message, int, int], None],
                 on_lost: Callable[[int, str], None], after_delivery: Callable[[], None] = lambda: None):
        d = cfg.section("distribute")
        self.cfg = cfg
        self.scheduler = scheduler
        self.count_bytes = count_bytes
        self.on_lost = on_lost            # called on the scheduler thread
        self.after_delivery = after_delivery
        # the ids admitted: the clients, and in a tree (topology.edges) the edges numbered after them
        self.num_clients = cfg["federate.client_num"] + (cfg.get("topology.edges") or 0)
        self.host, self.port = d["server_host"], d["server_port"]
        self.insecure = d["insecure"]
        self.tls = {k: d.get(f"tls.{k}") for k in ("cert", "key", "ca")}
        if not self.insecure:
            check_tls_files(self.tls, server=True)
        self.token = read_token(d)
        self.tokens = read_tokens(d, self.num_clients)
        self.chunk_size = d["chunk_size"]
        self.spool_at = d["spool_bytes"] or None   # messages this large arrive into a file
        self.spool_dir = d["spool_dir"]            # None: the system's temporary folder
        self.max_message = d["max_message_bytes"] or 1024 ** 3  # the course sets a derived bound
        self.max_values = d["max_message_values"] or values_bound(256, self.num_clients)  # and here
        self.max_frame = self.chunk_size + FRAME_OVERHEAD
        self.hb_interval, self.hb_timeout = d["heartbeat_interval"], d["heartbeat_timeout"]
        self.min_rate = d["min_bytes_per_second"]
        self.first_size = first_chunk_size(self.chunk_size, self.hb_timeout, self.min_rate)
        self.quiet = QuietLog(log)        # refusals by kind: counted, logged now and then
        self.quiet_info = QuietLog(log)   # routine lines a peer could repeat at will
        self.metrics_gate = MetricsGate(self.quiet)
        self.server_session = secrets.token_hex(8)
        self.resumed_round = 0            # told in every welcome: the round a resumed course left
        self.sessions: dict[int, Session] = {}
        self._ids = itertools.count(1)    # message ids keep increasing across a client's sessions
        self._lock = threading.Lock()
        self.server = None                # the Server worker
        self.accepts: set[str] = set()    # message types the server has handlers for
        self._grpc: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None   # the server's event loop, once started
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._decoder: futures.ThreadPoolExecutor | None = None
        self._turns: Turns | None = None    # large messages are buffered one at a time (turns.py)
        self._pacer: AskPacer | None = None   # pauses after calls of closed connections (ask_pacing.py)
        self._grace = 1.0
        self._handover: list = []         # events for the scheduler, gathered on the loop
        self._open: dict[int, int] = {}   # client id -> its calls still running (under _lock)
        self._admitted_peers: dict = {}   # `peer_key` -> ids of the sessions admitted on that connection
        # (client id, returning: the same process back after its session was lost), on the scheduler thread
        self.on_new_session: Callable[[int, bool], None] = lambda client_id, returning: None
        self.update_gate: Callable[[Message], bool] = lambda msg: True       # False: dropped unseen

    # ------------------------------------------------------------ lifecycle
    def attach(self, worker) -> None:
        self.server = worker
        self.accepts = {e[len("receiving_"):] for e in worker.handlers.entries if e.startswith("receiving_")}

    def start(self) -> int:
        """Bind and serve on the server's own event-loop thread; returns the port (useful with
        distribute.server_port: 0)."""
        release_large_blocks()   # freed model-sized buffers leave the process (comm/allocator.py)
        bound: futures.Future = futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(bound,), name="fedcore-grpc", daemon=True)
        self._thread.start()
        self.port = bound.result()   # raises the ConfigError of a port that cannot be bound
        return self.port

    def _serve(self, bound: futures.Future) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(loop, bound))
        except BaseException as exc:  # noqa: BLE001 - whatever stops the loop must reach start()
            if not bound.done():
                bound.set_exception(exc)
            else:
                log.error("gRPC server loop ended: %s: %s", type(exc).__name__, exc)
        finally:
            self._loop = None
            _finish_tasks(loop)
            loop.close()

    async def _main(self, loop: asyncio.AbstractEventLoop, bound: futures.Future) -> None:
        slots = self.num_clients + 16   # streams: one per client, a few for refusals in flight
        # A whole fleet may dial at once: calls not yet taken by the loop wait in gRPC's backlog
        # (whose default limits, 1,000 soft and 3,000 hard, would refuse most of a burst).
        backlog = [("grpc.server.max_pending_requests", max(1000, slots)),
                   ("grpc.server.max_pending_requests_hard_limit", max(3000, 2 * slots))]
        cap = connection_cap(self.cfg["distribute.max_connections"])
        if cap is not None:   # below the descriptor limit: the server's own files always open
            backlog.append(("grpc.max_allowed_incoming_connections", cap))
        calls = OPEN_PER_ID * self.num_clients + 16
        # A header flood or rapid reset queues at most this many calls per connection (gRPC
        # refuses the rest itself); by default as many as the server ever runs, since clients
        # in one process share one connection.
        streams = self.cfg["distribute.max_streams_per_connection"] or calls
        backlog.append(("grpc.max_concurrent_streams", streams))
        window = self.cfg["distribute.stream_window"]
        if window and self.max_message >= TURN_BYTES:
            # fixed where uploads take turns (comm/turns.py): gRPC's bandwidth probe grows it to
            # ~8 MB, which each waiting client fills (memory growing with clients); a course of
            # small messages keeps the probe (with it fixed, a flood of refused calls halved the
            # course's rate: tests/test_deploy_availability.py)
            backlog += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", window)]
        if self.cfg["distribute.pause_after_closed_calls"]:
            # before the server starts: its first ask for a call goes through the pacer's task factory
            self._pacer = AskPacer(loop)
            self._pacer.install()
        server = grpc.aio.server(options=grpc_options(self.chunk_size, server=True) + backlog,
                                 # with room of their own for refused calls held (comm/connections.py)
                                 maximum_concurrent_rpcs=calls + HELD_MAX)
        handler = grpc.method_handlers_generic_handler(
            "fedcore.Fedcore", {"Connect": grpc.stream_stream_rpc_method_handler(self._connect)})
        # every other method is refused here, not by gRPC itself: gRPC's own UNIMPLEMENTED
        # never reaches the guard, so calls to a made-up method kept their connection open
        server.add_generic_rpc_handlers((handler, _Unknown(self._unknown)))
        address = host_port(self.host, self.port)
        try:
            if self.insecure:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, server_credentials(self.tls))
        except RuntimeError as exc:   # gRPC's "Failed to bind ...; set GRPC_VERBOSITY=debug ..."
            port = 0
            why = "already in use, or not an address of this machine" if "bind" in str(exc) else str(exc)
        else:
            why = "address in use or not local"
        if not port:
            bound.set_exception(ConfigError(f"distribute.server_port: cannot listen on {address} ({why}); "
                                            "pick a free port or another distribute.server_host"))
            return
        await server.start()
        if self._pacer is not None and not self._pacer.engaged:
            log.warning("distribute.pause_after_closed_calls: this gRPC version (%s) asks for its calls in a "
                        "way the server cannot pause; it takes them as fast as they come", grpc.__version__)
        self._loop, self._stopping, self._grpc = loop, asyncio.Event(), server
        self._closer = ConnectionGuard(loop, self._admitted_on,
                                       address_cap(self.cfg["distribute.max_connections_per_address"], cap),
                                       goaway=self.insecure, streams=streams)
        self._decoder = futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="fedcore-decode")
        self._turns = Turns(self.cfg["distribute.turn_bytes_per_second"])
        bound.set_result(port)
        try:
            await self._stopping.wait()
            await server.stop(self._grace)
        finally:
            self._decoder.shutdown(wait=False, cancel_futures=True)

    def stop(self, grace: float = 1.0) -> None:
        """Stop serving: streams get `grace` seconds to finish what they are writing."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._grace = grace
        with self._lock:
            sessions = list(self.sessions.values())
        try:
            loop.call_soon_threadsafe(self._stopping.set)
        except RuntimeError:   # the loop already closed
            pass
        wake_all(s.outbox for s in sessions)
        thread.join(grace + 5.0)
        self._thread = None

    # ------------------------------------------------------------ what the course asks
    def live_ids(self, joined: set[int] | None = None, joining: bool = False) -> list[int]:
        """Ids of clients whose session is alive (and, if given, that have joined: are in
        `joined` and, unless `joining`, their process has sent its own join_in)."""
        with self._lock:
            ids = [c for c, s in self.sessions.items()
                   if s.state == "live" and (joined is None or (c in joined and (joining or not s.joining)))]
        return sorted(ids)

    def describe(self) -> dict[str, Any]:
        """Per-client connection facts for the summary."""
        with self._lock:
            return {str(c): {"state": s.state, "streams": s.streams}
                    for c, s in sorted(self.sessions.items())}

    def expire(self, timeout: float) -> list[tuple[int, str]]:
        """Mark sessions silent for longer than `timeout` (longer while one of their messages is
        half-received) as lost; returns (id, reason) for each."""
        now = time.monotonic()
        lost = []
        with self._lock:
            for cid, s in self.sessions.items():
                allowed = allowed_silence(timeout, s.receiving, self.chunk_size, self.min_rate)
                if s.state == "live" and now - s.last_seen > allowed:
                    s.state = "lost"
                    s.outbox.clear()
                    s.outbox.wake()
                    lost.append((cid, f"no heartbeat for {allowed:g}s (distribute.heartbeat_timeout)"))
                    self._on_loop(self._end_expired, s)
        return lost

    def _end_expired(self, s: Session) -> None:
        """On the loop: an expired session's stream, woken, ends by itself, so its peer hears the
        end and redials at once (a cancelled call sends the peer nothing: it would wait out its own
        heartbeat timeout). A call whose write waits on a peer that stopped reading cannot end by
        itself: after `EXPIRED_GRACE` seconds whatever is left is cancelled."""
        self._loop.call_later(EXPIRED_GRACE, s.end_calls)

    def _on_loop(self, fn, *args) -> None:
        """Run `fn(*args)` on the server's loop from any thread; nothing once it has stopped."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:   # the loop already closed
                pass

    def tell(self, client_id: int, msg_type: str, round_: int, content: Any) -> None:
        """Queue a notice for one client (what the server did with what it sent), outside the
        course's messages and byte counts."""
        with self._lock:
            s = self.sessions.get(client_id)
        if s is None or s.state != "live":
            return
        header = pb.Envelope(msg_type=msg_type, sender=SERVER_ID, receivers=[client_id], round=round_)
        parts, sha = SharedContent(encode_value(content)).envelope(header)
        s.outbox.put_message(parts, sha)

    # ------------------------------------------------------------ sending
    def send(self, msg: Message) -> None:
        """Queue `msg` for each receiver's stream: the content is encoded and hashed once for
        all of them; only each receiver's small envelope header is its own."""
        shared = SharedContent(encode_value_parts(msg.content))   # a model's tensors are not copied
        self.metrics_gate.sent(msg)
        woken = []
        for receiver in msg.receivers:
            if receiver == SERVER_ID:
                self.scheduler.call_soon(Arrival(self, msg, 0))
                continue
            with self._lock:
                s = self.sessions.get(receiver)
            if s is None or s.state != "live":
                log.info("message '%s' to client %d not sent: client not connected", msg.msg_type, receiver)
                continue
            header = pb.Envelope(msg_type=msg.msg_type, sender=msg.sender, receivers=[receiver],
                                 round=msg.round, timestamp=msg.timestamp)
            parts, sha = shared.envelope(header)
            s.outbox.put_message(parts, sha, notify=False)
            woken.append(s.outbox)
            self.count_bytes(msg, receiver, sum(len(p) for p in parts))
        wake_all(woken)

    # ------------------------------------------------------------ one stream
    async def _connect(self, request_iterator, context) -> None:
        """The Connect RPC: admit, welcome, then write the session's outbox until the stream ends
        while a second coroutine reads what the client sends.

        Frames go through `context.write` and `context.read` rather than a response generator
        and the request iterator, which would each keep the last frame alive while waiting for
        the next: two model-sized buffers per idle client, gigabytes in a fleet."""
        peer = context.peer()
        try:
            s, token = self._admit(context)
        except Refused as refused:
            # admitted first: a peer is its address and port, which a new connection may reuse
            # right after the guard closed one (a client sharing the attacker's address was
            # kept out); a call that carries what admits it is never held for another's refusals
            if await self._ended_unread(peer):
                return                       # nothing to answer
            if self._closer.refused(peer):   # a refused call does not keep its connection
                await self._closer.hold(peer)
            await context.abort(refused.code, refused.detail, REFUSED)
        task = asyncio.current_task()
        s.calls.add(task)
        try:
            await self._stream(s, token, context)
        finally:
            if task in s.calls:   # not already taken off the count by a later admission
                s.calls.discard(task)
                with self._lock:
                    left = self._open.pop(s.client_id) - 1
                    if left:
                        self._open[s.client_id] = left

    async def _ended_unread(self, peer: str) -> bool:
        """Whether a refused call from `peer` was queued on a connection closed for its
        refusals: then it is held until the close ends it, unanswered, and the server's asks
        for further calls wait 1 ms meanwhile, so gRPC drops that connection's others itself."""
        if not self._closer.closing(peer):
            return False
        if self._pacer is not None:
            self._pacer.wasted()
        await self._closer.hold(peer)
        return True

    async def _unknown(self, method: str, request_iterator, context) -> None:
        """A call to a method the server does not serve: refused like a call without a token
        (counted, logged now and then, its connection closed unless a live session uses it)."""
        peer = context.peer()
        if await self._ended_unread(peer):
            return
        self.quiet("unknown method", f"refused {peer}: unknown method {method[:80]!r}")
        if self._closer.refused(peer):
            await self._closer.hold(peer)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method", REFUSED)

    async def _stream(self, s: Session, token, context) -> None:
        """An admitted stream: the welcome, then the outbox's frames, until the stream ends."""
        status = StreamStatus(Reassembler(self.max_message, self.chunk_size, self.spool_at, self.spool_dir))
        reader = asyncio.get_running_loop().create_task(self._read(s, context, status))

        def alive() -> bool:
            if status.done or s.state != "live" or context.done() or self._stopping.is_set():
                return False
            stalled = status.reasm.stalled(self.hb_timeout, self.min_rate)
            if stalled:  # a half-sent message holds memory: it must keep coming at a minimum rate
                status.error = stalled
                status.reasm.drop()
                self.quiet("stalled message", f"client {s.client_id} ({s.peer}): refused a message: {stalled}")
                return False
            return status.resend is None

        def give_up_turn(why: str) -> None:
            """On the loop, from a stream waiting for the turn this one's message is too slow
            to keep: the message comes again (the session stays), behind the waiting ones."""
            if status.done or status.resend is not None:
                return
            status.resend = why
            # its client was sending, not silent: its heartbeats wait behind the message on a
            # slow link, so it gets a whole heartbeat_timeout from now to dial again
            s.last_seen = time.monotonic()
            status.reasm.drop()
            self._turns.give_back(status.turn)
            reader.cancel()
            s.outbox.wake()
            self.quiet("turn taken back", f"client {s.client_id} ({s.peer}): message {why}")
        status.give_up_turn = give_up_turn

        try:
            await context.write(pb.Frame(welcome=pb.Welcome(
                client_id=s.client_id, server_session=self.server_session,
                max_chunk_bytes=self.chunk_size, resumed_round=self.resumed_round)).SerializeToString())
            async for frame in s.outbox.frames(token, alive, self.hb_interval, heartbeat_frame):
                await context.write(frame)
                frame = None   # not kept while the stream waits for its next message
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the call ended under a write (peer cancelled, connection gone)
            log.debug("client %d: stream ended while writing: %s: %s", s.client_id, type(exc).__name__, exc)
            return
        finally:
            s.outbox.release(token)
            reader.cancel()   # the call is ending: nothing more will be read from it
        if status.error is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status.error, REFUSED)
        if status.resend is not None:   # not a refusal: the client redials and sends it again
            await context.abort(grpc.StatusCode.UNAVAILABLE, status.resend, RESEND)


def _finish_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Before the loop closes: end the streams still waiting (a write held up by a peer that
    stopped reading) and close their frame generators, so no task or generator is destroyed
    pending (asyncio would log each as an error)."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    except Exception as exc:  # noqa: BLE001 - the server is stopping: say so, go on stopping
        log.debug("gRPC server loop: tasks left at stop: %s: %s", type(exc).__name__, exc)


class _Unknown(grpc.GenericRpcHandler):
    """Serves every method no other handler does, with `refuse(method, requests, context)`
    (bytes in, nothing out: nothing of the call is decoded)."""

    def __init__(self, refuse):
        self.refuse = refuse

    def service(self, details):
        method = details.method if isinstance(details.method, str) else repr(details.method)
        return grpc.stream_stream_rpc_method_handler(functools.partial(self.refuse, method))
