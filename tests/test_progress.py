"""Progress: a bar on a terminal, periodic lines elsewhere, quiet at verbose 0."""
import io

import pytest

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.runtime.progress import Progress, make_progress
from tests.conftest import small_cfg


class Terminal(io.StringIO):
    def isatty(self):
        return True


def feed(progress, rounds):
    progress.on_start(None)
    for r in range(1, rounds + 1):
        progress.on_record({"round": r, "virtual_time": 1.5 * r, "test_acc": 0.1 * r})
    progress.on_end({})


def test_verbose_levels_and_their_old_spellings():
    assert [load_config(None, [f"verbose={v}"])["verbose"] for v in ("false", "true", 0, 1, 2)] == \
        [0, 1, 0, 1, 2]
    with pytest.raises(ConfigError, match="verbose: 3 is not one of 0, 1, 2"):
        load_config(None, ["verbose=3"])


def test_not_a_terminal_gets_lines_every_interval_and_at_the_end():
    out = io.StringIO()
    feed(make_progress(1, 5, interval=3600, stream=out), 5)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("round 5/5  virtual 7.5s  wall 0:00  eta 0:00")
    assert lines[0].endswith("test_acc 0.5000")
    out = io.StringIO()
    feed(make_progress(1, 5, interval=0.0, stream=out), 5)
    assert len(out.getvalue().splitlines()) == 5


def test_a_deployed_course_shows_its_wall_clock_and_no_virtual_time():
    """A deployed course's record time is wall-clock seconds since its server started: the line
    calls it wall, and the eta extrapolates it (10 s a round: after round 1 of 5, 40 s remain)."""
    out = io.StringIO()
    progress = make_progress(1, 5, interval=0.0, stream=out, wall_clock=True)
    progress.on_start(None)
    for r in range(1, 6):
        progress.on_record({"round": r, "virtual_time": 10.0 * r, "test_acc": None})
    lines = out.getvalue().splitlines()
    assert lines[0] == "round 1/5  wall 0:10  eta 0:40"
    assert lines[-1] == "round 5/5  wall 0:50  eta 0:00"
    assert "virtual" not in out.getvalue()
    bar = Terminal()
    feed(make_progress(1, 4, stream=bar, wall_clock=True), 4)
    assert "acc 0.4000" in bar.getvalue() and "virtual" not in bar.getvalue()


def test_verbose_2_writes_every_round_and_0_nothing():
    out = io.StringIO()
    feed(make_progress(2, 4, interval=3600, stream=out), 4)
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["1/4", "2/4", "3/4", "4/4"]
    assert make_progress(0, 4, stream=out) is None and make_progress(False, 4) is None


def test_a_terminal_gets_a_bar_with_eta():
    out = Terminal()
    progress = make_progress(1, 4, stream=out)
    assert isinstance(progress, Progress) and progress.use_bar
    feed(progress, 4)
    text = out.getvalue()
    assert "4/4" in text and "acc 0.4000" in text and "virtual 6.0s" in text
    assert "<00:00" in text   # tqdm's elapsed<remaining


def test_a_course_reports_its_rounds(tmp_path, capsys):
    Course(small_cfg(tmp_path, federate__total_round_num=3), progress=2).run()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("round ")] == ["1/3", "2/3", "3/3"]
