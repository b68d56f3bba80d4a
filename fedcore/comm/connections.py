"""Connections, the server's scarcest resource: capped in total, and closed when they only
bring refused calls.

Every TCP connection holds one of the process's file descriptors. gRPC caps
them in total (`grpc.max_allowed_incoming_connections`, set below the
descriptor limit so the server can still open its files) and closes those
that stay idle, but a refused call counts as activity: an outsider sending
one refused call every few seconds on each of a thousand connections would
hold them all. gRPC's asyncio API shows a call's peer ("ipv4:10.0.0.7:51324")
but offers no way to close its connection, so `RefusalCloser` finds the
socket with that peer among the process's descriptors and shuts it down a
moment after the refusal (time for the status to reach the peer); gRPC sees
the connection end and frees it. Only connections that never carried an
admitted call are closed this way: those that produce nothing but refusals. Linux only (`/proc/self/fd`); elsewhere refused
connections are left to gRPC's idle timeout.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Callable

__all__ = ["RESERVED_FILES", "connection_cap", "RefusalCloser"]


RESERVED_FILES = 64   # descriptors kept for the server's own files (outputs, logs, libraries)
CLOSE_AFTER = 0.5     # seconds between a refusal and the closing of its connection
BURST = 4             # refusals on one connection within CLOSE_AFTER that close it at once
RESCAN_EVERY = 0.2    # seconds between two scans of the descriptors for peers not yet known
_LATER = object()


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


def _address(peer: str) -> tuple[str, int] | None:
    """gRPC's peer string ("ipv4:1.2.3.4:5", "ipv6:[::1]:5") as (host, port)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None


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
        peer = s.getpeername()
        if not isinstance(peer, tuple):
            return None
        host = peer[0]   # gRPC listens on IPv6 sockets: its IPv4 peers are mapped addresses
        return (host[7:] if host.startswith("::ffff:") else host, peer[1])
    except OSError:
        return None
    finally:
        s.close()


class RefusalCloser:
    """Closes, on the server's event loop, the connections whose calls were refused."""

    def __init__(self, loop, admitted: Callable[[str], bool]):
        self.loop = loop
        self.admitted = admitted       # whether a call was ever admitted on this peer's connection
        self.closed = 0
        self._fds: dict[tuple[str, int], int] = {}
        self._scanned = 0.0
        self._pending: dict[str, int] = {}   # peer -> its refusals not yet acted on
        self.enabled = os.path.isdir("/proc/self/fd")

    def refused(self, peer: str) -> None:
        """A call from `peer` was refused: close its connection in CLOSE_AFTER seconds (time
        for the status to reach an honest peer), or now if it keeps opening refused calls."""
        if not self.enabled:
            return
        n = self._pending.get(peer, 0) + 1
        self._pending[peer] = n
        if n == 1:
            self.loop.call_later(CLOSE_AFTER, self._close, peer)
        elif n == BURST:
            self.loop.call_soon(self._close, peer)

    def _close(self, peer: str) -> None:
        if self._pending.pop(peer, None) is None:
            return   # closed already
        address = _address(peer)
        if address is None or self.admitted(peer):
            return
        fd = self._find(address)
        if fd is _LATER:   # scanned a moment ago, before this connection: look again soon
            self._pending[peer] = BURST
            self.loop.call_later(RESCAN_EVERY, self._close, peer)
            return
        if fd is None:     # gone already
            return
        try:
            dup = os.dup(fd)
            s = socket.socket(fileno=dup)
        except OSError:
            return
        try:
            s.shutdown(socket.SHUT_RDWR)   # the connection ends; gRPC frees it and its descriptor
            self.closed += 1
        except OSError:
            pass
        finally:
            s.close()
            self._fds.pop(address, None)

    def _find(self, address: tuple[str, int]):
        """The descriptor of the connection from `address`; None if there is none, _LATER if
        the descriptors were scanned too recently to scan them again now."""
        fd = self._fds.get(address)
        if fd is not None and _peer_of(fd) == address:
            return fd
        now = time.monotonic()
        if now - self._scanned < RESCAN_EVERY:
            return _LATER
        self._scanned = now
        self._fds = {}
        for name in os.listdir("/proc/self/fd"):
            peer = _peer_of(int(name))
            if peer is not None:
                self._fds[peer] = int(name)
        return self._fds.get(address)
