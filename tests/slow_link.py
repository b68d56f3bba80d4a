"""A TCP relay standing in for a slow network link between a client and its server.

The client dials the relay's port; each connection is relayed to the server, the client's
bytes passed at `rate` bytes/s while `slow` is set (an uplink that is slow for a while),
everything else as it comes. Real sockets, so the client and server are the project's own,
unchanged.
"""
from __future__ import annotations

import socket
import threading
import time

PIECE = 16 * 1024   # bytes passed at a time


class SlowLink:
    """Relays 127.0.0.1:`port` (its own, free) to 127.0.0.1:`server_port`."""

    def __init__(self, server_port: int, rate: float):
        self.server_port, self.rate = server_port, rate
        self.slow = threading.Event()
        self.slow.set()
        self.passed_slowly = 0          # client bytes passed while slow
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(("127.0.0.1", self.server_port))
            except OSError:
                return   # closed
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, uplink: bool) -> None:
        try:
            while True:
                data = src.recv(PIECE)
                if not data:
                    break
                if uplink and self.slow.is_set():
                    time.sleep(len(data) / self.rate)
                    self.passed_slowly += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        for s in self._sockets:
            s.close()
