"""Shared test helpers: small configs and courses that run in a fraction of a second."""
from __future__ import annotations

import importlib.util
import os
import signal
import sys

import pytest
import torch

from fedcore.kernel.config import load_config

pytest_plugins = ["tests.alone"]   # under `pytest -n`, an `alone` test has the machine to itself


# optional extras (setup.cfg) -> the modules a test of them imports, itself or in its processes
EXTRAS = {
    "secagg": ("cryptography",), "certs": ("cryptography",), "data": ("sklearn",),
    "tune": ("optuna",), "plot": ("matplotlib",), "tensorboard": ("tensorboard",),
    "mlflow": ("mlflow",), "wandb": ("wandb",), "ray": ("ray",),
    "llm": ("transformers", "peft", "datasets"), "ops": ("prometheus_client",),
    "trees": ("xgboost",), "vertical": ("phe", "cryptography"),
    "dev": ("grpc_tools",),   # test tools of the dev extra: protoc, opacus
}


def skip_module_without(extra: str, *modules: str):
    """At a module's top: skip it unless the extra (or those of its `modules` it uses) is
    installed, without importing it: transformers and peft take seconds to import, and each
    xdist worker collects every module."""
    missing = [m for m in modules or EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(_missing(extra, missing[0]), allow_module_level=True)


class lazy_module:
    """A module imported at its first use: collecting a test module then costs no import
    (xgboost and scikit-learn take seconds, in every xdist worker)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):   # what collection asks of every module attribute (__test__, ...)
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)


def _missing(extra: str, module: str) -> str:
    return f"needs the optional extra '{extra}' ({module} is not installed: pip install \"fedcore[{extra}]\")"


def need_extra(extra: str, *modules: str):
    """Skip the calling test (or, at a module's top, the whole module) unless the optional extra
    is installed; return the first module. `modules` narrows the check to those the test uses."""
    found = [pytest.importorskip(m, reason=_missing(extra, m)) for m in modules or EXTRAS[extra]]
    return found[0]


def pytest_configure(config):
    # Test modules are rewritten (assertions) on import and the result cached in __pycache__
    # (ignored by git), unless bytecode writing is off (PYTHONDONTWRITEBYTECODE): then every
    # xdist worker rewrites all of them again, about 5 s of CPU each. The suite caches them.
    sys.dont_write_bytecode = False
    # A run started in the background (`nohup pytest ... &`) inherits SIGINT ignored, and so
    # would every process the tests start, which then could not be interrupted as the interrupt
    # tests do: the suite puts Python's handler back (a process it starts gets the default).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "extra(name): the test needs the optional extra `name` "
                            "(its processes import it); skipped with a reason where it is missing")


def pytest_ignore_collect(collection_path, config):
    """`-m alone`, the suite's second part, collects only the modules that mark a test `alone`
    (the text `mark.alone`): no other can hold one, and collecting every module again costs
    more CPU than the part's tests themselves."""
    if (config.option.markexpr or "").strip() != "alone" or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    try:
        return "mark.alone" not in collection_path.read_text(errors="replace") or None
    except OSError:
        return None


@pytest.hookimpl(tryfirst=True)   # before -m deselects: `-m "not deploy"` must see the marker
def pytest_collection_modifyitems(items):
    for item in items:   # real processes on loopback: the bulk of the suite's time
        if item.path.name.startswith("test_deploy_"):
            item.add_marker(pytest.mark.deploy)
    # the long tests first (a stable sort: each file's order is kept), so that workers of
    # `pytest -n` share them from the start and the run does not end waiting on one
    items.sort(key=lambda item: item.get_closest_marker("slow") is None
               and item.get_closest_marker("deploy") is None)


def pytest_runtest_setup(item):
    for mark in item.iter_markers("extra"):
        need_extra(*mark.args)


# `torch_threads: auto` gives a large model every usable core; the tests' courses, here and in
# the processes they start, run side by side on one machine: one thread each, as before
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(1)  # tests are many small models: threads only add overhead


def small_cfg(tmp_path=None, **overrides):
    """A tiny FedAvg course on synthetic data; keyword overrides use '__' for '.'."""
    base = {
        "seed": 0, "verbose": False,
        "federate.client_num": 6, "federate.total_round_num": 2,
        "data.type": "synthetic", "data.partition": "natural",
        "data.synthetic.samples_per_client": 30, "data.synthetic.dim": 8,
        "data.synthetic.num_classes": 3,
        "train.batch_size": 10, "train.optimizer.lr": 0.1,
    }
    if tmp_path is not None:
        base["outdir"] = str(tmp_path)
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(None, extra=base)


@pytest.fixture
def procs(tmp_path):
    """Real processes started by a test, always killed at its end."""
    from tests.deploy_helpers import Procs
    p = Procs(tmp_path)
    yield p
    p.cleanup()
