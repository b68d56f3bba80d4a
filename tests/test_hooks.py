"""The composition of behaviours: an ordered chain of declared wrappers per plug-in method,
which executors read, and no module that replaces a method of a live plug-in object."""
import ast
import pathlib

import pytest

from fedcore.kernel.contract import Aggregator, Trainer
from fedcore.kernel.hooks import METHODS, Wrappable, Wrapper, around_result, refusal, wrappers

ROOT = pathlib.Path(__file__).resolve().parents[1]


class Plain(Wrappable):
    def __init__(self):
        self.calls = []

    def fit(self, x):
        self.calls.append(("plain", x))
        return [x]


class Sub(Plain):
    def fit(self, x):
        return super().fit(x + 1) + ["sub"]


class Mixin:   # not a plug-in class itself: put before one, as tests/slow_plugin.py does
    def fit(self, x):
        return ["mixin"] + super().fit(x)


class Mixed(Mixin, Sub):
    pass


def _tag(name, log):
    def around(inner, x):
        log.append(f"{name} in")
        out = inner(x)
        log.append(f"{name} out")
        return out + [name]
    return around


def test_the_chain_runs_the_last_wrapped_outermost_and_the_plugins_own_method_innermost():
    p, log = Plain(), []
    p.wrap(Wrapper("first", "fit", _tag("first", log)))
    p.wrap(Wrapper("second", "fit", _tag("second", log)))
    assert p.fit(3) == [3, "first", "second"]
    assert log == ["second in", "first in", "first out", "second out"]
    assert [w.behaviour for w in wrappers(p, "fit")] == ["first", "second"]
    assert "fit" not in vars(p)   # the instance's method was never replaced


def test_super_inside_the_plugins_own_method_does_not_run_the_chain_again():
    for obj, expected in ((Sub(), [4, "sub", "w"]), (Mixed(), ["mixin", 4, "sub", "w"])):
        log = []
        obj.wrap(Wrapper("w", "fit", _tag("w", log)))
        assert obj.fit(3) == expected
        assert log == ["w in", "w out"] and obj.calls == [("plain", 4)]


def test_a_wrapper_that_calls_the_method_again_goes_through_the_chain_again():
    p, log = Plain(), []
    p.wrap(Wrapper("count", "fit", lambda inner, x: log.append(x) or inner(x)))
    p.wrap(Wrapper("twice", "fit", lambda inner, x: inner(x) + (p.fit(x - 1) if x > 0 else [])))
    assert p.fit(1) == [1, 0]
    assert log == [1, 0]


def test_the_chain_runs_around_a_result_computed_elsewhere():
    # what the vectorized executor does with a client's batched result; a wrapper whose work
    # the engine did already (the client's random stream) says what it does instead
    p, log = Plain(), []
    p.wrap(Wrapper("w", "fit", _tag("w", log)))
    p.wrap(Wrapper("stream", "fit", _tag("stream", log), around_result=_tag("counted", log)))
    assert around_result(p, "fit", ["batched"], 7) == ["batched", "w", "counted"]
    assert log == ["counted in", "w in", "w out", "counted out"]
    assert p.calls == []


def test_attributes_of_a_wrapped_plugin_read_and_write_as_before():
    p = Plain()
    p.wrap(Wrapper("w", "fit", lambda inner, x: inner(x)))
    p.extra = 5
    assert p.extra == 5 and p.fit(1) == [1]
    with pytest.raises(TypeError, match="no method 'aggregate'"):
        p.wrap(Wrapper("w", "aggregate", lambda inner, *a: inner(*a)))
    with pytest.raises(ValueError, match="'payload' is not one of"):
        Wrapper("w", "payload", lambda inner: inner())


def test_each_executor_reads_the_capabilities_the_wrappers_declare():
    p = Plain()
    assert refusal(p, "vectorized") is None
    p.wrap(Wrapper("noise", "fit", lambda inner, x: inner(x), per_client_result=True,
                   process_safe=True))
    assert all(refusal(p, e) is None for e in ("sequential", "vectorized", "processes", "ray"))
    p.wrap(Wrapper("personal model", "fit", lambda inner, x: inner(x), process_safe=True))
    assert refusal(p, "processes") is None and refusal(p, "ray") is None
    assert refusal(p, "vectorized") == (
        "executor vectorized cannot run behaviour personal model: its wrapper of the trainer's "
        "training needs more than each client's own result; executors that can: sequential, "
        "processes, ray")
    p.wrap(Wrapper("event", "fit", lambda inner, x: inner(x)))
    assert refusal(p, "processes") == (
        "executor processes cannot run behaviour event: its wrapper of the trainer's training "
        "touches state outside the trainer; executors that can: sequential")


def test_the_plugin_base_classes_dispatch_every_wrappable_method():
    for cls in (Trainer, Aggregator):
        assert issubclass(cls, Wrappable)
        for name in METHODS:
            method = getattr(cls, name, None)
            if method is not None:
                assert getattr(method, "_dispatches", None) == name, (cls, name)


# ---------------------------------------------------------------- no method replaced on a live object
def _method_assignments(path: pathlib.Path) -> list[str]:
    """`x.fit = ...`, `x.fit, y.aggregate = ...`, `setattr(x, "fit", ...)` and the like."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def targets(node):
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                yield from targets(elt)
        else:
            yield node
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for t in targets(target):
                    if isinstance(t, ast.Attribute) and t.attr in METHODS:
                        found.append(f"{path.name}:{node.lineno} .{t.attr} =")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "setattr" and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in METHODS:
            found.append(f"{path.name}:{node.lineno} setattr(.., {node.args[1].value!r})")
    return found


def test_the_scan_finds_a_method_replaced_on_an_object(tmp_path):
    bad = tmp_path / "sample.py"
    bad.write_text("def install(course):\n    t = course.trainer\n    fit = t.fit\n"
                   "    t.fit, t.begin = (lambda *a: fit(*a)), None\n"
                   "    setattr(course.server.aggregator, 'aggregate', None)\n")
    assert _method_assignments(bad) == [
        "sample.py:4 .fit =", "sample.py:4 .begin =", "sample.py:5 setattr(.., 'aggregate')"]


def test_no_module_outside_the_tests_replaces_a_method_of_a_plugin_object():
    # resolved: where fedcore/ maps the other packages through links, each file counts once
    files = sorted({f.resolve() for pkg in ("fedcore", "handlers", "algorithms", "scenarios")
                    for f in (ROOT / pkg).rglob("*.py")})
    assert len(files) > 100
    found = [hit for f in files for hit in _method_assignments(f)]
    assert found == [], found


@pytest.mark.parametrize("role", ["server", "client"])
def test_a_deployed_process_refuses_a_behaviour_that_declares_it_cannot_deploy(tmp_path, monkeypatch,
                                                                              role):
    # A behaviour whose wrapper needs clients and server in one process stops the deployed
    # process at build, in one line naming it; the same wrapper declared deployable passes.
    from fedcore.runtime.course import Course
    from fedcore.deployment.distributed import ClientCourse, ServerCourse
    from fedcore.kernel.errors import ConfigError
    from fedcore.kernel.scheduler import WallClockScheduler
    from tests.conftest import small_cfg
    deployable = [False]
    installed = Course.install_handlers

    def install_and_wrap(course):
        installed(course)
        plugin = course.server.aggregator if role == "server" else course.trainer
        method = "aggregate" if role == "server" else "fit"
        plugin.wrap(Wrapper("shared memo", method, lambda inner, *a: inner(*a),
                            deployable=deployable[0]))
    monkeypatch.setattr(Course, "install_handlers", install_and_wrap)

    class Comm:
        on_new_server = None

        def attach(self, worker):
            self.worker = worker

    def build():
        ids = {"distribute__client_id": 1} if role == "client" else {"distribute__insecure": True}
        cfg = small_cfg(None, federate__mode="distributed", distribute__role=role, **ids)
        if role == "server":
            return ServerCourse(cfg, tmp_path / "out").build()
        return ClientCourse(cfg, WallClockScheduler()).build(1, Comm())
    with pytest.raises(ConfigError) as refused:
        build()
    assert str(refused.value) == ("behaviour shared memo does not run in a deployed course (its "
                                  "wrapper needs the clients and the server in one process); run "
                                  "it in simulation")
    deployable[0] = True
    assert build().built
