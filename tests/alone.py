"""Under `pytest -n`, a test marked `alone` runs with no other test beside it: it waits for
the tests running on the other workers to end, and none starts until it ends, so the rates
and memory it compares are its own (tests/conftest.py loads this plug-in).

Two file locks shared by the workers of a run, taken in the same order by every test: a gate,
held by an `alone` test from before it waits (so that a stream of short tests on the other
workers cannot starve it), then the lock itself, shared by the others."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _alone_means_alone(request, tmp_path_factory):
    try:
        import fcntl
    except ImportError:   # no file locks (Windows): as without xdist
        fcntl = None
    if fcntl is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    root = tmp_path_factory.getbasetemp().parent   # the run's folder, above each worker's
    alone = request.node.get_closest_marker("alone") is not None
    with open(root / "alone.gate", "a") as gate, open(root / "alone.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
