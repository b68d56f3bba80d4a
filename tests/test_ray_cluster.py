"""A two-node Ray cluster on loopback (`ray start --head`, then `ray start --address`, one
CPU each): a course with `executor: ray` joins it, trains clients on both nodes, and gives
the sequential executor's numbers."""
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from fedcore.course import Course
from tests.conftest import small_cfg

ray = pytest.importorskip("ray", reason="Ray is the optional extra 'ray' (pip install '.[ray]')")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(tmp: str, port: int, head: bool) -> subprocess.Popen:
    """`ray start --block` in its own process group, on its own ports, with one CPU."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus", "1",
           "--node-ip-address", "127.0.0.1", "--object-store-memory", str(80 * 2 ** 20),
           "--disable-usage-stats", "--min-worker-port", "0", "--max-worker-port", "0"]
    for flag in ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                 "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                 "--runtime-env-agent-port"):
        cmd += [flag, str(_free_port())]
    if head:
        cmd += ["--head", "--port", str(port), "--include-dashboard", "false", "--temp-dir", tmp,
                "--ray-client-server-port", str(_free_port())]
    else:
        cmd += ["--address", f"127.0.0.1:{port}"]
    log = open(os.path.join(tmp, "head.log" if head else "worker.log"), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, RAY_AUTH_MODE="disabled"))


@pytest.fixture
def two_node_cluster(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")   # loopback only; the driver must agree
    tmp = tempfile.mkdtemp(prefix="/tmp/fcray")       # short: Ray's socket paths must fit
    port = _free_port()
    nodes = [_ray_start(tmp, port, head=True), _ray_start(tmp, port, head=False)]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in nodes:
            os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in nodes:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)    # what SIGTERM left of this node's processes
            except ProcessLookupError:
                pass
            p.wait()


def _wait_for_two_nodes(address: str) -> None:
    """Until both nodes have joined (a course started earlier would find one node, and its
    second actor would wait for the other)."""
    deadline = time.monotonic() + 120
    while True:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
            break
        except ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    try:
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, "the second node never joined"
            time.sleep(0.5)
    finally:
        ray.shutdown()   # the course joins the cluster itself, from executor.ray.address


def test_a_course_trains_on_both_nodes_of_a_cluster(two_node_cluster, caplog):
    overrides = dict(algorithm__name="scaffold", train__local_steps=2, federate__total_round_num=2,
                     torch_threads=1)
    seq = Course(small_cfg(None, **overrides)).build()
    seq.run()
    _wait_for_two_nodes(two_node_cluster)
    with caplog.at_level(logging.INFO, logger="fedcore.executor"):
        course = Course(small_cfg(None, executor="ray", executor_workers=2,
                                  executor__ray__address=two_node_cluster, **overrides)).build()
        course.run()
    assert not ray.is_initialized()           # the run left the cluster it joined
    by_node = course.trainer.engine.clients_by_node
    assert len(by_node) == 2 and all(n > 0 for n in by_node.values())
    assert sum(by_node.values()) == course.trainer.batched_fits == 12
    assert "2 actors on 2 node(s)" in caplog.text
    a, b = seq.server.aggregator.global_state, course.server.aggregator.global_state
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
