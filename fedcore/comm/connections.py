"""Connections, the server's scarcest resource: capped in total and per peer address, and
closed when they only bring refused calls.

Every TCP connection holds one of the process's file descriptors. gRPC caps
them in total (`grpc.max_allowed_incoming_connections`, set below the
descriptor limit so the server can still open its files) and closes those
that stay idle, but a refused call counts as activity: an outsider sending
one refused call every few seconds on each of a thousand connections would
hold them all. gRPC's asyncio API shows a call's peer ("ipv4:10.0.0.7:51324")
but offers no way to close its connection, so `ConnectionGuard` finds the
socket with that peer among the process's descriptors and shuts it down a
moment after the refusal (time for the status to reach the peer); gRPC sees
the connection end and frees it. Only connections that no live session uses
are closed this way: those that produce nothing but refusals (calls to a method the server
does not serve count as refusals too: gRPC would answer those itself, unseen). A connection
a session moved away from (it reconnected on another) is closed likewise.

Until it is closed, a connection that only brings refusals is tarpitted: its first refused
call is answered at once (a peer refused for the first time on a connection, such as a
client with a wrong token, is told why), its next ones (as many as it may open streams) are
held unanswered until the close ends them. Held calls keep the connection's stream slots
(`grpc.max_concurrent_streams`, set by the server) taken, so gRPC refuses every further call
on it in its transport, at a small fraction of what a call costs on its way through the
asyncio API to a handler: under a header flood (calls opened as fast as a socket allows and
left open) answering each refusal at once kept the server's event loop busy with one refused
call after another and left the course about half its rate; held, 0.78-0.94 of it
(`python -m bench.flood_rate`, docs/performance.md). A connection is closed at once instead
when a held call of its is reset by its sender (rapid reset: its calls would keep coming)
or when it brings a refused call that cannot be held: more than its stream slots, or beyond
HELD_MAX calls held in all (the server leaves room for those in its limit on concurrent
calls, so they never take an honest client's). Calls it still has queued reach the handler
as a `closing` peer's and are held too, ended unread; after each the server holds back
taking further calls for a moment, so gRPC drops the rest itself (ask_pacing.py).

gRPC's asyncio API cannot send GOAWAY on one connection, so on a plaintext server
(`distribute.insecure`) the guard writes the frame itself on the socket before shutting it
down (ENHANCE_YOUR_CALM, last stream 0: none of the connection's calls was served): the
socket is gRPC's, so where gRPC's own last frame was cut short by a full send buffer the
GOAWAY lands inside it, and with the buffer full there is none (the write never waits).
Under TLS the frame would have to go through gRPC's TLS session, which the guard cannot
reach: the connection just ends. Either way it ends.

gRPC has no cap per peer address either, so the guard counts the sockets of each address
every SWEEP_EVERY seconds (less often if counting takes more than a tenth of that; scans
for a refused peer's socket are paced alike) and shuts down, from an address holding more than its cap, the
connections beyond it that no live session uses. Linux only (`/proc/self/fd`);
elsewhere refused connections are left to gRPC's idle timeout and addresses are not capped.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Callable
from urllib.parse import unquote

__all__ = ["RESERVED_FILES", "ADDRESS_SHARE", "GOAWAY_CALM", "HELD_MAX", "connection_cap", "address_cap",
           "peer_key", "ConnectionGuard"]


RESERVED_FILES = 64   # descriptors kept for the server's own files (outputs, logs, libraries)
ADDRESS_SHARE = 4     # by default one peer address may hold a quarter of the connections
CLOSE_AFTER = 0.5     # seconds between a refusal and the closing of its connection
HELD_MAX = 256        # refused calls held at once, all connections together
_CLOSING = 1 << 62    # a peer's refusal count once its connection is to be closed at once
SCAN_SHARE = 10       # a scan of the descriptors waits 10x the last one's duration after it
SWEEP_EVERY = 1.0     # seconds between two counts of the connections of each address
SHUT_MEMORY = 2.0     # seconds a closed connection's peer is remembered (its queued calls end unread)
HOLD_FOR = CLOSE_AFTER + SHUT_MEMORY   # the longest a call is held (where its connection outlives the close)
_LATER = object()
# HTTP/2 GOAWAY (RFC 9113 6.8): 8 bytes of payload, type 7, no flags, stream 0; last stream 0
# (every call of a connection closed here was refused), error ENHANCE_YOUR_CALM (0xb)
GOAWAY_CALM = (8).to_bytes(3, "big") + bytes([0x7, 0]) + bytes(4) + bytes(4) + (0xB).to_bytes(4, "big")


def connection_cap(configured: int | None) -> int | None:
    """Connections the server takes at once: `configured`, or the descriptor limit less
    RESERVED_FILES (None: no limit known, no cap)."""
    if configured is not None:
        return configured
    try:
        import resource
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return max(16, soft - RESERVED_FILES)


def address_cap(configured: int | None, total: int | None) -> int | None:
    """Connections one peer address may hold: `configured`, or the total cap / ADDRESS_SHARE
    (at least 16; None, no cap, where there is no total cap)."""
    if configured is not None:
        return configured
    return None if total is None else max(16, total // ADDRESS_SHARE)


def _peer_string(address: tuple[str, int]) -> str:
    """(host, port) as gRPC's peer string, the inverse of `_address`."""
    host, port = address
    return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"


def _address(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5", or as gRPC 1.85 writes it,
    "ipv6:%5B::1%5D:5") as (host, port)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = unquote(rest).rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


def peer_key(peer: str):
    """What identifies a peer's connection whatever way its string was written: (host, port)."""
    return _address(peer) or peer


def _peer_of(fd: int) -> tuple[str, int] | None:
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:   # not a socket
        os.close(dup)
        return None
    try:
        return _peer_of_socket(s)
    finally:
        s.close()


def _peer_of_socket(s: socket.socket) -> tuple[str, int] | None:
    try:
        peer = s.getpeername()
    except OSError:
        return None
    if not isinstance(peer, tuple):
        return None
    host = peer[0]   # gRPC listens on IPv6 sockets: its IPv4 peers are mapped addresses
    return (host[7:] if host.startswith("::ffff:") else host, peer[1])


class ConnectionGuard:
    """Closes, on the server's event loop, the connections whose calls were refused and those
    beyond their address's cap (`per_address`, None: no cap)."""

    def __init__(self, loop, admitted: Callable[[str], bool], per_address: int | None = None,
                 goaway: bool = True, streams: int = 4):
        self.loop = loop
        self.streams = streams         # a connection's stream slots: its refused calls held at most
        self.admitted = admitted       # whether a live session uses this peer's connection
        self.per_address = per_address
        self.goaway = goaway           # plaintext only: under TLS the frame would have to be encrypted
        self.closed = 0                # connections closed for their refusals
        self.over_cap = 0              # connections closed beyond their address's cap
        self.left = 0                  # connections closed after their session moved to another
        self._fds: dict[tuple[str, int], int] = {}
        self._scanned = self._scan_took = 0.0
        self._pending: dict[str, int] = {}   # peer -> its refusals not yet acted on
        self._shut_at: dict[str, float] = {}   # peer -> when its connection was closed
        self.held = 0                  # refused calls held unanswered now
        self.enabled = os.path.isdir("/proc/self/fd")
        if self.enabled and per_address is not None:
            self.loop.call_later(SWEEP_EVERY, self._sweep)

    def refused(self, peer: str) -> bool:
        """A call from `peer` was refused: close its connection in CLOSE_AFTER seconds (time
        for the status to reach an honest peer). Whether to `hold` the call before answering
        it: the connection's refusals after the first, as many as it has stream slots, while
        fewer than HELD_MAX calls are held, unless a live session uses the connection (which
        is not closed for them). A refused call it cannot hold closes the connection at once:
        its calls end faster than they are held (reset by their sender), or the pool is full."""
        if not self.enabled:
            return False
        n = self._pending.get(peer, 0) + 1
        self._pending[peer] = n
        if n == 1:
            self.loop.call_later(CLOSE_AFTER, self._close, peer)
            return False
        if n <= self.streams + 1 and self.held < HELD_MAX and not self.admitted(peer):
            return True
        self._close_now(peer)
        return False

    async def hold(self, peer: str) -> None:
        """Keep a refused call from `peer` unanswered (its stream slot taken) until its
        connection's close cancels it, at most HOLD_FOR seconds; not at all while HELD_MAX
        calls are held. A held call its sender resets closes the connection at once (rapid
        reset: its calls would keep coming)."""
        if self.held >= HELD_MAX:
            return
        self.held += 1
        try:
            await asyncio.sleep(HOLD_FOR)
        except asyncio.CancelledError:
            if self._pending.get(peer, _CLOSING) < _CLOSING:   # not by its close: by its sender
                self._close_now(peer)
            raise
        finally:
            self.held -= 1

    def _close_now(self, peer: str) -> None:
        if self._pending.get(peer, 0) < _CLOSING:
            self._pending[peer] = _CLOSING
            self.loop.call_soon(self._close, peer)

    def left_behind(self, peer: str) -> None:
        """A session admitted on `peer`'s connection moved to another: close it in CLOSE_AFTER
        seconds unless a live session still uses it. Without this a token holder kept a
        connection per admission of one id, each alive by being admitted on again."""
        if self.enabled:
            self.loop.call_later(CLOSE_AFTER, self._close_left, peer)

    def _close_left(self, peer: str) -> None:
        address = _address(peer)
        if address is None or self.admitted(peer):
            return
        fd = self._find(address)
        if fd is _LATER:
            self.loop.call_later(SCAN_SHARE * self._scan_took, self._close_left, peer)
        elif fd is not None and self._shut(address, fd, goaway=False):   # its calls were served
            self.left += 1

    def closing(self, peer: str) -> bool:
        """Whether `peer`'s connection is being or was just closed for its refusals: its refused
        calls still queued in gRPC are held (`hold`) and ended without an answer. A peer is an
        address and port, which a new connection may reuse at once: a call that is admitted is
        never asked (comm/grpc_server.py)."""
        if self._pending.get(peer, 0) >= _CLOSING:
            return not self.admitted(peer)   # an admitted connection is not closed for refusals
        shut = self._shut_at.get(peer)
        return shut is not None and time.monotonic() - shut < SHUT_MEMORY

    def _close(self, peer: str) -> None:
        if self._pending.pop(peer, None) is None:
            return   # closed already
        address = _address(peer)
        if address is None or self.admitted(peer):
            return
        fd = self._find(address)
        if fd is _LATER:   # scanned a moment ago, before this connection: look again soon
            self._pending[peer] = _CLOSING
            self.loop.call_later(SCAN_SHARE * self._scan_took, self._close, peer)
            return
        if fd is None:     # gone already
            return
        if self._shut(address, fd):
            self.closed += 1
            self._shut_at[peer] = now = time.monotonic()
            while now - next(iter(self._shut_at.values())) > SHUT_MEMORY:
                del self._shut_at[next(iter(self._shut_at))]

    def _shut(self, address: tuple[str, int], fd: int, goaway: bool = True) -> bool:
        """Send GOAWAY (ENHANCE_YOUR_CALM, where `goaway` and the server is plaintext) on the
        connection from `address` on `fd` and end it (gRPC then frees it and its descriptor). The duplicate holds the connection, so its
        peer, checked first, is the one written to: a descriptor gRPC closed and reused for a
        new connection since the scan is left alone."""
        self._fds.pop(address, None)
        try:
            dup = os.dup(fd)
        except OSError:
            return False
        try:
            s = socket.socket(fileno=dup)
        except OSError:   # not a socket any more
            os.close(dup)
            return False
        try:
            if _peer_of_socket(s) != address:
                return False
            if self.goaway and goaway:
                try:   # never waits: with the send buffer full there is no GOAWAY, only the close
                    s.send(GOAWAY_CALM, socket.MSG_DONTWAIT)
                except OSError:
                    pass
            s.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            s.close()

    def _sweep(self) -> None:
        """Count each address's connections; from one holding more than `per_address`, close
        the newest of those beyond the cap that no live session uses."""
        try:
            if len(os.listdir("/proc/self/fd")) > self.per_address:   # else no address can exceed it
                self._scan()
                by_host: dict[str, list[tuple[int, tuple[str, int]]]] = {}
                for address, fd in self._fds.items():
                    by_host.setdefault(address[0], []).append((fd, address))
                for conns in by_host.values():
                    excess = len(conns) - self.per_address
                    for fd, address in sorted(conns, reverse=True):   # highest descriptors (mostly the newest) first
                        if excess <= 0:
                            break
                        if not self.admitted(_peer_string(address)) and self._shut(address, fd):
                            self.over_cap += 1
                            excess -= 1
        finally:   # at most a tenth of the loop's time, however many descriptors
            self.loop.call_later(max(SWEEP_EVERY, SCAN_SHARE * self._scan_took), self._sweep)

    def _find(self, address: tuple[str, int]):
        """The descriptor of the connection from `address`; None if there is none, _LATER if
        the descriptors were scanned too recently to scan them again now."""
        fd = self._fds.get(address)
        if fd is not None and _peer_of(fd) == address:
            return fd
        if time.monotonic() - self._scanned < SCAN_SHARE * self._scan_took:
            return _LATER   # scans take at most a tenth of the loop's time, however many descriptors
        self._scan()
        return self._fds.get(address)

    def _scan(self) -> None:
        """The peer of each of the process's sockets."""
        started = time.monotonic()
        self._fds = {}
        for name in os.listdir("/proc/self/fd"):
            peer = _peer_of(int(name))
            if peer is not None:
                self._fds[peer] = int(name)
        self._scanned = time.monotonic()
        self._scan_took = self._scanned - started
