"""The completeness check: is there a path from the course's start to its finish?

The graph is drawn from the registrations alone (nothing runs): one node per
`(role, event)` handler plus `start` and `finish`. A handler's declared
`sends` give its edges: a condition event raised on the same role, or a
message type received by a role's `receiving_<type>` handler (edges are
labelled client->server, server->client or client->client). Sending the
message type `finish` reaches the `finish` node. A handler registered with
`reached_by` (a guard, or an event the runtime raises) is not warned about when
no path reaches it; it adds no path either.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import networkx as nx

from fedcore.kernel.errors import IncompleteCourseError
from fedcore.kernel.files import write_atomic
from fedcore.kernel.message import receiving
from fedcore.kernel.worker import HandlerTable

__all__ = ["CheckResult", "build_graph", "check_course", "START", "FINISH"]

log = logging.getLogger("fedcore.completeness")

START = "start"
RESUME = "resume"   # raised instead of `start` when a course continues from a checkpoint
FINISH = "finish"


@dataclass
class CheckResult:
    graph: nx.DiGraph
    complete: bool
    missing: list[str] = field(default_factory=list)    # the broken links on the way
    warnings: list[str] = field(default_factory=list)


def _node(role: str, event: str) -> str:
    return f"{role}:{event}"


def build_graph(tables: list[HandlerTable]) -> tuple[nx.DiGraph, list[tuple[str, str, str]]]:
    """The flow graph, plus the dangling sends `(node, item, why)` found while drawing it."""
    g = nx.DiGraph()
    g.add_node(START, kind="terminal")
    g.add_node(FINISH, kind="terminal")
    for t in tables:
        for event, reg in t.entries.items():
            g.add_node(_node(t.role, event), kind="handler", role=t.role, event=event, handler=reg.name,
                       reached_by=reg.reached_by)
    dangling: list[tuple[str, str, str]] = []
    for t in tables:
        for entry in (START, RESUME):
            if entry in t.entries:
                g.add_edge(START, _node(t.role, entry), kind="start")
        for event, reg in t.entries.items():
            src = _node(t.role, event)
            for item in reg.sends:
                reached = False
                if item == FINISH:
                    g.add_edge(src, FINISH, kind="finish")
                    reached = True
                if item in t.entries and not item.startswith("receiving_"):
                    g.add_edge(src, _node(t.role, item), kind="condition")
                    reached = True
                for other in tables:
                    if receiving(item) in other.entries:
                        g.add_edge(src, _node(other.role, receiving(item)),
                                   kind=f"{t.role}->{other.role}", msg_type=item)
                        reached = True
                if not reached:
                    dangling.append((src, item, f"no {t.role} handler for condition '{item}' and no "
                                               f"worker handles message '{item}' ('{receiving(item)}')"))
    return g, dangling


def check_course(tables: list[HandlerTable], graphml: Path | None = None,
                 tiers: nx.DiGraph | None = None) -> CheckResult:
    """Check start->finish reachability; write the graph (with the workers' tree `tiers`
    beside the handler flow, for a course with edge aggregators); raise nothing (see `require`)."""
    g, dangling = build_graph(tables)
    if tiers is not None:
        g = nx.union(g, tiers)
    if graphml is not None:
        write_atomic(graphml, lambda fh: nx.write_graphml(g, fh))
    reachable = nx.descendants(g, START) | {START}
    complete = FINISH in reachable
    result = CheckResult(g, complete)
    for node, item, why in dangling:
        line = f"{node} sends '{item}', but {why}"
        if node in reachable and not complete:
            result.missing.append(line)
        result.warnings.append(line)
    for node, data in g.nodes(data=True):
        if data.get("kind") == "handler" and node not in reachable and not data.get("reached_by"):
            result.warnings.append(f"handler {node} ({data['handler']}) is never reached from start")
    if not complete and not result.missing:
        result.missing.append("no handler reachable from start sends 'finish'")
    return result


def require_complete(tables: list[HandlerTable], graphml: Path | None = None,
                     tiers: nx.DiGraph | None = None) -> CheckResult:
    """Run the check, log its warnings, and refuse an incomplete course."""
    result = check_course(tables, graphml, tiers)
    for w in result.warnings:
        log.warning("completeness: %s", w)
    if not result.complete:
        raise IncompleteCourseError("incomplete course: no path from start to finish: "
                                    + "; ".join(result.missing))
    return result
