"""W7 at a tiny fleet: the load generator's clients run a whole deployed course, and the
benchmark's last line carries its four figures."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def test_w7_at_a_tiny_fleet():
    out = subprocess.run([sys.executable, "-m", "bench.w7_fleet", "--clients", "12", "--procs", "2",
                          "--rounds", "2", "--timeout", "150"], capture_output=True, text=True,
                         timeout=200, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"w7_clients=12 w7_round_s=([\d.]+) w7_server_rss_mb=(\d+) "
                     r"w7_server_cpu_s_per_round=([\d.]+)", last)
    assert m, last
    assert 0 < float(m[1]) < 60 and int(m[2]) > 0
