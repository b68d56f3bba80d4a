"""`pytest -n` runs a test marked `alone` with no other test beside it (tests/alone.py)."""
import json
import subprocess
import sys

from tests.deploy_helpers import _env

TESTS = '''
import json, os, time
import pytest

def _run(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(os.environ["SPANS"], "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")

@pytest.mark.parametrize("k", range(12))
def test_short(k):
    _run(f"short{k}", 0.2)

@pytest.mark.alone
@pytest.mark.parametrize("k", range(2))
def test_alone(k):
    _run(f"alone{k}", 0.5)
'''


def test_an_alone_test_overlaps_no_other_under_xdist(tmp_path):
    (tmp_path / "test_spans.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: alone\n")
    spans = tmp_path / "spans.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "3", "-p", "tests.alone", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_spans.py")],
                          cwd=tmp_path, env={**_env(), "SPANS": str(spans)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in spans.read_text().splitlines()]
    assert len(rows) == 14
    alone = [r for r in rows if r[0].startswith("alone")]
    for name, start, end in alone:
        beside = [r[0] for r in rows if r[0] != name and r[1] < end and r[2] > start]
        assert beside == [], (name, beside)
    # and the others did run side by side (three workers), so the check above could fail
    short = sorted(r for r in rows if r[0].startswith("short"))
    assert any(a[1] < b[2] and b[1] < a[2] for a in short for b in short if a is not b)



def test_minus_m_alone_collects_only_the_modules_that_mark_a_test_alone(tmp_path):
    """`pytest -m alone` skips collecting a test module without the text `mark.alone` (the
    suite's hook in tests/conftest.py); any other selection collects every module."""
    from types import SimpleNamespace

    from tests.conftest import pytest_ignore_collect
    marked = tmp_path / "test_marked.py"
    marked.write_text("import pytest\n\n@pytest.mark.alone\ndef test_x():\n    pass\n")
    plain = tmp_path / "test_plain.py"
    plain.write_text("def test_y():   # a client sampled alone\n    pass\n")
    helper = tmp_path / "helpers.py"
    helper.write_text("")

    def config(markexpr):
        return SimpleNamespace(option=SimpleNamespace(markexpr=markexpr))
    assert pytest_ignore_collect(plain, config("alone")) is True
    assert pytest_ignore_collect(marked, config("alone")) is None
    assert pytest_ignore_collect(helper, config("alone")) is None
    for other in ("not alone", "", "alone or slow"):
        assert pytest_ignore_collect(plain, config(other)) is None
