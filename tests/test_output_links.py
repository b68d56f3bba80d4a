"""Outputs written outside the course's own writer (`fedcore.kernel.files`): whoever can write
the outdir plants a link at the name before the run, as tests/test_file_safety.py does for a
course's outputs. These writers still open the name and follow the link, writing the victim's
file, and create their files with the umask's mode rather than 0600."""
import fedcore
import pytest

from tests.conftest import need_extra
from tests.test_file_safety import VICTIM, _mode, _victim


@pytest.mark.xfail(strict=True, reason="handlers/analytics.py writes statistics.json with "
                                       "Path.write_text: a planted link is followed")
def test_analytics_writes_no_statistics_through_a_planted_link(tmp_path):
    need_extra("data", "sklearn")
    victim = _victim(tmp_path)
    out = tmp_path / "run"
    out.mkdir(mode=0o700)
    (out / "statistics.json").symlink_to(victim)
    fedcore.run("scenarios/analytics.yaml", outdir=str(out), verbose=0)
    assert victim.read_bytes() == VICTIM
    assert not (out / "statistics.json").is_symlink() and _mode(out / "statistics.json") == 0o600


@pytest.mark.xfail(strict=True, reason="fedcore/tune/study.py and report.py write base.yaml, "
                                       "trials.csv, study.json and best_config.yaml with open()/write_text")
def test_a_study_writes_nothing_through_links_planted_in_its_outdir(tmp_path):
    from fedcore.tune import tune
    from tests.test_tune_methods import BASE, SPACE
    out = tmp_path / "study"
    out.mkdir(mode=0o700)
    names = ("base.yaml", "trials.csv", "study.json", "best_config.yaml")
    victims = {}
    for name in names:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        victims[name] = _victim(folder)
        (out / name).symlink_to(victims[name])
    tune({**BASE, "federate.total_round_num": 1}, SPACE, "random", trials=1, seed=0, outdir=out)
    written = [name for name, victim in victims.items() if victim.read_bytes() != VICTIM]
    assert written == []


@pytest.mark.xfail(strict=True, reason="loggers: tensorboard hands <outdir>/tensorboard to SummaryWriter, "
                                       "which follows a link there and creates its event file 0644")
def test_the_tensorboard_logger_writes_nothing_through_a_link_at_its_folder(tmp_path):
    need_extra("tensorboard")
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    out.mkdir(mode=0o700)
    (out / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
    Course(small_cfg(out, loggers=["tensorboard"])).run()
    assert list(elsewhere.iterdir()) == []
