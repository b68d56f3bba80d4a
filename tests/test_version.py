"""`fedcore --version` and `fedcore.__version__` name the release that CHANGELOG.md describes."""
import re
import subprocess
import sys
from pathlib import Path

import fedcore

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_the_changelogs_newest_release():
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == fedcore.__version__


def test_version_from_the_command_line():
    for args in (["-m", "fedcore", "--version"], ["-m", "fedcore.run", "--version"]):
        done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == f"fedcore {fedcore.__version__}", done.stderr


def test_an_unknown_command_exits_2_in_one_line():
    done = subprocess.run([sys.executable, "-m", "fedcore", "bogus"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "unknown command 'bogus'" in done.stderr
