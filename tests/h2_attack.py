"""An outsider's HTTP/2 connections, written from RFC 7540/7541 with raw sockets (loopback only).

Each connection sends the preface, its SETTINGS (and an ACK of the server's), then gRPC calls
as bare HEADERS frames without a token, which the server refuses (UNAUTHENTICATED). HPACK is
its simplest form: every header a literal without indexing, no Huffman coding.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, SETTINGS = 0x1, 0x4
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """The 9-byte frame header (length, type, flags, stream id) and the payload."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def call_headers(port: int, stream: int) -> bytes:
    """A HEADERS frame opening a fedcore Connect call with no token (and no body)."""
    block = b"".join(_literal(n, v) for n, v in [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/fedcore.Fedcore/Connect"),
        (b":authority", f"127.0.0.1:{port}".encode()), (b"content-type", b"application/grpc"),
        (b"te", b"trailers"), (b"fedcore-client-id", b"1")])
    return frame(HEADERS, END_HEADERS | END_STREAM, stream, block)


class RefusedCallFlood:
    """`n` connections, each sending a refused call every `every` seconds, reopened when the
    server closes them; runs on a thread until `stop()` (or `limit` seconds)."""

    def __init__(self, port: int, n: int, every: float, limit: float = 180.0):
        self.port, self.n, self.every, self.limit = port, n, every, limit
        self.calls = self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "RefusedCallFlood":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _open(self):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", self.port))
        return [s, 1, False]   # socket, next stream id, preface sent

    def _send(self, conn) -> bool:
        s, stream, greeted = conn
        data = b"" if greeted else PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0)
        try:
            try:
                while s.recv(65536):   # what the server said: read and dropped
                    pass
            except BlockingIOError:
                pass
            s.send(data + call_headers(self.port, stream))
        except OSError:   # not connected yet, or closed by the server
            return False
        conn[1], conn[2] = stream + 2, True
        self.calls += 1
        return True

    def _run(self) -> None:
        started = time.monotonic()
        conns = [self._open() for _ in range(self.n)]
        while not self._stop.is_set() and time.monotonic() - started < self.limit:
            for i, conn in enumerate(conns):
                if not self._send(conn) and conn[2]:   # closed by the server: open another
                    conn[0].close()
                    conns[i] = self._open()
                    self.reopened += 1
            self._stop.wait(self.every)
        for conn in conns:
            conn[0].close()
