"""python -m fedcore.plot: one curve per run, named by the run, any x the records offer."""
import json

import pytest

from tests.conftest import need_extra

need_extra("plot")

from fedcore.plot import draw_runs, main
from tests.conftest import small_cfg


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from fedcore.runtime.course import Course
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for name, lr in (("slow", 0.02), ("fast", 0.3), ("faster", 0.6)):
        Course(small_cfg(root / name, name=name, train__optimizer__lr=lr,
                         federate__total_round_num=3, eval__freq=2)).run()
        dirs.append(root / name)
    return dirs


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_one_curve_per_run_named_by_the_run(runs):
    fig = draw_runs(runs, "round", "test_acc")
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["slow", "fast", "faster"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["slow", "fast", "faster"]
    for line, run in zip(ax.get_lines(), runs):
        evals = [r for r in records(run) if "test_acc" in r]   # rounds 2 and 3 (the last)
        assert list(line.get_xdata()) == [r["round"] for r in evals] == [2, 3]
        assert list(line.get_ydata()) == [r["test_acc"] for r in evals]


def test_bytes_axis_is_cumulative_traffic(runs):
    rs = records(runs[0])
    total, expected = 0, []
    for r in rs:
        total += r["bytes_up"] + r["bytes_down"]
        expected.append(total)
    assert [r["bytes_total"] for r in rs] == expected
    assert [r["bytes_up_total"] for r in rs][-1] == sum(r["bytes_up"] for r in rs)
    line = draw_runs(runs[:1], "bytes", "test_loss").axes[0].get_lines()[0]
    assert list(line.get_xdata()) == [r["bytes_total"] for r in rs if "test_loss" in r]


def test_cli_writes_the_format_the_suffix_names(runs, tmp_path, capsys):
    svg = tmp_path / "acc.svg"
    assert main([str(r) for r in runs] + ["--x", "virtual_time", "--y", "test_acc", "-o", str(svg)]) == 0
    assert "3 curves" in capsys.readouterr().out
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml")
    assert all(f"<!-- {n} -->" in text for n in ("slow", "fast", "faster"))   # legend texts
    png = tmp_path / "loss.png"
    assert main([str(runs[0]), "--y", "test_loss", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_input_is_one_line_exit_2(runs, tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    assert main([str(runs[0]), "--y", "test_acc_typo", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "its fields:" in err and "test_acc" in err
