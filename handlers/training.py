"""Client-side training: a received model becomes an update sent back."""
from __future__ import annotations

from time import perf_counter

__all__ = ["train_and_reply", "leave_course", "install"]


def train_and_reply(client, msg) -> None:
    """Client `receiving_models`: run the trainer, charge its work, send the update."""
    client.round = msg.round
    started = perf_counter()   # the wall seconds `time.mode: measured` charges
    result = client.course.trainer.fit(client.id, client.data, msg.content, msg.round)
    client.spend(result.work, perf_counter() - started)
    client.send("updates", client.parent, result.content, round_=msg.round,
                content_size=result.content_size)


def leave_course(client, msg) -> None:
    """Client `receiving_finish`: the course is over for this client."""
    client.finished = True


def install(course) -> None:
    course.client_table.register("receiving_models", train_and_reply, sends=("updates",))
    course.client_table.register("receiving_finish", leave_course)
