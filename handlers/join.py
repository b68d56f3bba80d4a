"""Joining the course: clients announce themselves; the server starts when all are in.

A client declares its training-sample count when it joins; the admission layer
refuses any later update that claims more (`fedcore.runtime.admission`). A deployed client
that holds a saved state also declares `state_round`, the round of that state (absent:
none; see `fedcore.comm.client_state`).
"""
from __future__ import annotations

from fedcore.runtime.admission import AdmissionState

__all__ = ["join_in", "admit_client", "note_join", "install"]


def join_in(client, _event) -> None:
    """Client `start`: ask its server (its parent) to join, declaring how many training samples
    it holds."""
    data = getattr(client, "data", None)
    train = getattr(data, "train", None)
    content = {"client_id": client.id}
    if train is not None:
        content["num_samples"] = len(train)
    state_round = getattr(client, "state_round", -1)   # a deployed client's saved state
    if state_round >= 0:   # none: the same declaration as in simulation, byte for byte
        content["state_round"] = state_round
    client.send("join_in", client.parent, content)


def admit_client(server, msg) -> None:
    """Server `receiving_join_in`: record the client (and its declared sample count); raise
    `all_joined_in` once all are in."""
    note_join(server, msg)
    if len(server.joined) == server.course.num_clients and not server.started:
        server.started = True
        server.trigger("all_joined_in")


def note_join(server, msg) -> None:
    """Record a member that joined, and the first sample count it declared (a client may not
    raise its own bound by joining again)."""
    server.joined.add(msg.sender)
    declared = msg.content.get("num_samples") if isinstance(msg.content, dict) else None
    if declared is not None:
        server.state(AdmissionState).declared.setdefault(msg.sender, declared)


def install(course) -> None:
    course.client_table.register("start", join_in, sends=("join_in",))
    course.server_table.register("receiving_join_in", admit_client, sends=("all_joined_in",))
