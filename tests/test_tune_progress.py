"""`python -m fedcore.tune` says how far a study is, one line per finished run off a terminal."""
import io
import json
import re
import subprocess
import sys

import pytest
import yaml

from fedcore.tune.progress import StudyProgress
from fedcore.tune.study import Row
from tests.deploy_helpers import ROOT, _env
from tests.test_tune_methods import BASE, SPACE

LINE = re.compile(r"tune: (\d+)/(\d+) runs  trial (\d+) at (\d+): val_acc (\S+)  "
                  r"best val_acc (\S+) \(trial (\d+)\)  elapsed (\d+:\d\d)  left ~(\d+:\d\d)$")


@pytest.mark.slow
def test_a_cli_study_prints_one_line_per_finished_run_with_the_best_so_far(tmp_path):
    base, space = tmp_path / "base.yaml", tmp_path / "space.yaml"
    base.write_text(yaml.safe_dump({**BASE, "federate.total_round_num": 4}))
    space.write_text(yaml.safe_dump(SPACE))
    out = tmp_path / "study"
    # successive halving, 4 trials, eta 2, budgets 1, 2, 4 rounds: 4 + 2 + 1 = 7 runs
    done = subprocess.run([sys.executable, "-m", "fedcore.tune", "--cfg", str(base), "--space", str(space),
                           "--method", "sha", "--trials", "4", "--eta", "2", "--budget", "4",
                           "--min-budget", "1", "--outdir", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("tune:")]
    rows = [json.loads(x) for x in (out / "trials.jsonl").read_text().splitlines()]
    assert len(lines) == len(rows) == 7 and "\r" not in done.stderr
    for k, (line, row) in enumerate(zip(lines, rows), start=1):
        m = LINE.match(line)
        assert m, line
        assert (int(m[1]), int(m[2]), int(m[3]), float(m[4])) == (k, 7, row["trial"], row["budget"])
        assert float(m[5]) == float(f"{row['objective']:.4g}")
        # the best so far: among the runs up to this one, the best at the largest budget reached
        top = max(r["budget"] for r in rows[:k])
        best = max((r for r in rows[:k] if r["budget"] == top), key=lambda r: (r["objective"], -r["trial"]))
        assert (float(m[6]), int(m[7])) == (float(f"{best['objective']:.4g}"), best["trial"])
    assert lines[-1].endswith("left ~0:00")


def test_on_a_terminal_the_line_is_rewritten_in_place():
    stream = io.StringIO()
    shown = StudyProgress("val_acc", stream, terminal=True)
    shown.expect(2)
    first = Row(0, {}, 3.0, "complete", 0.5)
    shown.finished(first, first)
    shown.finished(Row(1, {}, 3.0, "failed"), first)
    shown.close()
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "1/2 runs  trial 0 at 3: val_acc 0.5" in text and "2/2 runs  trial 1 at 3: failed  best val_acc 0.5 (trial 0)" in text
