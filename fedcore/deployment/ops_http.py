"""The operator's port of a deployed server or edge: /metrics, /healthz, /readyz, /dashboard/.

Served by the standard library's threaded HTTP server on threads of its own, never on
the gRPC event loop or the course's scheduler thread, so a probe is answered while either
is busy (or flooded). `/healthz` says whether the scheduler thread still turns: the
course's watch stamps `loop_beat` every heartbeat interval or so, and a stamp older than
`distribute.heartbeat_timeout` (the silence after which a client counts as dead) answers
503. `/readyz` says whether the course takes clients (server: listening and not finished;
edge: connected to its cloud as well). `/metrics` is Prometheus text from a private
registry (`ops_metrics`). With `distribute.operator_token_file`, /metrics and the dashboard's
data (/dashboard/api/) answer only `Authorization: Bearer <token>`; the dashboard's page and
scripts (the package's own files) and the health checks stay open and say nothing of the course
but the health checks' state.
"""
from __future__ import annotations

import hmac
import json
import logging
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from fedcore.comm.client_state import write_atomic
from fedcore.comm.stream import _read, host_port
from fedcore.dashboard.server import SECURITY_HEADERS, QuietHandler, threaded_server
from fedcore.kernel.errors import ConfigError

__all__ = ["OpsServer", "start_ops"]

log = logging.getLogger("fedcore.deploy")


class OpsServer:
    """The HTTP endpoints of one deployed course, on `host:port`, until `stop()`."""

    def __init__(self, host: str, port: int, *, metrics: Callable[[], bytes] | None,
                 alive: Callable[[], tuple[bool, dict]], ready: Callable[[], tuple[bool, dict]],
                 dashboard=None, token: str | None = None):
        self.metrics, self.alive, self.ready, self.dashboard = metrics, alive, ready, dashboard
        self.token = token
        handler = type("Handler", (_Handler,), {"ops": self})
        try:
            self.httpd, self._thread = threaded_server(host, port, handler, "fedcore-ops", poll_interval=0.2)
        except OSError as exc:
            raise ConfigError(f"distribute.metrics_port: cannot listen on {host_port(host, port)} "
                              f"({exc.strerror or exc}); choose another port or 0 for a free one") from None
        self.port = self.httpd.server_address[1]
        self.address = host_port(host, self.port)
        self._thread.start()

    def authorized(self, header: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5.0)


class _Handler(QuietHandler):
    ops: OpsServer

    def _send(self, status: int, body: bytes, ctype: str = "application/json",
              extra: dict | None = None) -> None:
        self.send_body(status, body, ctype,
                       {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", **(extra or {})})

    def _state(self, check: Callable[[], tuple[bool, dict]]) -> None:
        ok, facts = check()
        self._send(200 if ok else 503, json.dumps({"status": "ok" if ok else "unavailable", **facts}).encode())

    def do_GET(self) -> None:
        ops, url = self.ops, urlsplit(self.path)
        path = url.path
        try:
            if path == "/healthz":
                return self._state(ops.alive)
            if path == "/readyz":
                return self._state(ops.ready)
            if path == "/metrics" or path.startswith("/dashboard"):
                # the page and its scripts are the package's, the same for every course: every
                # other path (the course's data) asks for the token, which a browser sends from
                # the page's #token=... as a header
                from fedcore.dashboard.app import STATIC
                public = path.startswith("/dashboard/") and path[len("/dashboard/"):] in STATIC
                if not public and not ops.authorized(self.headers.get("Authorization")):
                    return self._send(401, b'{"status": "unauthorized"}',
                                      extra={"WWW-Authenticate": 'Bearer realm="fedcore"'})
                if path == "/metrics" and ops.metrics is not None:
                    from prometheus_client.exposition import CONTENT_TYPE_LATEST
                    return self._send(200, ops.metrics(), CONTENT_TYPE_LATEST)
                if path == "/dashboard":
                    return self._send(308, b"", "text/plain", {"Location": "/dashboard/"})
                if path.startswith("/dashboard/") and ops.dashboard is not None:
                    status, ctype, body = ops.dashboard.respond(path[len("/dashboard/"):], url.query)
                    return self._send(status, body, ctype, SECURITY_HEADERS)
            self._send(404, b'{"status": "not found"}')
        except Exception:   # a fault of one answer is logged; the endpoint and the course go on
            log.exception("operations endpoint: %s failed", path[:80])
            self._send(500, b'{"status": "error"}')

    do_HEAD = do_GET


def _operator_token(d) -> str | None:
    if not d["operator_token_file"]:
        return None
    token = _read("distribute.operator_token_file", d["operator_token_file"]).decode(errors="replace").strip()
    if not token:
        raise ConfigError(f"distribute.operator_token_file: '{d['operator_token_file']}' is empty")
    return token


def start_ops(course, tier: str, outdir: Path | None,
              address_name: str = "metrics_address") -> OpsServer | None:
    """Serve `course`'s endpoints where `distribute.metrics_port` asks (None: off); a free port
    (0) is written as host:port to `outdir/address_name`."""
    d = course.cfg.section("distribute")
    if d["metrics_port"] is None:
        return None
    try:
        from prometheus_client import generate_latest
    except ImportError:
        raise ConfigError("distribute.metrics_port needs the optional extra 'ops' (pip install "
                          "\"fedcore[ops]\"), or leave distribute.metrics_port unset") from None
    from fedcore.deployment.ops_metrics import course_registry
    registry = course_registry(course, tier)
    stale = d["heartbeat_timeout"]

    def alive() -> tuple[bool, dict]:
        age = time.monotonic() - course.loop_beat
        return age <= stale, {"loop_age_seconds": round(age, 3), "stale_after_seconds": stale}

    def ready() -> tuple[bool, dict]:
        worker = course.server
        up = getattr(course, "up", None)
        facts = {"listening": course.listening, "finished": bool(worker.finished)}
        if up is not None:
            facts["cloud_connected"] = bool(up.connected)
        return course.listening and not worker.finished and facts.get("cloud_connected", True), facts

    dashboard = None
    if d["dashboard"] and tier != "edge" and course.outdir is not None:
        from fedcore.dashboard.app import Dashboard
        dashboard = Dashboard([Path(course.outdir)], live=registry)
    ops = OpsServer(d["metrics_host"], d["metrics_port"], metrics=lambda: generate_latest(registry),
                    alive=alive, ready=ready, dashboard=dashboard, token=_operator_token(d))
    if outdir is not None and d["metrics_port"] == 0:
        Path(outdir).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(outdir) / address_name, f"{ops.address}\n".encode())
    log.info("operations endpoint on http://%s (/metrics, /healthz, /readyz%s)", ops.address,
             ", /dashboard/" if dashboard else "")
    return ops
