"""A deployed server resuming its course from a snapshot, and the clients rejoining it.

The server restores the snapshot of round r (the same file a simulation
writes and reads, `fedcore.runtime.checkpoint`), keeps the first lines of its
metrics.jsonl that the snapshot had written and drops the rest, and waits for
its clients as a new course would; once they are in, round r + 1 runs from its
start (a round in flight when the server died is run again). Every welcome
says `resumed_round: r` (0 for a course that was not resumed).

Which round a rejoining client's state belongs to. A client joins with
`state_round` S: the last round whose training it completed and kept (-1 or
absent: none). The server expects E, the latest round whose update from that
client it aggregated (the round the update was trained for: in a synchronous
course the round it was aggregated in; -1: none), and allows at
most U, the last round it completed, or the round in progress once this
incarnation has started it. A client whose state is of a round after
`resumed_round` has first rolled back to its state of the latest round <= r it
trained (or, holding none, reset to a fresh client's state and declared -1).
Then:
- E <= S <= U: the client continues with its state (S > E: it trained rounds
  whose updates were not aggregated, as it would have in an uninterrupted
  course).
- S < E (state older than its aggregated updates: lost or reset) or S > U (it
  did not roll back): admitted, with one warning naming client, S, E and U,
  and an entry in the summary's `state_mismatch`; the server never guesses a
  state for it: it is a client with the state it has.
"""
from __future__ import annotations

import logging
from pathlib import Path

from fedcore.runtime.checkpoint import load, restore
from fedcore.runtime.snapshot import LATEST, snapshots

__all__ = ["resume_server", "check_state_round", "not_aggregated_yet", "listed_in_summary", "LISTED"]

log = logging.getLogger("fedcore.deploy")

LISTED = 50  # entries kept in each summary list; the counts go on


def listed_in_summary(server, key: str, entry: dict) -> None:
    """Append `entry` to the summary's list `key` (bounded) and count it in `key_total`."""
    server.course.monitor.append_summary("deployment", key, entry, limit=LISTED)
    server.course.monitor.tally("deployment", f"{key}_total")


def resume_server(course, value: str) -> int:
    """Restore the built server `course` from `value` (a snapshot or `latest`); returns the
    round it resumes from. Clients are waited for as at a start. `latest` with no snapshot
    yet (a server that died in its first round) starts the course from its beginning."""
    folder = course.checkpointer.folder
    if value == LATEST and (folder is None or not snapshots(folder)):
        log.warning("resume_from=latest: no snapshot in %s yet; the course starts from round 1", folder)
        return 0
    used, state = load(course, value)
    restore(course, state, metrics_lines=state.get("metrics_lines"))
    course.scheduler.continue_from(state["virtual_time"])   # times go on from the snapshot's
    server = course.server
    r = state["round"]
    server.round = r + 1
    server.joined, server.started = set(), False
    course.checkpointer.last_path = Path(used)
    course.monitor.add_summary("resume", {"resumed_from": {"round": r, "snapshot": used}})
    log.warning("resuming the course from the snapshot of round %d (%s); round %d runs next",
                r, used, r + 1)
    return r


def check_state_round(server, msg) -> None:
    """A `join_in` received: compare the client's `state_round` with what the server expects."""
    content = getattr(msg, "content", None)
    content = content if isinstance(content, dict) else {}
    if "state_round" not in content:
        return   # a client that keeps no state on disk: nothing to compare
    s = content["state_round"]
    e = server.course.checkpointer.contributed.get(msg.sender, -1)
    u = server.round if server.started else server.round - 1
    if e <= s <= u:
        return
    why = ("older than its last aggregated update" if s < e
           else "newer than the course (it should have rolled back)")
    log.warning("client %d joined with its state of round %d, %s (expected %d..%d); it continues "
                "with that state", msg.sender, s, why, e, u)
    listed_in_summary(server, "state_mismatch", {"client": msg.sender, "state_round": s,
                                                 "expected": [e, u], "round": server.round})


def not_aggregated_yet(course, msg) -> bool:
    """An update is aggregated at most once: one from a client that has not joined this
    server (sent to the server's previous incarnation, which may have aggregated it, and
    sent again on reconnecting) is dropped, with a line; the client joins and is sent the
    model again."""
    if msg.sender in course.server.joined:
        return True
    course.comm.quiet_info(f"before join {msg.sender}", f"client {msg.sender}: dropped its update of "
                           f"round {msg.round}, sent before it joined this server", logging.INFO)
    course.monitor.tally("deployment", "updates_before_join")
    return False
