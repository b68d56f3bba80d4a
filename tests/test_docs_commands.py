"""The docs' commands, as they stand: every `python -m fedcore.run` in a fenced block of the
README and docs/ (its subfolders included) runs and exits 0, and the figures the docs print
beside the quickstart and the digits scenario are what those runs write (to the precision
printed).

Left out, each for a stated reason: usage lines and examples built on files the reader
writes (their --cfg file is not in the repository, or an argument is a placeholder such as
KEY), deployed roles (a server and its clients run together: the deploy tests), commands
that read a secret from the shell, and the lines of a shell loop (an argument holds its
variable, such as seed=$S)."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need_extra
from tests.deploy_helpers import run_fedcore

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PLACEHOLDERS = {"KEY", "X"}


def _fenced_lines(path: Path):
    """The lines inside the fenced code blocks of `path`, continuation lines joined."""
    inside, pending = False, ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield pending + line
        pending = ""


def _command(line: str) -> tuple[dict[str, str], list[str]] | None:
    """(environment assignments, arguments after `python -m fedcore.run`) of a shell line that
    runs it, or None."""
    for part in line.split("&&"):
        if "python -m fedcore.run" not in part:
            continue
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            return None
        env = {}
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words[:3] != ["python", "-m", "fedcore.run"]:
            return None
        return env, words[3:]
    return None


def _why_left_out(env: dict[str, str], args: list[str]) -> str | None:
    if any("$(" in v for v in env.values()):
        return "reads a secret from the shell"
    if "federate.mode=distributed" in args:
        return "a deployed role"
    if any(a in PLACEHOLDERS or a.startswith("[") for a in args):
        return "a usage line with placeholders"
    if any("$" in a for a in args):
        return "a line of a shell loop"
    for flag, value in zip(args, args[1:]):
        if flag == "--cfg" and not (ROOT / value).is_file():
            return f"its config {value} is the reader's own"
    return None


def _doc_commands() -> list[tuple[str, dict[str, str], tuple[str, ...]]]:
    seen, out = set(), []
    for path in DOCS:
        for line in _fenced_lines(path):
            found = _command(line)
            if found is None or _why_left_out(*found) is not None:
                continue
            env, args = found
            args = [a for a in args if not a.startswith("outdir=")]   # each run writes to its own folder
            key = (tuple(sorted(env.items())), tuple(args))
            if key not in seen:
                seen.add(key)
                out.append((path.name, env, tuple(args)))
    return out


# every proxy at a closed loopback port and HF_ENDPOINT at nothing: a download attempt fails the run
DEAD = "http://127.0.0.1:9"
NO_NETWORK = {"HTTP_PROXY": DEAD, "HTTPS_PROXY": DEAD, "http_proxy": DEAD, "https_proxy": DEAD,
              "HF_ENDPOINT": DEAD}


def _run(env: dict[str, str], args: tuple[str, ...], outdir: Path,
         no_network: bool = False) -> subprocess.CompletedProcess:
    """`python -m fedcore.run ARGS` from the repository root, writing into `outdir`; with
    `no_network`, no HF_* variable of this process's and NO_NETWORK."""
    args = [a for a in args if not a.startswith("outdir=")]
    if "--check" not in args and "--help-key" not in args and "--list-keys" not in args:
        args.append(f"outdir={outdir}")
    extra = {k: str(ROOT / v) if k == "PYTHONPATH" else v for k, v in env.items()}
    base = {k: v for k, v in os.environ.items() if not (no_network and k.startswith("HF_"))}
    full_env = {**base, **(NO_NETWORK if no_network else {}), **extra, "OMP_NUM_THREADS": "1"}
    return run_fedcore(args, env=full_env, cwd=ROOT, timeout=600)


COMMANDS = _doc_commands()
QUICKSTART = ("--cfg", "scenarios/quickstart.yaml")
DIGITS = ("--cfg", "scenarios/digits_dirichlet.yaml")


def test_the_docs_have_the_commands_this_test_expects():
    # the extraction works: the quickstart's and the tutorial's commands are among those found
    args = [a for _, _, a in COMMANDS]
    assert QUICKSTART in args and DIGITS in args
    assert any(env.get("PYTHONPATH") == "docs/examples" and "loss_goal.threshold=0.6" in a
               for _, env, a in COMMANDS)
    assert len(COMMANDS) >= 10


@pytest.mark.parametrize("where,env,args", [c for c in COMMANDS if c[2] not in (QUICKSTART, DIGITS)],
                         ids=[f"{w}:{' '.join(a)[:60]}" for w, _, a in COMMANDS if a not in (QUICKSTART, DIGITS)])
def test_a_docs_command_runs_as_it_stands(tmp_path, where, env, args):
    llm = any("llm" in a for a in args)
    if llm:   # the language-model courses run with no network: nothing is downloaded
        need_extra("llm")
    if any("secure_aggregation" in a for a in args):
        need_extra("secagg")
    done = _run(env, args, tmp_path / "out", no_network=llm)
    assert done.returncode == 0, f"{where}: {' '.join(args)}\n{done.stderr[-3000:]}"
    if "scenarios/llm_lora.yaml" in args:   # the adapters learn: perplexity falls from round 1 to 2
        records = _records(tmp_path / "out")
        assert records[2]["test_perplexity"] < records[1]["test_perplexity"]
    if "loss_goal.threshold=0.6" in args:   # the tutorial: the goal ends the course early
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["stopped_by"] == "early_stop" and "loss_goal" in summary
        page = (ROOT / "docs" / "tutorial_custom_handler.md").read_text()
        said = re.search(r"report a mean loss below it in round (\d+)", page)[1]
        assert summary["loss_goal"]["round"] == int(said)
    if "privacy.dp.mode=central" in args:   # its epsilon is the table's: it depends on q, sigma, rounds
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        sigma = next(a for a in args if a.startswith("privacy.dp.noise_multiplier="))
        row = re.search(rf"^\| {float(sigma.split('=')[1])} \| [\d.]+ \| ([\d.]+) \|$",
                        (ROOT / "docs" / "plugins.md").read_text(), re.M)
        assert f"{summary['dp_epsilon']:.3f}" == row[1]


def _records(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["round"]: r for r in rows if "round" in r}


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> Path:
    """The quickstart page's first command, run once: its outdir."""
    out = tmp_path_factory.mktemp("quickstart") / "out"
    done = _run({}, QUICKSTART, out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_quickstart_reaches_the_accuracy_its_docs_promise(quickstart):
    summary = json.loads((quickstart / "summary.json").read_text())
    assert summary["rounds"] == 60
    assert summary["final_test_acc"] >= 0.70
    assert summary["time_to_target"] is not None and summary["time_to_target"] < summary["virtual_time"]


def test_the_quickstart_writes_the_learning_curve_its_page_prints(quickstart):
    out = quickstart
    records, summary = _records(out), json.loads((out / "summary.json").read_text())
    page = (ROOT / "docs" / "quickstart.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) ± ([\d.]+) \|$", page, re.M)
    assert len(rows) == 12
    for round_, vtime, acc, loss, mean, std in rows:
        r = records[int(round_)]
        assert f"{r['virtual_time']:.1f}" == vtime, round_
        assert f"{r['test_acc']:.3f}" == acc and f"{r['test_loss']:.3f}" == loss, round_
        assert f"{r['client_test_acc_mean']:.3f}" == mean and f"{r['client_test_acc_std']:.3f}" == std, round_
    target = re.search(r"first reached at round (\d+), ([\d.]+) s of virtual time", page)
    assert summary["rounds_to_target"] == int(target[1])
    assert f"{summary['time_to_target']:.1f}" == target[2]
    up, down, evals = re.search(r"Training moves\s+([\d.]+) MB up and ([\d.]+) MB down.*?adds ([\d.]+) MB",
                                page, re.S).groups()
    assert f"{summary['bytes_up'] / 1e6:.1f}" == up and f"{summary['bytes_down'] / 1e6:.1f}" == down
    assert f"{summary['bytes_eval'] / 1e6:.1f}" == evals


def test_the_quickstart_pages_plot_command_draws_the_curve(quickstart, tmp_path):
    need_extra("plot")
    page = (ROOT / "docs" / "quickstart.md").read_text()
    line = next(x for x in _fenced_lines(ROOT / "docs" / "quickstart.md") if "python -m fedcore.plot" in x)
    args = shlex.split(line, comments=True)[3:]
    assert args[0] == "runs/quickstart" and "-o" in args and "quickstart.png" in page
    args = [str(quickstart), *args[1:]]
    args[args.index("-o") + 1] = str(tmp_path / "quickstart.png")
    done = subprocess.run([sys.executable, "-m", "fedcore.plot", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "quickstart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_digits_scenario_reaches_the_accuracies_its_page_prints(tmp_path):
    need_extra("data")
    out = tmp_path / "out"
    done = _run({}, DIGITS, out)
    assert done.returncode == 0, done.stderr[-3000:]
    records = _records(out)
    page = (ROOT / "docs" / "data.md").read_text()
    header = re.search(r"^\| round \| (.*) \|$", page, re.M)[1]
    accs = re.search(r"^\| server test accuracy \| (.*) \|$", page, re.M)[1]
    rounds = [int(x) for x in header.split(" | ")]
    printed = [x.strip("* ") for x in accs.split(" | ")]
    assert len(rounds) == len(printed) == 6
    for round_, acc in zip(rounds, printed):
        assert f"{records[round_]['test_acc']:.3f}" == acc, round_
    mean = re.search(r"with a mean client-test\s+accuracy of (\d+\.\d+)", page)[1]
    assert f"{records[rounds[-1]]['client_test_acc_mean']:.3f}" == mean
