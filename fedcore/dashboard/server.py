"""`python -m fedcore.dashboard`'s web server: the dashboard of runs' folders on one port."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from fedcore.dashboard.app import Dashboard

__all__ = ["serve", "DashboardServer", "QuietHandler", "SECURITY_HEADERS", "threaded_server"]

# the page loads only what the package serves: no script, style or font from elsewhere
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that writes no log line per request (a poll a second is not news) and
    answers in one call; the dashboard's and the operations endpoint's handlers build on it."""
    server_version = "fedcore"
    sys_version = ""

    def log_message(self, format, *args) -> None:
        pass

    def send_body(self, status: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def threaded_server(host: str, port: int, handler: type, thread_name: str,
                    poll_interval: float = 0.5) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """An HTTP server on `host:port` (0: a free port) and the daemon thread that will serve it;
    each request is answered on a thread of its own, so a slow reader holds up no one."""
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": poll_interval},
                              name=thread_name, daemon=True)
    return httpd, thread


class _Handler(QuietHandler):
    dashboard: Dashboard

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        status, ctype, body = self.dashboard.respond(url.path, url.query)
        self.send_body(status, body, ctype, SECURITY_HEADERS)


class DashboardServer:
    """The dashboard on `host:port` (0: a free port), served from threads of its own."""

    def __init__(self, dashboard: Dashboard, host: str = "127.0.0.1", port: int = 0):
        handler = type("Handler", (_Handler,), {"dashboard": dashboard})
        self.httpd, self._thread = threaded_server(host, port, handler, "fedcore-dashboard")
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}/"

    def start(self) -> "DashboardServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(dashboard: Dashboard, host: str, port: int) -> DashboardServer:
    return DashboardServer(dashboard, host, port).start()
