"""What the server receives on an admitted stream: frames, reassembled into messages, checked
and decoded (a large one off the event loop), then handed to the course's scheduler.

`Inbound` is a part of `GrpcServerComm` (comm/grpc_server.py), which owns the sessions, the
loop and the limits these methods read; the stream's writer is there too.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from fedcore.comm.allocator import trim
from fedcore.comm.chunking import Reassembler
from fedcore.comm.handover import Arrival, Batch, Lost
from fedcore.comm.sessions import Session
from fedcore.comm.stream import parse_frame
from fedcore.comm.turns import TURN_BYTES
from fedcore.comm.validation import check_content
from fedcore.runtime.device import to_device
from fedcore.kernel.message import SERVER_ID, Message
from fedcore.wire.serialization import WireError, decode_envelope, from_value
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.census import check_values
from fedcore.wire.spooled import release_view

log = logging.getLogger("fedcore.deploy")

# Received messages above this many bytes are decoded on a worker thread, not the event loop.
DECODE_OFF_LOOP = 256 * 1024


class StreamStatus:
    """What one stream's reader and writer share: its reassembler, whether it ended and why."""

    __slots__ = ("done", "error", "resend", "give_up_turn", "reasm", "task", "turn")

    def __init__(self, reasm: Reassembler) -> None:
        self.done = False
        self.error: str | None = None    # the stream is refused (INVALID_ARGUMENT)
        self.resend: str | None = None   # its message is to be sent again (UNAVAILABLE)
        self.give_up_turn = None         # ends the stream for a message too slow to keep the turn
        self.reasm = reasm
        self.task = asyncio.current_task()   # the call's own task
        # the turn of the large message being received (comm/turns.py): once the message is
        # whole it passes to what handles it (its decoding, then its delivery), which gives it back
        self.turn: object | None = None


class Inbound:
    """The reading half of the server's streams."""

    async def _read(self, s: Session, context, status: StreamStatus) -> None:
        """Reader of one stream: frames -> messages -> scheduler events."""
        reasm = status.reasm
        try:
            while True:
                raw = await context.read()
                if raw is grpc.aio.EOF:
                    reasm.end_of_stream()
                    break
                s.last_seen = time.monotonic()
                more = await self._take(s, parse_frame(raw, self.max_frame), status)
                raw = None   # not kept while waiting for the next frame: a fleet waits at once
                if not more:   # the client left: its other calls end with this one
                    s.end_calls(keep=status.task)
                    break
        except WireError as exc:
            status.error = str(exc)
            self.quiet("malformed message", f"client {s.client_id} ({s.peer}): refused a message: {exc}")
            with self._lock:  # a peer that broke the protocol ends its session: the id is free again
                ended = s.state == "live"
                if ended:
                    s.state = "lost"
            if ended:
                s.end_calls(keep=status.task)   # this one ends itself, telling the peer why
                self._hand_over(Lost(self, s.client_id, f"refused: {str(exc)[:200]}"))
        except asyncio.CancelledError:
            pass   # the stream's writer ended the call
        except Exception as exc:  # the stream broke (RpcError, cancellation): the session may come back
            log.debug("client %d: stream ended: %s", s.client_id, exc)
        finally:
            status.done = True
            self._turns.give_back(status.turn)
            reasm.drop()
            s.receiving = False
            s.outbox.wake()

    def _hand_over(self, event) -> None:
        """Queue `event` for the course's scheduler thread (on the loop). Events gathered while
        the loop runs one pass go over together, in order: waking the scheduler thread once per
        pass instead of once per message spares both threads (they share one interpreter lock)."""
        self._handover.append(event)
        if len(self._handover) == 1:
            self._loop.call_soon(self._flush_handover)

    def _flush_handover(self) -> None:
        events, self._handover = self._handover, []
        self.scheduler.call_soon(events[0] if len(events) == 1 else Batch(events, self.scheduler))

    async def _take(self, s: Session, frame: pb.Frame, status: StreamStatus) -> bool:
        """One frame from `s`'s stream; False once the stream is to end (the client left)."""
        reasm = status.reasm
        kind = frame.WhichOneof("kind")
        if kind == "chunk":
            if frame.chunk.offset == 0 and frame.chunk.total_size >= TURN_BYTES:
                status.turn = object()   # this message's own: the stream's next one takes another
                await self._turns.take(status.turn, lambda: setattr(s, "last_seen", time.monotonic()),
                                       # judged only while a large message is being received:
                                       # not a small one after it, while it is being handled
                                       functools.partial(reasm.progress, TURN_BYTES), status.give_up_turn)
            data = reasm.feed(frame.chunk)
            s.receiving = reasm.in_progress
            if data is None:
                return True
            # the turn is this message's only if it took one: a small message's delivery comes
            # after the stream may have taken the turn for its next, large one
            turn = None
            if len(data) >= TURN_BYTES:
                turn, status.turn = status.turn, None
            if frame.chunk.message_id <= s.last_delivered:
                self.quiet("duplicate message", f"client {s.client_id}: dropped message "
                           f"{frame.chunk.message_id}, already received", logging.INFO)
                self._turns.give_back(turn)
                return True  # sent again after a reconnect; we already have it
            if len(data) >= TURN_BYTES:   # decoded off the loop; the frames' leftovers given back
                msg = await self._decode_in_turn(s, data, turn)
            elif len(data) > DECODE_OFF_LOOP:   # decoding a large model would hold up other clients
                msg = await asyncio.get_running_loop().run_in_executor(self._decoder, self._decode, s, data)
            else:
                msg = self._decode(s, data)
            s.last_delivered = frame.chunk.message_id
            self._hand_over(Arrival(self, msg, len(data), turn, s))
        elif kind == "bye":
            with self._lock:
                if s.state == "live":
                    s.state = "left"
            self._hand_over(Lost(self, s.client_id, f"left: {frame.bye.reason[:200]}"))
            return False
        elif kind == "welcome":
            raise WireError("a client sent a server's welcome frame")
        return True

    async def _decode_in_turn(self, s: Session, data, turn: object) -> Message:
        """`_decode_large` on a worker thread, the message's turn held until it is done: given
        back here if it fails, or once the thread is done if the stream ends meanwhile (the
        message is in memory until then), else by the message's delivery."""
        job = self._decoder.submit(self._decode_large, s, data)
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda _: self._on_loop(self._turns.give_back, turn))
            raise
        except BaseException:
            self._turns.give_back(turn)
            raise

    def _decode_large(self, s: Session, data: bytearray) -> Message:
        """`_decode`, then the heaps' free pages go back before the update is folded (allocator.py),
        and so do a spooled message's pages that decoding read (its headers, the small tensors it
        copied: about a megabyte an update otherwise, that a round keeping its list would hold)."""
        msg = self._decode(s, data)
        trim()
        release_view(data)
        return msg

    def _decode(self, s: Session, data: bytes) -> Message:
        check_values(data, self.max_values)   # before protobuf builds anything
        env = decode_envelope(data, consume=True)   # large tensors view the received bytes
        if env.sender != s.client_id:
            raise WireError(f"envelope sender {env.sender} is not this stream's client {s.client_id}")
        if list(env.receivers) != [SERVER_ID]:
            raise WireError(f"envelope receivers {list(env.receivers)[:4]} are not the server")
        if env.msg_type not in self.accepts:
            raise WireError(f"unknown message type '{env.msg_type[:64]}'")
        try:
            content = to_device(from_value(env.content), self.device)
        except WireError:
            raise
        except Exception as exc:
            raise WireError(f"content does not decode: {type(exc).__name__}: {exc}") from None
        problem = check_content(env.msg_type, content, self.server)
        if problem:
            raise WireError(problem)
        return Message(env.msg_type, env.sender, (SERVER_ID,), env.round, env.timestamp, content, owned=True)
