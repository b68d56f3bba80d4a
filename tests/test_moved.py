"""The deprecation path of moved modules (fedcore/kernel/moved.py): each old import path gives
the moved module itself, with a DeprecationWarning that names the new path and is attributed
to the importing line, until the release that removes the old paths."""
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import fedcore
from fedcore.kernel import moved

ROOT = Path(__file__).resolve().parents[1]
# the layout of 0.1.0 and before, written out here rather than read from the module under test
OLD_TO_NEW = {
    "fedcore.worker": "fedcore.kernel.worker",
    "fedcore.course": "fedcore.runtime.course",
    "fedcore.registry": "fedcore.kernel.registry",
    "fedcore.contract": "fedcore.kernel.contract",
    "fedcore.serialization": "fedcore.wire.serialization",
    "fedcore.distributed": "fedcore.deployment.distributed",
    "fedcore.client_state": "fedcore.comm.client_state",
    "fedcore.vectorized": "fedcore.execution.vectorized",
    "fedcore.algorithms.inner_loop": "fedcore.kernel.inner_loop",
}


def _import_fresh(old: str):
    """Import `old` as a first import would, recording the warnings."""
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)   # this line is where the warning must point
    return module, [w for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(f"fedcore.{name}" for name in moved.MOVED))
def test_every_old_path_gives_the_moved_module_and_warns_with_its_new_path(old):
    new = f"fedcore.{moved.MOVED[old.removeprefix('fedcore.')]}"
    module, caught = _import_fresh(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new   # its own spec, not the alias's
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert old in message and f"import {new} " in message and moved.REMOVED_IN in message
    assert caught[0].filename == __file__   # the importing line, not the import machinery


def test_the_layout_of_earlier_releases_is_registered():
    for old, new in OLD_TO_NEW.items():
        assert moved.new_path(old) == new
    assert moved.new_path("fedcore.kernel.worker") is None and moved.new_path("worker") is None


def test_old_statement_forms_give_the_same_objects():
    for name in ("worker", "course"):   # as in a process that never imported them
        sys.modules.pop(f"fedcore.{name}", None)
        vars(fedcore).pop(name, None)
    with pytest.warns(DeprecationWarning, match=r"import fedcore\.kernel\.worker "):
        import fedcore.worker as old_worker
    from fedcore.kernel.worker import Worker
    assert old_worker.Worker is Worker
    with pytest.warns(DeprecationWarning, match=r"import fedcore\.runtime\.course "):
        from fedcore import course
    from fedcore.runtime.course import Course
    assert course.Course is Course


def test_an_unregistered_name_is_still_missing():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("fedcore.no_such_module")


def test_no_old_file_is_left_to_shadow_an_alias_and_every_new_module_exists():
    packages = {"fedcore": ROOT / "fedcore", "fedcore.algorithms": ROOT / "algorithms"}
    for old, new in moved.MOVED.items():
        package, _, leaf = f"fedcore.{old}".rpartition(".")
        assert not (packages[package] / f"{leaf}.py").exists(), old
        assert importlib.util.find_spec(f"fedcore.{new}") is not None, new


def test_python_m_with_an_old_name_runs_the_moved_module_and_says_so():
    done = subprocess.run([sys.executable, "-W", "default::DeprecationWarning", "-m", "fedcore.key_index",
                           "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "fedcore.key_index is deprecated: import fedcore.kernel.key_index " in done.stderr


def test_the_old_paths_are_gone_by_the_release_that_removes_them():
    """Reaching REMOVED_IN fails here: delete the aliases (and list them under Removed)."""
    version = tuple(int(p) for p in fedcore.__version__.split(".")[:2])
    assert version < tuple(int(p) for p in moved.REMOVED_IN.split(".")[:2]), \
        f"fedcore {fedcore.__version__} removes the old import paths (fedcore/kernel/moved.py)"
