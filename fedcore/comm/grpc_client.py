"""A client's communicator: it dials the server and keeps one stream open.

No client listens on a port, so clients work behind NAT. A background thread
holds the stream; when it breaks, it redials with exponential backoff and
jitter, resuming the same session (queued messages are kept; a message cut
off mid-stream is sent again and the server drops the duplicate). A server
silent for `distribute.heartbeat_timeout` (longer while one of its messages is
half-received) counts as broken, as does a call with no welcome within it
(whether or not gRPC ever got a connection under the call): the call is
cancelled (and left behind, should gRPC never end it) and the server dialed
again on a new connection; a server unreachable for
`distribute.retry_timeout` ends the process with exit code 4 (not counting the time its
launcher says it is restarting that server, `fedcore.comm.restart_notice`). A server that
refuses a second session for this id (the previous process's session is
still alive) is tried again the same way; one that finds this client's
course config different ends it with exit code 2, naming the keys.

A client never dies because of what it was sent: a model or evaluation
request with non-finite values, or one its handlers cannot use (another
layout), is reported and skipped, and an update that came out non-finite is
reported and not sent; the client waits for the next. A server that welcomes
it under another id, or sends what no server may (data that does not decode,
a second welcome), is left and dialed again; one that never keeps a session
going is given up on after `distribute.retry_timeout`, as an absent one.

This module needs numpy, grpcio and protobuf, not torch: received tensors are
decoded into `tensor_form` (the form its trainer works in, see
`fedcore.wire.tensor_forms`), and tensors of any registered form are sent.
"""
from __future__ import annotations

import logging
import queue
import random
import secrets
import threading
import time
from typing import Callable, Iterator

import grpc

from fedcore.comm.client_inbound import MESSAGE, ClientInbound, ClientStream
from fedcore.comm.allocator import release_large_blocks
from fedcore.comm.call_reader import CallReader
from fedcore.comm.chunking import FRAME_OVERHEAD, Reassembler, SharedContent, first_chunk_size
from fedcore.comm.fingerprint import fingerprint
from fedcore.comm.restart_notice import server_restarting
from fedcore.comm.turns import TURN_BYTES
from fedcore.comm.handover import Delivery, Raise
from fedcore.comm.stream import (METHOD, MD_CLIENT_ID, MD_COURSE, MD_REFUSED, MD_RESEND, MD_SESSION, MD_TOKEN, Outbox,
                                 allowed_silence, bye_frame, channel_credentials, grpc_options,
                                 heartbeat_frame, host_port, parse_frame, read_token, check_tls_files)
from fedcore.kernel.errors import EXIT_SERVER_GONE, ConfigError, FedcoreError
from fedcore.kernel.message import SERVER_ID, Message
from fedcore.runtime.quiet import QuietLog
from fedcore.wire.tensor_forms import first_nonfinite, get_form
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.census import values_bound
from fedcore.wire.codec import WireError, encode_value_parts

__all__ = ["GrpcClientComm", "ServerUnreachable", "EXIT_SERVER_GONE", "backoff_delay"]

log = logging.getLogger("fedcore.deploy")

EARLY_BOUND = 2 ** 20   # bytes of a message before the course's model is known


class ServerUnreachable(FedcoreError):
    """The server was gone for longer than distribute.retry_timeout."""

    exit_code = EXIT_SERVER_GONE


class ProtocolRefused(FedcoreError):
    """The server refused what this client sent (INVALID_ARGUMENT after joining)."""


def backoff_delay(attempt: int, initial: float, maximum: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d], d = min(maximum, initial * 2^attempt)."""
    d = min(maximum, initial * (2 ** min(attempt, 30)))
    return rng.uniform(d / 2, d)


class GrpcClientComm(ClientInbound):
    """Connects, gets the client id, and moves messages between the client worker and the server."""

    def __init__(self, cfg, scheduler, tensor_form: str = "torch", bounds_from_course: bool = False):
        """`bounds_from_course`: read nothing past the welcome until `set_bounds` (a course's
        client, whose bounds come from its model); otherwise the configured bounds (or 1 GiB)."""
        d = cfg.section("distribute")
        self.cfg = cfg   # the process's own (a course's client drops outdir from its course's)
        self.scheduler = scheduler
        self.tensor_form = get_form(tensor_form).name  # received tensors are decoded into it
        self.device = None   # a torch device to put received tensors on (the course sets it)
        self.address = host_port(d['server_host'], d['server_port'])
        self.insecure = d["insecure"]
        self.tls = {k: d.get(f"tls.{k}") for k in ("cert", "key", "ca")}
        if not self.insecure:
            check_tls_files(self.tls, server=False)
        self.server_name = d["tls.server_name"]
        self.chunk_size = d["chunk_size"]
        # a course's client: bounds from its model, once built (`set_bounds`); nothing past the
        # welcome is read before, so a server cannot make it take a message its course cannot need
        self.max_message = d["max_message_bytes"] or (EARLY_BOUND if bounds_from_course else 1024 ** 3)
        self.max_values = d.get("max_message_values") or (values_bound(0, 0) if bounds_from_course else None)
        self._bounded = threading.Event()
        if not bounds_from_course:
            self._bounded.set()
        self.hb_interval, self.hb_timeout = d["heartbeat_interval"], d["heartbeat_timeout"]
        self.min_rate = d["min_bytes_per_second"]
        self.retry_timeout = d["retry_timeout"]
        self.requested_id, self.num_clients = d["client_id"] or 0, cfg.get("federate.client_num")
        self.backoff = (d["backoff_initial"], d["backoff_max"])
        self.metadata = [(MD_CLIENT_ID, str(d["client_id"] or 0)), (MD_SESSION, secrets.token_hex(8)),
                         (MD_COURSE, fingerprint(cfg))]
        token = read_token(d)
        if token:
            self.metadata.append((MD_TOKEN, "Bearer " + token))
        first = first_chunk_size(self.chunk_size, self.hb_timeout, self.min_rate)
        self.outbox = Outbox(self.chunk_size, first_size=first)
        self.client_id: int | None = None
        self.server_session: str | None = None
        self.on_new_server: Callable[[], None] | None = None  # a restarted server: join again
        # welcomed again by the same server (a redial): join again, since a join that gRPC took
        # just before the stream ended is not sent again, and a server whose session for this
        # process was lost counts it as a member only from a join; one more changes nothing
        self.on_readmitted: Callable[[], None] | None = None
        self.worker = None
        self.fatal: FedcoreError | None = None
        self.connected = False
        self._welcomed = threading.Event()
        self._closing = threading.Event()
        self._last_delivered = 0
        self._early: list[Message] = []
        self._rng = random.Random()
        self._thread: threading.Thread | None = None
        self._stream: ClientStream | None = None
        self.quiet = QuietLog(log)   # per kind of unusable message, a line now and then
        self.refusals: list[tuple[int, str]] = []   # (round, why) of each update the server refused
        self.durable_state = None   # the course's client state on disk, once attached
        self.resumed_round = 0      # what the latest welcome said the server resumed from

    @property
    def who(self) -> str:
        """This client in log lines: the id the server gave it, else the one it asked for."""
        if self.client_id is not None:
            return str(self.client_id)
        return str(self.requested_id) if self.requested_id else "(no id yet)"

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        release_large_blocks()   # freed model-sized buffers leave the process (comm/allocator.py)
        self._thread = threading.Thread(target=self._loop, name="fedcore-client-io", daemon=True)
        self._thread.start()

    def wait_welcome(self) -> int:
        """Block until the server has admitted this client; returns its id (or raises why not)."""
        self._welcomed.wait()
        if self.fatal is not None:
            raise self.fatal
        return self.client_id

    def attach(self, worker) -> None:
        """Deliver to `worker` from now on (what came before too). A course's client keeps its
        state on its disk from here (`fedcore.comm.client_state`): last, so that its wrapper of the
        trainer sees every behaviour's."""
        self.worker = worker
        course = getattr(worker, "course", None)
        if getattr(course, "trainer", None) is not None:
            from fedcore.comm.client_state import keep_client_state
            self.durable_state = keep_client_state(course, self.cfg)
            if self.durable_state is not None and self.resumed_round:   # welcomed before attaching
                self.durable_state.resume_at(self.resumed_round)
        early, self._early = self._early, []
        for msg in early:
            self.scheduler.call_soon(Delivery(self, msg))

    def set_bounds(self, nbytes: int, values: int) -> None:
        """Refuse messages above `nbytes` or holding more than `values` values from now on, on
        the open stream too; until this is called nothing past the welcome is read."""
        self.max_message, self.max_values = nbytes, values
        stream = self._stream
        if stream is not None:
            stream.reasm.max_message = nbytes
        self._bounded.set()

    def _await_bounds(self, stream: ClientStream) -> None:
        """Hold the stream's next frame until the course has set this client's bounds (gRPC's
        flow control holds the server meanwhile, and heartbeats keep going both ways)."""
        while not self._bounded.wait(self.hb_interval) and not self._closing.is_set():
            stream.last_recv = time.monotonic()   # not reading on purpose: not a silent server

    @property
    def closed(self) -> bool:
        return self._closing.is_set()

    def close(self, reason: str = "finished", timeout: float = 3.0) -> None:
        """Say goodbye (if connected), let the stream drain, and stop the I/O thread."""
        self._closing.set()
        if self.connected and self.fatal is None:
            self.outbox.put_frame(bye_frame(reason))
            self.outbox.wait_empty(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
        stream = self._stream
        if stream is not None and stream.call is not None:
            stream.call.cancel()

    # ------------------------------------------------------------ sending
    def send(self, msg: Message) -> None:
        if tuple(msg.receivers) != (SERVER_ID,):
            raise WireError(f"in deployment a client sends only to the server, not to {msg.receivers}")
        if msg.msg_type == "updates":
            bad = first_nonfinite(msg.content)
            if bad is not None:
                log.warning("client %s: round %d: the update is not finite (%s): not sent; waiting "
                            "for the next round", self.who, msg.round, bad)
                return
        header = pb.Envelope(msg_type=msg.msg_type, sender=msg.sender, receivers=[SERVER_ID],
                             round=msg.round, timestamp=msg.timestamp)
        # an update's tensors are framed from where they lie, not from an encoded copy: what a
        # trainer sends is its own fresh tensors, never written again (Trainer.payload)
        parts, sha = SharedContent(encode_value_parts(msg.content)).envelope(header)
        self.outbox.put_message(parts, sha)

    # ------------------------------------------------------------ the connection loop
    def _channel(self) -> grpc.Channel:
        options = grpc_options(self.chunk_size, server=False)
        # gRPC's own reconnection backs off up to 120 s by default, answering every call meanwhile
        # with its last error: a server back after a long absence (a restart) would look gone for
        # that long. Its backoff follows the client's own (distribute.backoff_initial / _max).
        initial, most = (max(1, int(s * 1000)) for s in self.backoff)
        options += [("grpc.initial_reconnect_backoff_ms", initial),
                    ("grpc.max_reconnect_backoff_ms", max(initial, most))]
        if self.insecure:
            return grpc.insecure_channel(self.address, options=options)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.secure_channel(self.address, channel_credentials(self.tls), options=options)

    def _fail(self, err: FedcoreError) -> None:
        self.fatal = err
        self._welcomed.set()
        self.scheduler.call_soon(Raise(err))

    def _dial(self) -> tuple[grpc.Channel | None, Callable | None]:
        """A new channel and its stream method; (None, None), the failure reported, where the
        channel cannot be made (bad TLS files)."""
        try:
            channel = self._channel()
        except FedcoreError as exc:
            self._fail(exc)
            return None, None
        return channel, channel.stream_stream(METHOD)

    def _loop(self) -> None:
        channel, connect = self._dial()
        if channel is None:
            return
        attempt, last_ok, reason = 0, time.monotonic(), "not connected yet"
        held = ""   # why the server last refused this id while another session held it
        waited = False   # whether it said it waits for a server its launcher restarts
        # A working server is one that delivers messages. A welcomed stream's heartbeats count
        # too, but only on the first stream since the last message: a server that welcomes and
        # breaks the stream again and again without a round is given up on after retry_timeout.
        fresh = True
        stream = None
        try:
            while not self._closing.is_set():
                stream = ClientStream(Reassembler(self.max_message, self.chunk_size))
                token = self.outbox.claim()
                self._stream = stream
                answered = False   # whether the server's side of this call sent anything
                delivered = False
                try:
                    stream.call = connect(self._requests(token, stream), metadata=self.metadata)
                    for raw in self._responses(stream):
                        answered = True
                        if stream.welcomed and not self._bounded.is_set():
                            self._await_bounds(stream)
                        shown = self._on_frame(parse_frame(raw, self.chunk_size + FRAME_OVERHEAD), stream)
                        if shown:
                            stream.last_recv = time.monotonic()
                        delivered = delivered or shown == MESSAGE
                        if shown == MESSAGE or (shown and fresh):
                            last_ok, attempt, fresh, waited = stream.last_recv, 0, True, False
                    reason = "the server closed the stream"
                except _Silent:
                    reason = stream.why
                except grpc.RpcError as exc:
                    code = exc.code()
                    detail = (exc.details() or "").splitlines()[0][:200] if exc.details() else ""
                    if self._closing.is_set():
                        break
                    if code == grpc.StatusCode.FAILED_PRECONDITION:
                        self._fail(ConfigError(f"the server at {self.address} refused this client: "
                                               f"{detail}; start it with the server's config for these keys"))
                        return
                    if code == grpc.StatusCode.UNAUTHENTICATED:
                        self._fail(ConfigError(f"distribute.token: the server at {self.address} refused "
                                               f"this client (UNAUTHENTICATED: {detail}); check the token"))
                        return
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not answered \
                            and not _marked(exc, MD_REFUSED):
                        # gRPC's own limit on concurrent calls (a burst of connections, or
                        # streams of peers that stopped reading): the server is busy, not refusing
                        reason = f"server busy ({code.name}: {detail})"
                    elif code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                        if self.client_id is None:
                            self._fail(ConfigError(f"distribute.client_id: the server at {self.address} "
                                                   f"refused this client ({code.name}: {detail})"))
                        else:
                            self._fail(ProtocolRefused(f"the server refused a message from client "
                                                       f"{self.client_id} ({code.name}: {detail})"))
                        return
                    elif code == grpc.StatusCode.UNAVAILABLE and stream.large and _marked(exc, MD_RESEND):
                        # the server took back the turn of a large message of this client's, which
                        # it wants again: a working server (only one that ran a round gets a large
                        # update from this client), so retry_timeout starts again
                        reason = f"{code.name}: {detail}"
                        last_ok, attempt = time.monotonic(), 0
                    else:
                        reason = stream.why or f"{code.name}: {detail}"
                        if code == grpc.StatusCode.ALREADY_EXISTS:
                            if not held:
                                log.warning("client %s: the server refuses this id for now (%s); "
                                            "retrying until the other session ends", self.who, detail)
                            held = detail
                except Exception as exc:  # noqa: BLE001 - whatever the server's data did, not a dead thread
                    said = exc if isinstance(exc, (WireError, FedcoreError)) else f"{type(exc).__name__}: {exc}"
                    reason = f"bad data from the server: {said}"
                    log.error("client %s: %s", self.who, reason)
                    if stream.call is not None:
                        stream.call.cancel()
                finally:
                    stream.done = True
                    self.connected = False
                    self.outbox.release(token)
                    fresh = delivered
                if self._closing.is_set():
                    break
                if server_restarting():   # its launcher is bringing it back: not lost meanwhile
                    if not waited:
                        log.warning("client %s: the launcher is restarting the server; waiting for it "
                                    "(distribute.retry_timeout counts from when it is back)", self.who)
                    last_ok, waited = time.monotonic(), True
                gone = time.monotonic() - last_ok
                if gone >= self.retry_timeout:
                    self._fail(ServerUnreachable(
                        f"no server at {self.address} for {gone:.1f}s (distribute.retry_timeout="
                        f"{self.retry_timeout:g}); giving up; last error: {reason}"
                        + (f"; before, the server refused this client's id: {held} (another process "
                           "with the same distribute.client_id?)" if held else "")
                        + ("; the TLS handshake failed: is the server plaintext (distribute.insecure) "
                           "or its certificate from another authority?" if "handshake" in reason.lower() else "")
                        + ("; the server closed each connection at once: does it speak TLS, where this "
                           "client is plaintext (distribute.insecure)?" if self.insecure
                           and not self._welcomed.is_set() and "socket closed" in reason.lower() else "")))
                    return
                if stream.why:   # cancelled for silence: the connection under it is suspect; dial anew
                    _let_go(channel)
                    channel, connect = self._dial()
                    if channel is None:
                        return
                delay = min(backoff_delay(attempt, *self.backoff, self._rng),
                            max(0.05, self.retry_timeout - gone))
                attempt += 1
                if self._welcomed.is_set():
                    log.warning("client %s: connection to %s lost (%s); retrying in %.2fs",
                                self.who, self.address, reason, delay)
                else:   # never admitted: nothing was lost
                    log.warning("client %s: cannot reach the server at %s yet (%s); retrying in %.2fs",
                                self.who, self.address, reason, delay)
                self._closing.wait(delay)
        finally:
            if channel is None:   # a redial that could not make its channel: the old one is let go
                pass
            elif stream is not None and stream.why:
                _let_go(channel)
            else:
                channel.close()

    def _requests(self, token, stream: ClientStream):
        """The request side of one stream: queued frames, or a heartbeat when idle."""
        def alive() -> bool:
            return not stream.done and not (self._closing.is_set() and not self.connected)

        def on_message(size: int) -> None:
            stream.large = stream.large or size >= TURN_BYTES

        # messages go once the server has welcomed this stream: one it refuses would take them with it
        yield from self.outbox.frames(token, alive, self.hb_interval, heartbeat_frame, on_message,
                                      ready=lambda: stream.welcomed)

    def _responses(self, stream: ClientStream) -> Iterator[bytes]:
        """The call's frames, until its end; raises _Silent (the call cancelled and left behind)
        once the server has sent nothing for too long: no welcome, no frame. Read on a thread of
        their own: a cancelled call may never end in gRPC (`fedcore.comm.call_reader`)."""
        reader = CallReader(stream.call, name="fedcore-client-read")
        try:
            reader.ask()
            while True:
                try:
                    raw = reader.take(self.hb_interval)
                except queue.Empty:
                    raw = _WAITING
                allowed = allowed_silence(self.hb_timeout, stream.reasm.in_progress, self.chunk_size, self.min_rate)
                if time.monotonic() - stream.last_recv > allowed:
                    stream.why = (f"server silent for {allowed:g}s (distribute.heartbeat_timeout)"
                                  if stream.welcomed else f"no welcome from the server within {allowed:g}s")
                    log.warning("client %s: %s; reconnecting", self.who, stream.why)
                    stream.call.cancel()
                    raise _Silent(stream.why)
                if raw is None:
                    return
                if raw is not _WAITING:
                    yield raw
                    reader.ask()
        finally:
            reader.ask()   # a reader waiting to be asked reads the call's end, and stops


_WAITING = object()   # no frame yet


def _let_go(channel: grpc.Channel) -> None:
    """Close `channel` on a thread of its own: closing waits for its calls to end, and a
    cancelled call that gRPC never ends would hold the caller for ever."""
    threading.Thread(target=channel.close, name="fedcore-client-close", daemon=True).start()


class _Silent(Exception):
    """The server said nothing on a call for longer than it may."""


def _marked(exc: grpc.RpcError, key: str) -> bool:
    """Whether fedcore's server ended the call with `key` in its trailing metadata (MD_REFUSED:
    it refused the call itself, rather than gRPC on its behalf; MD_RESEND: it wants the large
    message in progress again)."""
    try:
        return any(k == key for k, _ in exc.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - an error without a call's metadata was not the server's
        return False
