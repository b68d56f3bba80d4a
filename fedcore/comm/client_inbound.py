"""What a deployed client receives from its server: the welcome, checked against the id the
client asked for, then messages, reassembled, bounded, decoded and handed to its scheduler.

`ClientInbound` is a part of `GrpcClientComm` (comm/grpc_client.py), which dials, redials and
sends; these methods read its state (its id, bounds, scheduler, worker).
"""
from __future__ import annotations

import logging
import time

from fedcore.comm.chunking import Reassembler
from fedcore.comm.handover import Delivery
from fedcore.comm.stream import REFUSED_NOTICE
from fedcore.kernel.message import Message
from fedcore.wire.tensor_forms import first_nonfinite
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.census import check_values
from fedcore.wire.codec import WireError, decode_envelope, from_value

log = logging.getLogger("fedcore.deploy")

ALIVE, MESSAGE = 1, 2   # what a frame showed of the server: a live session, a delivered message


class ClientStream:
    """One call to the server as this client sees it: its reassembler, whether the server
    welcomed it, when it last heard from it."""

    __slots__ = ("done", "last_recv", "call", "reasm", "welcomed", "why", "large")

    def __init__(self, reasm: Reassembler):
        self.done = False
        self.large = False   # whether a message that takes turns (turns.TURN_BYTES) went out on it
        self.last_recv = time.monotonic()   # the last frame after the welcome (or the dial)
        self.call = None
        self.reasm = reasm
        self.welcomed = False
        self.why = ""   # why this client cancelled the call, if it did


class ClientInbound:
    """The receiving half of a client's stream."""

    def _on_frame(self, frame: pb.Frame, stream: ClientStream) -> int:
        """Take one frame; what it shows of the server: MESSAGE (a message delivered), ALIVE
        (any other good frame after this stream's welcome) or 0 (the welcome itself, or a frame
        before it). What no server may send raises WireError."""
        kind = frame.WhichOneof("kind")
        if kind == "welcome":
            self._welcome(frame.welcome, stream)
            return 0
        if not stream.welcomed:
            if kind == "chunk":
                raise WireError("the server sent a message before its welcome")
            return 0   # a heartbeat, or a goodbye, from a server that has not admitted us
        if kind == "chunk":
            data = stream.reasm.feed(frame.chunk)
            if data is None:
                return ALIVE   # a message under way (a slow link may take minutes over one)
            if frame.chunk.message_id <= self._last_delivered:
                return ALIVE
            if self.max_values is not None:
                check_values(data, self.max_values)   # before protobuf builds anything
            env = decode_envelope(data, consume=True)   # large tensors view the received bytes
            content = from_value(env.content, self.tensor_form)
            if self.device is not None:
                from fedcore.runtime.device import to_device
                content = to_device(content, self.device)
            msg = Message(env.msg_type, env.sender, tuple(env.receivers), env.round, env.timestamp,
                          content)
            self._last_delivered = frame.chunk.message_id
            if msg.msg_type == REFUSED_NOTICE:
                self._refused(msg)
                return MESSAGE
            bad = first_nonfinite(msg.content)
            if bad is not None:
                log.warning("client %s: round %d: the server's '%s' is not finite (%s): skipped; "
                            "waiting for the next", self.who, msg.round, msg.msg_type, bad)
                return MESSAGE
            if self.worker is None:
                self._early.append(msg)
            else:
                self.scheduler.call_soon(Delivery(self, msg))
        elif kind == "bye":
            log.warning("client %s: the server is leaving (%s)", self.who, frame.bye.reason)
            return ALIVE
        return MESSAGE if kind == "chunk" else ALIVE

    def _refused(self, msg: Message) -> None:
        """The server did not aggregate this client's update of a round: say so now (and, by
        `refusals`, in the exit status)."""
        why = msg.content.get("why") if isinstance(msg.content, dict) else None
        why = str(why)[:300] if why else "no reason given"
        self.refusals.append((msg.round, why))
        self.quiet("refused update", f"client {self.client_id}: the server refused its update of round "
                   f"{msg.round}: {why}", logging.ERROR)

    def _welcome(self, w: pb.Welcome, stream: ClientStream) -> None:
        """The server admitted this stream: under the id asked for (or one in range, where the
        server assigns it), and the same id again on every later stream."""
        if stream.welcomed:
            raise WireError("the server sent a second welcome on one stream")
        expected = self.client_id or self.requested_id
        top = self.num_clients or w.client_id   # a course's client count, where the config says
        if not 1 <= w.client_id <= top or (expected and w.client_id != expected):
            raise WireError(f"the server's welcome names client id {w.client_id}, not "
                            + (f"{expected}" if expected else f"one in 1..{self.num_clients}"))
        resumed = getattr(w, "resumed_round", 0)
        if resumed < 0:   # a round of the course, or 0: anything else would roll the state back to none
            raise WireError(f"the server's welcome names resumed round {resumed}, not a round")
        stream.welcomed = True
        stream.last_recv = time.monotonic()
        again = self.server_session is not None   # not this process's first welcome
        new_server = again and w.server_session != self.server_session
        self.client_id, self.server_session, self.connected = w.client_id, w.server_session, True
        # a resuming server says from which round (a field of newer servers' welcomes); the
        # state kept on disk goes back to that round first, so the join declares one it can take
        self.resumed_round = resumed
        if resumed and self.durable_state is not None:
            self.scheduler.call_soon(lambda: self.durable_state.resume_at(resumed))
        if new_server:
            self._last_delivered = 0
            log.warning("client %d: the server restarted%s; joining again", self.client_id,
                        f" (the course resumed at round {resumed})" if resumed else "")
            if self.on_new_server is not None:
                self.scheduler.call_soon(self.on_new_server)
        elif again and self.on_readmitted is not None:
            self.scheduler.call_soon(self.on_readmitted)
        self.outbox.wake()   # what was queued goes now (`GrpcClientComm._requests`)
        self._welcomed.set()
