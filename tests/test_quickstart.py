"""The README's quickstart ends with a plot. (That the quickstart reaches the accuracy its docs
promise is checked on the page's own run: tests/test_docs_commands.py.)"""
from pathlib import Path

import pytest

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "quickstart.yaml"


@pytest.mark.extra("plot")
def test_quickstart_ends_with_a_plot(tmp_path):
    """The README's quickstart with a plot: run the course into a folder, then plot it."""
    from fedcore.plot import draw_runs
    from fedcore.plot import main as plot
    from fedcore.run import main as run
    out = tmp_path / "quickstart"
    assert run(["--cfg", str(SCENARIO), f"outdir={out}", "verbose=false",
                "federate.total_round_num=10"]) == 0
    png = tmp_path / "quickstart.png"
    assert plot([str(out), "--x", "virtual_time", "--y", "test_acc", "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (line,) = draw_runs([out], "virtual_time", "test_acc").axes[0].get_lines()
    assert line.get_label() == "quickstart" and len(line.get_xdata()) == 2   # eval every 5 rounds
