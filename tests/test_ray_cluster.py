"""A two-node Ray cluster on loopback (`ray start --head`, then `ray start --address`, one
CPU each): a course with `executor: ray` joins it, trains clients on both nodes, and gives
the sequential executor's numbers."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from fedcore.runtime.course import Course
from tests.conftest import skip_module_without, small_cfg

skip_module_without("ray")   # its processes import Ray; this one need not, even to collect

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
                            env=dict(os.environ, RAY_AUTH_MODE="disabled"),
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def two_node_cluster():
    tmp = tempfile.mkdtemp(prefix="/tmp/fcray")       # short: Ray's socket paths must fit
    port = _free_port()
    nodes = [_ray_start(tmp, port, head=True), _ray_start(tmp, port, head=False)]
    try:
        yield f"127.0.0.1:{port}"
    finally:
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
        shutil.rmtree(tmp, ignore_errors=True)


# The course runs in a process of its own, as a user's driver would: a process that was
# already in another Ray session (this one's tests may have been) can confuse Ray's ids.
DRIVER = """
import json, sys, torch
from fedcore.runtime.course import Course
from tests.conftest import small_cfg
course = Course(small_cfg(None, **json.loads(sys.argv[1]))).build()
course.run()
torch.save(dict(course.server.aggregator.global_state), sys.argv[2])
print(json.dumps({"by_node": course.trainer.engine.clients_by_node,
                  "batched": course.trainer.batched_fits}))
"""


def test_a_course_trains_on_both_nodes_of_a_cluster(two_node_cluster, tmp_path):
    overrides = dict(algorithm__name="scaffold", train__local_steps=2, federate__total_round_num=2,
                     torch_threads=1)
    seq = Course(small_cfg(None, **overrides)).build()
    seq.run()
    # the second actor (one CPU each, one CPU per node) waits for the second node to join
    ray_overrides = dict(overrides, executor="ray", executor_workers=2,
                         executor__ray__address=two_node_cluster)
    out = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(ray_overrides),
                          str(tmp_path / "final.pt")], capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, RAY_AUTH_MODE="disabled"),
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    by_node = report["by_node"]
    assert len(by_node) == 2 and all(n > 0 for n in by_node.values())   # both nodes trained
    assert sum(by_node.values()) == report["batched"] == 12
    a = seq.server.aggregator.global_state
    b = torch.load(tmp_path / "final.pt", weights_only=True)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
