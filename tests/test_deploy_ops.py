"""Operating a deployed course: its metrics scraped as Prometheus would, its health checks, its
dashboard and `fedcore.status`, and what an outsider gets from them (real processes on loopback)."""
from __future__ import annotations

import http.client
import json
import math
import signal
import subprocess
import sys

import pytest

from tests.conftest import need_extra
from tests.deploy_helpers import ROOT, serve_course, wait_for, write_cfg

COURSE_TOKEN = "course-token-5d41402abc4b2a76"
OPERATOR_TOKEN = "operator-token-7d793037a0760186"
SEED = 918273645   # a course value the fingerprint keeps private: no answer may hold it


def _get(port: int, path: str, token: str | None = None, method: str = "GET") -> tuple[int, bytes]:
    """One raw request: the path goes out as written (no client-side normalization of '..')."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _outsider_calls(port: int) -> None:
    """gRPC calls an outsider makes: a wrong token, then the right one (leaked) with a course
    fingerprint that differs (the server names the key, never its value)."""
    import grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        connect = channel.stream_stream("/fedcore.Fedcore/Connect")
        for metadata in ([("authorization", "Bearer not-the-token"), ("fedcore-client-id", "1")],
                         [("authorization", f"Bearer {COURSE_TOKEN}"), ("fedcore-client-id", "0"),
                          ("fedcore-session", "abcd"), ("fedcore-course", "seed=000000000000")]):
            call = connect(iter(()), metadata=metadata, timeout=10)
            with pytest.raises(grpc.RpcError):
                list(call)


def _families(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    got = [s.value for s in families[family].samples if s.name == (sample or family)
           and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(got) == 1, (family, labels, families[family].samples)
    return got[0]


def _records(out) -> dict[int, dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {r["round"]: r for r in map(json.loads, lines) if "round" in r}


def test_a_deployed_course_is_scraped_probed_and_watched_and_tells_an_outsider_nothing(tmp_path, procs):
    need_extra("ops", "prometheus_client")
    token_file = tmp_path / "operator_token"
    token_file.write_text(OPERATOR_TOKEN + "\n")
    cfg = write_cfg(tmp_path / "course.yaml", {
        "seed": SEED, "federate.total_round_num": 100000,
        "privacy.dp.mode": "central", "privacy.dp.noise_multiplier": 1.0,
        "distribute.insecure": True, "distribute.token": COURSE_TOKEN,
        "distribute.metrics_port": 0, "distribute.dashboard": True,
        "distribute.operator_token_file": str(token_file)})
    out = tmp_path / "out"
    server, port, client = serve_course(procs, cfg, out)
    mport = int((out / "metrics_address").read_text().strip().rsplit(":", 1)[1])
    # before any client: alive, ready (listening, not finished), nothing recorded yet
    assert _get(mport, "/healthz")[0] == 200
    status, body = _get(mport, "/readyz")
    assert status == 200 and json.loads(body)["listening"] is True
    _outsider_calls(port)
    clients = [client(k) for k in (1, 2, 3)]

    def scrape():
        status, body = _get(mport, "/metrics", OPERATOR_TOKEN)
        assert status == 200
        families = _families(body.decode())
        return families if _value(families, "fedcore_rounds_completed", "fedcore_rounds_completed_total",
                                  tier="server") >= 3 else None
    m = wait_for(scrape, 240, "three rounds recorded")

    # every metric, each checked against what the course wrote to its outdir
    records = _records(out)
    done = _value(m, "fedcore_rounds_completed", "fedcore_rounds_completed_total", tier="server")
    assert done <= len(records) and _value(m, "fedcore_round", tier="server") >= done
    count = _value(m, "fedcore_round_duration_seconds", "fedcore_round_duration_seconds_count")
    inf = _value(m, "fedcore_round_duration_seconds", "fedcore_round_duration_seconds_bucket", le="+Inf")
    assert count == inf == done
    first_rounds = [records[r]["wall_time"] for r in sorted(records)[:int(done)]]
    assert _value(m, "fedcore_round_duration_seconds", "fedcore_round_duration_seconds_sum") \
        == pytest.approx(first_rounds[-1])   # the spans from the start add up to the last record's time
    for state, n in (("joined", 3), ("alive", 3), ("dropped", 0)):
        assert _value(m, "fedcore_clients", state=state, tier="server") == n
    assert _value(m, "fedcore_clients_expected", tier="server") == 3
    assert _value(m, "fedcore_refused", "fedcore_refused_total", stage="connection",
                  reason="wrong or missing token", tier="server") == 1
    assert _value(m, "fedcore_refused", "fedcore_refused_total", stage="connection",
                  reason="course config differs", tier="server") >= 1
    assert _value(m, "fedcore_bytes", "fedcore_bytes_total", direction="up", tier="server") > 0
    assert _value(m, "fedcore_bytes", "fedcore_bytes_total", direction="down", tier="server") > 0
    at = int(_value(m, "fedcore_record_round", field="test_acc", tier="server"))
    assert _value(m, "fedcore_record_value", field="test_acc", tier="server") == records[at]["test_acc"]
    at = int(_value(m, "fedcore_record_round", field="dp_epsilon", tier="server"))
    assert _value(m, "fedcore_dp_epsilon", tier="server") == records[at]["dp_epsilon"] > 0
    assert math.isfinite(_value(m, "fedcore_model_norm", tier="server"))
    assert _value(m, "fedcore_snapshot_age_seconds", tier="server") >= 0
    assert 1 <= _value(m, "fedcore_snapshot_round", tier="server") <= _value(m, "fedcore_round", tier="server")

    # fedcore.status reads the same endpoint
    r = subprocess.run([sys.executable, "-m", "fedcore.status", f"127.0.0.1:{mport}", "--token-file",
                        str(token_file)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "3 joined, 3 alive, 0 dropped" in r.stdout and "wrong or missing token" in r.stdout
    r = subprocess.run([sys.executable, "-m", "fedcore.status", f"127.0.0.1:{mport}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and "answered 401" in r.stderr

    # the outsider: no token, a wrong one, paths out of the dashboard's tables
    for path in ("/metrics", "/dashboard/api/runs", "/dashboard/api/live", "/dashboard//api/runs",
                 "/dashboard/./api/runs", "/dashboard/api/run?id=0&offset=0&trials_offset=0"):
        assert _get(mport, path)[0] == 401
        assert _get(mport, path, "wrong-token")[0] == 401
        assert _get(mport, path, OPERATOR_TOKEN[:-1])[0] == 401
    answers = [_get(mport, p, OPERATOR_TOKEN) for p in (
        "/metrics", "/healthz", "/readyz", "/dashboard/", "/dashboard/dashboard.js", "/dashboard/api/runs",
        "/dashboard/api/run?id=0&offset=0&trials_offset=0", "/dashboard/api/live",
        "/dashboard/../config.yaml", "/dashboard/../../config.yaml", "/dashboard/%2e%2e/config.yaml",
        "/dashboard/static/../../out/config.yaml", "/dashboard/api/run?id=../config.yaml&offset=0",
        "/dashboard/api/run?id=1&offset=0&trials_offset=0", "/dashboard/config.yaml", "/config.yaml",
        "/dashboard/api/run?id=-1&offset=0&trials_offset=0")]
    # without a token: the probes, and the page and its scripts, which are the package's files
    answers += [_get(mport, p) for p in ("/healthz", "/readyz", "/dashboard/", "/dashboard/dashboard.js",
                                         "/metrics", "/nothing", "/dashboard/../config.yaml")]
    assert [s for s, _ in answers[-7:]] == [200, 200, 200, 200, 401, 404, 401]
    statuses = [s for s, _ in answers]
    assert statuses[:8] == [200] * 8 and all(s in (400, 404) for s in statuses[8:17]), statuses
    feed = json.loads(answers[6][1])
    rounds = [r["round"] for r in feed["records"]]
    assert rounds == sorted(rounds) and len(rounds) >= done
    assert feed["records"][0]["test_acc"] == records[feed["records"][0]["round"]]["test_acc"]
    config_text = (out / "config.yaml").read_text()
    assert str(SEED) in config_text   # the secret values are on disk, so a leak would show
    for status, body in answers:
        for secret in (COURSE_TOKEN, OPERATOR_TOKEN, str(SEED), str(tmp_path), "config_sources", "<redacted>"):
            assert secret.encode() not in body, (secret, body[:300])

    # a client killed: its session is lost, counted as dropped; the process stays alive and healthy
    clients[2].send_signal(signal.SIGKILL)

    def dropped():
        families = _families(_get(mport, "/metrics", OPERATOR_TOKEN)[1].decode())
        return _value(families, "fedcore_clients", state="dropped", tier="server") == 1 and families
    m = wait_for(dropped, 120, "the killed client counted as dropped")
    assert _value(m, "fedcore_clients", state="alive", tier="server") == 2
    assert _get(mport, "/healthz")[0] == 200 and server.poll() is None


def test_an_edge_serves_its_own_tier_and_is_ready_only_while_connected_to_its_cloud(tmp_path, procs):
    need_extra("ops", "prometheus_client")
    from tests.test_deploy_hierarchy import COURSE, WIRE, _tree
    cfg = write_cfg(tmp_path / "course.yaml", {**COURSE, **WIRE, "federate.total_round_num": 100000,
                                               "distribute.metrics_port": 0})
    out = tmp_path / "out"
    cloud, edges, clients, _, _ = _tree(procs, cfg, out)
    mport = int(wait_for(lambda: (out / "edge_5_metrics_address").exists()
                         and (out / "edge_5_metrics_address").read_text().strip(), 60,
                         "edge 5's metrics address").rsplit(":", 1)[1])

    def serving():
        families = _families(_get(mport, "/metrics")[1].decode())
        up = _value(families, "fedcore_bytes", "fedcore_bytes_total", direction="up", tier="edge")
        alive = _value(families, "fedcore_clients", state="alive", tier="edge")
        return up > 0 and alive == 2 and _value(families, "fedcore_round", tier="edge") >= 1 and families
    m = wait_for(serving, 240, "edge 5's clients training")
    assert _value(m, "fedcore_clients", state="joined", tier="edge") == 2
    assert _value(m, "fedcore_clients_expected", tier="edge") == 2   # clients 1 and 2
    status, body = _get(mport, "/readyz")
    assert status == 200 and json.loads(body)["cloud_connected"] is True
    # the cloud reports its own tier: its participants are the 2 edges
    cport = int((out / "metrics_address").read_text().strip().rsplit(":", 1)[1])
    cloud_m = _families(_get(cport, "/metrics")[1].decode())
    assert _value(cloud_m, "fedcore_clients_expected", tier="cloud") == 2
    assert _value(cloud_m, "fedcore_clients", state="joined", tier="cloud") == 2

    cloud.send_signal(signal.SIGKILL)   # the cloud gone: the edge lives on but is not ready

    def unready():
        status, body = _get(mport, "/readyz")
        return status == 503 and json.loads(body)
    assert wait_for(unready, 60, "edge 5 unready")["cloud_connected"] is False
    assert _get(mport, "/healthz")[0] == 200 and edges[5].poll() is None


def test_the_server_s_dashboard_shows_its_live_course_to_the_operator_only(tmp_path, procs):
    need_extra("ops", "prometheus_client")
    from tests.test_dashboard import _browser, _waiter
    browser = _browser()
    try:
        token_file = tmp_path / "operator_token"
        token_file.write_text(OPERATOR_TOKEN)
        cfg = write_cfg(tmp_path / "course.yaml", {
            "federate.total_round_num": 100000, "distribute.insecure": True,
            "distribute.token": COURSE_TOKEN, "distribute.metrics_port": 0, "distribute.dashboard": True,
            "distribute.operator_token_file": str(token_file)})
        out = tmp_path / "out"
        server, port, client = serve_course(procs, cfg, out)
        mport = int((out / "metrics_address").read_text().strip().rsplit(":", 1)[1])
        for k in (1, 2, 3):
            client(k)
        wait, d = _waiter(browser, 120), "window.fedcoreDashboard"

        def cell(name):
            return browser.execute_script(f"const c = document.querySelector('#run-0 .{name}'); "
                                          "return c && c.textContent")
        # without the token the page loads but gets no data
        browser.get(f"http://127.0.0.1:{mport}/dashboard/")
        wait(lambda: "not" in browser.find_element("id", "updated").text)
        assert "401" in browser.find_element("id", "updated").text and cell("rounds") is None
        # the operator's link: the curve grows while the course runs, the live clients are shown
        browser.get(f"http://127.0.0.1:{mport}/dashboard/#token={OPERATOR_TOKEN}")
        browser.refresh()
        wait(lambda: (browser.execute_script(f"return {d}.charts.acc && {d}.charts.acc.data[0].length")
                      or 0) >= 2)
        first = browser.execute_script(f"return {d}.charts.acc.data[0].length")
        wait(lambda: browser.execute_script(f"return {d}.charts.acc.data[0].length") > first)
        wait(lambda: cell("clients") == "3 alive / 3 joined / 0 dropped")
        assert cell("state") == "running"
        assert server.poll() is None
    finally:
        browser.quit()
