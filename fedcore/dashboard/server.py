"""`python -m fedcore.dashboard`'s web server: the dashboard of runs' folders on one port."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from fedcore.dashboard.app import Dashboard

__all__ = ["serve", "DashboardServer", "SECURITY_HEADERS"]

# the page loads only what the package serves: no script, style or font from elsewhere
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


class _Handler(BaseHTTPRequestHandler):
    dashboard: Dashboard
    server_version = "fedcore"
    sys_version = ""

    def log_message(self, format, *args) -> None:   # a poll a second is no log line
        pass

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        status, ctype, body = self.dashboard.respond(url.path, url.query)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in SECURITY_HEADERS.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


class DashboardServer:
    """The dashboard on `host:port` (0: a free port), served from threads of its own."""

    def __init__(self, dashboard: Dashboard, host: str = "127.0.0.1", port: int = 0):
        handler = type("Handler", (_Handler,), {"dashboard": dashboard})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{self.port}/"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="fedcore-dashboard",
                                        daemon=True)

    def start(self) -> "DashboardServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(dashboard: Dashboard, host: str, port: int) -> DashboardServer:
    return DashboardServer(dashboard, host, port).start()
