"""The keys a task sets for its course (analytics, trees) are refused when set without it.

`task: analytics` and `task: trees` set course, algorithm.name and model.type together; one of
them set alone on a training course used to build and then fail at the first message, deep
inside a handler. The command line exits 2 with one line naming the key and the task."""
import pytest

from fedcore.kernel.errors import ConfigError
from fedcore.run import main
from tests.conftest import small_cfg

CASES = [("algorithm.name", "analytics", "analytics"), ("course", "analytics", "analytics"),
         ("model.type", "analytics_request", "analytics"), ("algorithm.name", "trees", "trees"),
         ("course", "trees", "trees"), ("course", "trees_secureboost", "trees"),
         ("model.type", "trees_booster", "trees")]


@pytest.mark.parametrize("key,value,task", CASES)
def test_a_tasks_own_key_set_alone_is_refused_naming_the_task(key, value, task):
    with pytest.raises(ConfigError, match=f"{key}: {value} belongs to task: {task}.*set task={task}"):
        small_cfg(**{key.replace(".", "__"): value})


def test_the_command_line_exits_2_in_one_line(tmp_path, capsys):
    code = main(["--cfg", "scenarios/quickstart.yaml", "algorithm.name=trees", f"outdir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "algorithm.name: trees belongs to task: trees" in err[0]
