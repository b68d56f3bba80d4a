"""Completeness: the message-flow graph passes, warns, or refuses the course (exit 3)."""
import os

import networkx as nx
import pytest

from fedcore.kernel.completeness import FINISH, START, check_course
from fedcore.runtime.course import Course
from fedcore.kernel.errors import IncompleteCourseError
from fedcore.kernel.worker import HandlerTable
from tests.conftest import small_cfg
from tests.deploy_helpers import run_fedcore


def test_default_course_is_complete_and_graph_is_written(tmp_path):
    course = Course(small_cfg(tmp_path)).build()
    course.write_header()
    result = course.check()
    assert result.complete and not result.missing
    g = nx.read_graphml(tmp_path / "message_flow.graphml")
    assert nx.has_path(g, START, FINISH)
    # message edges keep their direction of travel
    kinds = {d["kind"] for _, _, d in g.edges(data=True)}
    assert {"client->server", "server->client", "condition"} <= kinds


def test_missing_aggregation_handler_is_refused_naming_the_link(tmp_path):
    course = Course(small_cfg(tmp_path)).build()
    del course.server_table.entries["all_received"]
    with pytest.raises(IncompleteCourseError) as info:
        course.check()
    assert "all_received" in str(info.value)
    assert "server:receiving_updates" in str(info.value)


def test_unhandled_message_and_unreachable_handler_warn():
    server, client = HandlerTable("server"), HandlerTable("client")
    client.register("start", lambda w, e: None, sends=("join_in",))
    server.register("receiving_join_in", lambda w, m: None, sends=("finish", "gossip"))
    client.register("receiving_finish", lambda w, m: None)
    server.register("receiving_orphan", lambda w, m: None)
    result = check_course([server, client])
    assert result.complete
    assert any("'gossip'" in w for w in result.warnings)
    assert any("server:receiving_orphan" in w and "never reached" in w for w in result.warnings)


def test_a_handler_reached_from_outside_the_flow_says_by_what_and_adds_no_path():
    server, client = HandlerTable("server"), HandlerTable("client")
    client.register("start", lambda w, e: None, sends=("join_in",))
    server.register("receiving_join_in", lambda w, m: None)
    server.register("receiving_intrusion", lambda w, m: None, sends=("finish",),
                    reached_by="a client that breaks the protocol")
    result = check_course([server, client])
    assert not result.complete            # its 'finish' is no path from start
    assert not any("receiving_intrusion" in w for w in result.warnings)
    assert result.graph.nodes["server:receiving_intrusion"]["reached_by"] == "a client that breaks the protocol"


@pytest.mark.extra("secagg")
def test_the_secure_course_is_checked_without_warnings(tmp_path):
    course = Course(small_cfg(tmp_path, secure_aggregation__enabled=True)).build()
    result = course.check()
    assert result.complete and result.warnings == []


def test_client_to_client_edges_are_distinct():
    server, client = HandlerTable("server"), HandlerTable("client")
    client.register("start", lambda w, e: None, sends=("gossip",))
    client.register("receiving_gossip", lambda w, m: None, sends=("finish",))
    g = check_course([server, client]).graph
    assert g.edges["client:start", "client:receiving_gossip"]["kind"] == "client->client"


def test_cli_check_exits_3_for_an_incomplete_course(tmp_path):
    plugin = tmp_path / "broken_course.py"
    plugin.write_text(
        "from fedcore.kernel.registry import courses\n"
        "from fedcore.handlers import sync\n"
        "@courses.register('no_aggregation')\n"
        "def install(course):\n"
        "    sync.install(course)\n"
        "    del course.server_table.entries['all_received']\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"plugins: [broken_course]\ncourse: no_aggregation\noutdir: {tmp_path / 'out'}\n"
                   "federate: {client_num: 3, total_round_num: 1}\n"
                   "data: {synthetic: {samples_per_client: 20}}\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for extra in (["--check"], []):
        r = run_fedcore(["--cfg", cfg, *extra], env=env, timeout=120)
        assert r.returncode == 3, r.stderr
        assert "all_received" in r.stderr


def test_cli_overrides_may_follow_check(tmp_path):
    """`--cfg X --check KEY=VALUE`: the override applies (here: where the graph is written)."""
    from fedcore.run import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text("federate: {client_num: 3, total_round_num: 1}\n"
                   "data: {synthetic: {samples_per_client: 20}}\n")
    out = tmp_path / "out"
    assert main(["--cfg", str(cfg), "--check", f"outdir={out}"]) == 0
    assert (out / "message_flow.graphml").is_file()
