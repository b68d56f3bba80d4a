"""A hostile edge (tests/hostile_edge.py: its own cloud token, no client, a model +50 on every
entry each round) that joins twice, to re-declare: the cloud keeps the first admitted
declaration of an edge (`join.note_join`), and a refused one counts for 0, so a second join can
neither raise its weight past what it first declared nor undo a refusal. Expected models from
the update rule by hand (tests/test_hierarchy_hostile_edge.py's helpers)."""
import logging

import pytest

from fedcore.kernel.message import SERVER_ID
from tests.hostile_edge import DECLARED
from tests.test_hierarchy_hostile_edge import BOUNDS, ROUNDS, _expected_within_bound, _final, _honest_round, \
    _hostile_course


def _joining_twice(course, first, second):
    def join(edge, _msg=None):
        if not edge.started:
            edge.started = True
            for n in (first, second):
                edge.send("join_in", SERVER_ID, {"client_id": edge.id, "num_samples": n})
    course.edges[9].handlers.register("receiving_join_in", join, sends=("join_in",))


@pytest.mark.parametrize("first, second, weighs", [
    (DECLARED, BOUNDS[9], False),   # refused, then its bound: still 0
    (0, BOUNDS[9], False),          # 0, then its bound: still 0
    (BOUNDS[9], DECLARED, True),    # its bound, then 10^9 (refused): still its bound, no more
], ids=["1e9-then-bound", "0-then-bound", "bound-then-1e9"])
def test_an_edge_joining_again_cannot_re_declare(tmp_path, first, second, weighs):
    course, (w, b) = _hostile_course(tmp_path, BOUNDS[9], BOUNDS[9])
    _joining_twice(course, first, second)
    course.run()
    for _ in range(ROUNDS):
        w, b = _expected_within_bound("none", w, b) if weighs else _honest_round(w, b)
    assert _final(tmp_path) == pytest.approx((w, b), abs=1e-12)


@pytest.mark.parametrize("first, second, outcome", [
    (DECLARED, BOUNDS[9], "it counts for 0 samples"),
    (BOUNDS[9], DECLARED, f"the count it was first admitted with ({BOUNDS[9]} samples) stands"),
], ids=["refused-at-first-join", "refused-at-second-join"])
def test_the_cloud_logs_what_a_refused_declaration_leaves_the_edge(tmp_path, caplog, first, second, outcome):
    """A refusal at a second join leaves the edge its first admitted count (the test above), and
    the log says so rather than that it counts for 0."""
    course, _ = _hostile_course(tmp_path, BOUNDS[9], BOUNDS[9])
    _joining_twice(course, first, second)
    with caplog.at_level(logging.WARNING, logger="fedcore.admission"):
        course.run()
    [line] = [r.getMessage() for r in caplog.records if "refused edge 9's declaration" in r.getMessage()]
    assert line.endswith(f"together; {outcome}")
