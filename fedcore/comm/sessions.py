"""A client process as the server knows it, and the admission of each call it opens.

A `Session` outlives the reconnects of its process. `CallAdmission` is the part of the
server's communicator (`GrpcServerComm`, which it is mixed into) that decides, from a call's
metadata and before anything is read, whether the call is taken: the token (compared in
constant time), the client id, the course's config, the calls an id may hold, and a second
session for a live id. What it refuses is counted by kind, and the connection of a call it
refuses is handed to the connection guard (`comm/connections.py`).
"""
from __future__ import annotations

import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field

import grpc

from fedcore.comm.async_outbox import AsyncOutbox
from fedcore.comm.connections import peer_key
from fedcore.comm.fingerprint import differing_keys
from fedcore.comm.handover import NewSession
from fedcore.comm.stream import MD_CLIENT_ID, MD_COURSE, MD_SESSION, MD_TOKEN

__all__ = ["Session", "Refused", "CallAdmission", "OPEN_PER_ID"]


@dataclass(eq=False)
class Session:
    """One client process as the server knows it; outlives reconnects of that process."""

    client_id: int
    session_id: str
    outbox: AsyncOutbox
    peer: str = ""
    state: str = "live"           # live | left | lost
    last_seen: float = field(default_factory=time.monotonic)
    last_delivered: int = 0       # highest message id handed to the scheduler (drops duplicates)
    streams: int = 0              # streams opened by this session (1 + reconnects)
    joining: bool = False         # a new process's session whose join_in has not come yet
    receiving: bool = False       # one of its messages is half-received (a slow link may be busy)
    calls: set = field(default_factory=set)   # the tasks of its calls still running (on the loop)
    left: dict = field(default_factory=dict)  # `peer_key` -> when it moved off that connection

    def end_calls(self, keep=None, uncount: bool = False) -> None:
        """On the loop: end every call this session opened (but `keep`), the ones whose write
        waits on a peer that stopped reading included, so its id is free for its owner.
        `uncount`: the caller has taken them off the id's count of open calls already; they
        leave `calls`, so their ends do not take them off again."""
        for task in list(self.calls):
            if task is not keep:
                task.cancel()
                if uncount:
                    self.calls.discard(task)


# Calls one client id may hold open at once: its live stream and a few that a reconnect replaced
# but whose pending write still waits in flow control (a peer that stopped reading; gRPC's
# asyncio API cannot reset one stream). Beyond that its calls are refused, so the limit on
# concurrent calls, sized to this many per id, always leaves room for every other client.
OPEN_PER_ID = 3
# Seconds a session may not come back to a connection it moved away from: a connection it left
# is closed unless a live session uses it a moment later, which a session hopping back and forth
# would otherwise arrange, keeping a connection per hop (an honest client's old connection is
# broken: it never returns to one).
REVISIT = 5.0


class Refused(Exception):
    """A call the server will not take: the status code and what the peer is told."""

    def __init__(self, code: grpc.StatusCode, detail: str):
        super().__init__(detail)
        self.code, self.detail = code, detail


class CallAdmission:
    """Admission of calls, mixed into `GrpcServerComm` (whose state it reads: sessions, tokens,
    the lock, the quiet logs)."""

    def refusals(self) -> dict[str, int]:
        """How many messages, streams and connections were refused, by kind (for the summary)."""
        counts = dict(self.quiet.counts)
        closer = getattr(self, "_closer", None)
        if closer is not None and closer.closed:
            counts["connections closed after a refused call"] = closer.closed
        if closer is not None and closer.over_cap:
            counts["connections closed beyond their address's cap"] = closer.over_cap
        if closer is not None and closer.left:
            counts["connections closed after their session moved to another"] = closer.left
        pacer = getattr(self, "_pacer", None)
        if pacer is not None and pacer.delayed:
            counts["asks for a call held back after a call of a closed connection"] = pacer.delayed
        return dict(sorted(counts.items()))

    def _admitted_on(self, peer: str) -> bool:
        """Whether `peer`'s connection carries a live session now (its refusals do not close it,
        nor does its address's cap). A connection whose sessions all ended is judged like any
        other: a token holder cannot keep connections by having been admitted on them once."""
        key = peer_key(peer)
        return self._in_use(key, self._admitted_peers.get(key))

    def _in_use(self, key, ids) -> bool:
        """Whether one of the sessions `ids` is live on the connection `key` (a `peer_key`)."""
        if not ids:
            return False
        with self._lock:
            for cid in ids:
                s = self.sessions.get(cid)
                if s is not None and s.state == "live" and peer_key(s.peer) == key:
                    return True
        return False

    def _remember_admission(self, key, cid: int) -> None:
        """On the loop: `cid` was admitted on the connection `key`, the most recent last. Beyond a
        fleet's worth of connections the oldest are forgotten, but never one a live session
        uses: a token holder admitted again and again on new connections would otherwise push
        an honest client's connection out, and the address cap's sweep would then close it."""
        peers = self._admitted_peers
        peers[key] = peers.pop(key, set()) | {cid}
        while len(peers) > 4 * self.num_clients + 1024:   # live sessions are at most num_clients
            oldest = next(iter(peers))
            ids = peers.pop(oldest)
            if self._in_use(oldest, ids):
                peers[oldest] = ids   # kept, now the most recent

    def _authorized(self, cid: int, token: str) -> bool:
        expected = self.tokens.get(cid, self.token)
        if expected is None:  # no token configured at all: client certificates (or insecure mode) admit
            return self.token is None and not self.tokens
        return hmac.compare_digest(expected.encode(), token.encode())

    def _refuse(self, code, kind: str, detail: str, logged: str) -> None:
        """Refuse this call with `code` and `detail` (what the peer is told), counting the refusal."""
        self.quiet(kind, logged)
        raise Refused(code, detail)

    def _admit(self, context) -> tuple[Session, object]:
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        peer = context.peer()
        token = md.get(MD_TOKEN, "")
        token = token[7:] if token.startswith("Bearer ") else token
        session_id = md.get(MD_SESSION, "")[:64]
        try:
            cid = int(md.get(MD_CLIENT_ID, "0"))
        except ValueError:
            cid = -1
        if not 0 <= cid <= self.num_clients:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, "client id out of range",
                         f"client id must be in 1..{self.num_clients} (or 0 to be assigned one)",
                         f"refused {peer}: client id {md.get(MD_CLIENT_ID, '')[:20]!r} outside "
                         f"1..{self.num_clients}")
        if cid == 0 and self.tokens:  # per-client tokens: the token names the client
            cid = next((k for k, t in self.tokens.items()
                        if hmac.compare_digest(t.encode(), token.encode())), 0)
            ok = cid != 0
        else:
            ok = self._authorized(cid, token)
        if not ok:
            self._refuse(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing token", "wrong or missing token",
                         f"refused {peer} (client id {md.get(MD_CLIENT_ID, '0')[:20]}): wrong or missing token")
        course = getattr(self.server, "course", None)
        if MD_COURSE in md and course is not None:
            differ = differing_keys(course.cfg, md[MD_COURSE][:8192])
            if differ:
                why = "course config differs from the server's: " + ", ".join(differ[:8])
                self._refuse(grpc.StatusCode.FAILED_PRECONDITION, "course config differs",
                             why, f"refused {peer} (client id {cid}): {why}")
        session_id = session_id or secrets.token_hex(8)   # drawn once past the checks a flood fails
        with self._lock:
            if cid == 0:
                cid = next((c for c in range(1, self.num_clients + 1)
                            if c not in self.sessions or self.sessions[c].state != "live"), 0)
                if cid == 0:
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"all {self.num_clients} client ids are taken (federate.client_num)")
            busy = self._open.get(cid, 0)   # calls of this id still running
            s = self.sessions.get(cid)
            if s is not None and s.state != "live" and s.calls:
                # calls of a session that ended, stuck on a peer that stopped reading: ended now
                busy -= len(s.calls)
                s.end_calls(uncount=True)
            if busy >= OPEN_PER_ID:
                self._refuse(grpc.StatusCode.UNAVAILABLE, "too many open streams for one id",
                             f"client id {cid} still has {busy} streams open; try again once they end",
                             f"refused {peer}: client {cid} already has {busy} streams open "
                             "(its earlier ones are not reading what they were sent)")
            live = None
            key = peer_key(peer)
            if s is not None and s.state == "live" and s.session_id == session_id:
                now = time.monotonic()
                s.left = {k: t for k, t in s.left.items() if now - t < REVISIT}
                if key in s.left:
                    self._refuse(grpc.StatusCode.ALREADY_EXISTS, "session back on a connection it left",
                                 f"client id {cid}'s session moved off this connection "
                                 f"{now - s.left[key]:.1f}s ago; it may not come back for {REVISIT:g}s",
                                 f"refused {peer}: client {cid}'s session hopping back to a connection it left")
            if s is not None and s.state == "live" and s.session_id != session_id:
                # Never swapped in: a live session keeps its id until it leaves or goes silent.
                live = s
            else:
                if s is None or s.state != "live":
                    # The process whose session was lost dials again with its session id: it is
                    # where it was (joined, or still to join). Any other is a new process, which
                    # is no candidate for a round until its join_in comes: it is still building
                    # its course, and asked now it would miss its deadline and be benched.
                    returning = s is not None and hmac.compare_digest(s.session_id.encode(), session_id.encode())
                    joining = s.joining if returning else True
                    s = Session(cid, session_id, AsyncOutbox(self.chunk_size, self.first_size, self._ids, self._loop), peer)
                    s.joining = joining
                    self.sessions[cid] = s
                    how = "connected"
                else:
                    how = "reconnected"
                before, s.peer, s.last_seen = s.peer, peer, time.monotonic()
                moved = how == "reconnected" and peer_key(before) != key   # off another connection
                if moved:
                    s.left[peer_key(before)] = s.last_seen
                s.streams += 1
                self._open[cid] = busy + 1
                token_ = s.outbox.claim()
        if live is not None:
            self._refuse(grpc.StatusCode.ALREADY_EXISTS, "second session for a live id",
                         f"client id {cid} already has a live session; a second one is refused until "
                         f"it leaves or is silent for distribute.heartbeat_timeout={self.hb_timeout:g}s",
                         f"refused {peer}: a second session for client {cid}, whose session from "
                         f"{live.peer} is alive")
        self._remember_admission(key, cid)
        closer = getattr(self, "_closer", None)
        if moved and closer is not None:
            closer.left_behind(before)
        if how == "reconnected":  # a peer may reconnect on purpose, again and again
            self.quiet_info(f"reconnected {cid}", f"client {cid} reconnected from {peer}", logging.INFO)
        else:
            self.quiet_info(f"connected {cid}", f"client {cid} connected from {peer}", logging.INFO)
            self._hand_over(NewSession(self, cid, returning))   # before anything this session sends
        return s, token_
