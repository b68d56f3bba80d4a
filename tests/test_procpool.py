"""The processes executor's workers are not forks of the course's process: a process that must
not be forked (as torch's autograd engine forbids once its threads run, with CUDA) still gets
its pool, and the pool's numbers are the sequential executor's."""
import os
import subprocess
import sys

import pytest
import torch

# A fresh interpreter, poisoned as torch's autograd engine poisons a process whose threads
# run: any child forked from it dies at once. The course's workers must still train.
_SCRIPT = """
import os, sys
os.register_at_fork(after_in_child=lambda: os._exit(17))
from fedcore.runtime.course import Course
from tests.conftest import small_cfg

def run(executor):
    course = Course(small_cfg(None, executor=executor, executor_workers=2, torch_threads=1,
                              train__local_steps=1, federate__total_round_num=2)).build()
    course.run()
    return course, course.server.aggregator.global_state

if __name__ == "__main__":
    _, seq = run("sequential")
    course, par = run("processes")
    assert course.trainer.batched_fits > 0, "the pool fell back to sequential"
    assert seq.keys() == par.keys() and all(bool((seq[k] == par[k]).all()) for k in seq)
    print("ok", course.trainer.batched_fits)
"""


@pytest.mark.slow
def test_the_pool_works_in_a_process_that_must_not_fork(tmp_path):
    script = tmp_path / "poisoned.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[0] == "ok" and int(out.stdout.split()[1]) > 0


def test_a_poisoned_fork_is_what_the_test_above_guards_against():
    """The poison works: a plain fork of such a process dies with its exit code."""
    code = ("import os, multiprocessing as mp\n"
            "os.register_at_fork(after_in_child=lambda: os._exit(17))\n"
            "p = mp.get_context('fork').Process(target=print); p.start(); p.join()\n"
            "print(p.exitcode)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "17"


class _OnAccess(dict):
    """Clients whose data are made when asked (as a data set of a million clients would be):
    the mapping cannot list them, so the pool cannot send them to its workers up front."""

    def __init__(self, made):
        super().__init__()
        self.made = made

    def __missing__(self, cid):
        return self.made[cid]

    def __len__(self):
        return len(self.made)


def test_clients_made_on_access_go_to_the_workers_with_their_jobs():
    import dataclasses

    from fedcore.kernel import registry
    from fedcore.runtime.course import Course
    from tests.conftest import small_cfg

    def run(executor):
        cfg = small_cfg(None, executor=executor, executor_workers=2, torch_threads=1,
                        train__local_steps=2, federate__total_round_num=2)
        data = registry.components.get("federated_data")(cfg)
        course = Course(cfg).build(dataclasses.replace(data, clients=_OnAccess(data.clients)))
        summary = course.run()
        return summary, course.server.aggregator.global_state
    seq_summary, seq = run("sequential")
    summary, par = run("processes")
    assert summary["batched_fits"] == seq_summary["sequential_fits"] == 12   # 6 clients x 2 rounds
    assert summary["sequential_fits"] == 0
    # each worker reports its peak memory: it holds torch and a course, well over 100 MB
    assert summary["worker_peak_rss_mb"] > 100 and "worker_peak_rss_mb" not in seq_summary
    assert seq.keys() == par.keys() and all(torch.equal(seq[k], par[k]) for k in seq)
