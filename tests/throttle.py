"""A TCP proxy on loopback that passes at most `rate` bytes per second each way, or only
from the client to the server (`uplink_only`), while `limited` is set (a slow link; clear
it and the link is fast).

Its sockets have small buffers, so the sender feels the link's pace instead of
filling megabytes of kernel buffer at once.
"""
from __future__ import annotations

import socket
import threading
import time

BUFFER = 32 * 1024


def _small(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER)
    return sock


class Throttle:
    def __init__(self, upstream_port: int, rate: float, uplink_only: bool = False):
        self.upstream, self.rate, self.uplink_only = upstream_port, rate, uplink_only
        self.limited = threading.Event()
        self.limited.set()
        self.listener = _small(socket.socket())
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.moved = 0
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = _small(socket.socket())
            up.connect(("127.0.0.1", self.upstream))
            _small(down)
            for a, b, limited in ((down, up, True), (up, down, not self.uplink_only)):
                threading.Thread(target=self._pump, args=(a, b, limited), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limited: bool) -> None:
        start, sent = time.monotonic(), 0
        try:
            while True:
                data = src.recv(4096)
                if not data:
                    break
                dst.sendall(data)
                sent += len(data)
                self.moved += len(data)
                if not (limited and self.limited.is_set()):
                    continue
                ahead = sent / self.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
                elif ahead < -1.0:  # idle for a while: no burst credit beyond a second
                    start, sent = time.monotonic() - 1.0, 0
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.listener.close()
