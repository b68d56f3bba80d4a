"""Joining the course: clients announce themselves; the server starts when all are in."""
from __future__ import annotations

from fedcore.message import SERVER_ID

__all__ = ["join_in", "admit_client", "install"]


def join_in(client, _event) -> None:
    """Client `start`: ask the server to join."""
    client.send("join_in", SERVER_ID, {"client_id": client.id})


def admit_client(server, msg) -> None:
    """Server `receiving_join_in`: record the client; raise `all_joined_in` once all are in."""
    server.joined.add(msg.sender)
    if len(server.joined) == server.course.num_clients and not server.started:
        server.started = True
        server.trigger("all_joined_in")


def install(course) -> None:
    course.client_table.register("start", join_in, sends=("join_in",))
    course.server_table.register("receiving_join_in", admit_client, sends=("all_joined_in",))
