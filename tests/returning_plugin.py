"""A client restarted mid-course, staged by a test: the restarted process is slow to build its
course, the other clients wait before a chosen round until the test lets them go, and the
server notes the joins it handles and the models it sends. Nothing here changes what is
computed.

Loaded through `plugins: [tests.returning_plugin]`:
- `FEDCORE_TEST_BUILD_DELAY=SECONDS`, in the environment of one client process: it sleeps
  that long while building its course, after its welcome and before its join (as a client
  on a loaded machine takes seconds to import and build; its heartbeats go on);
- `returning_test.hold_clients` wait, before training each round R of
  `returning_test.hold_rounds`, until the file `<returning_test.folder>/go_R` exists (at most
  `returning_test.hold_max` s);
- the server appends to `<returning_test.folder>/server_notes` a line `join CLIENT ROUND` for
  each join it handles (ROUND: the round in progress) and `models ROUND CLIENT...` for each
  round's models it sends.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from fedcore.kernel.config import declare
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.registry import behaviours

BUILD_DELAY_ENV = "FEDCORE_TEST_BUILD_DELAY"

declare("returning_test.folder", str, None, "tests: folder of the go_* files and the server's notes")
declare("returning_test.hold_clients", list, [], "tests: clients that wait for <folder>/go_<round>")
declare("returning_test.hold_rounds", list, [], "tests: the rounds before which they wait")
declare("returning_test.hold_max", float, 120.0, "tests: the longest they wait")


def notes(folder: Path) -> list[list[str]]:
    """The server's notes so far, each line split in words (a line being written is not read)."""
    f = Path(folder) / "server_notes"
    if not f.exists():
        return []
    text = f.read_text()
    return [line.split() for line in text[:text.rfind("\n") + 1].splitlines()]


def _note(folder: Path, line: str) -> None:
    with open(Path(folder) / "server_notes", "a") as fh:
        fh.write(line + "\n")


def _install_client(course) -> None:
    cfg = course.cfg
    if os.environ.get(BUILD_DELAY_ENV):
        print(f"fedcore: test pause while building client {course.client_ids}", flush=True)
        time.sleep(float(os.environ[BUILD_DELAY_ENV]))

    def held_fit(fit, client_id, data, received, round_):
        if client_id in cfg["returning_test.hold_clients"] and round_ in cfg["returning_test.hold_rounds"]:
            go = Path(cfg["returning_test.folder"]) / f"go_{round_}"
            deadline = time.monotonic() + cfg["returning_test.hold_max"]
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return fit(client_id, data, received, round_)
    course.trainer.wrap(Wrapper("returning_test_hold", "fit", held_fit))


def _install_server(course) -> None:
    folder = course.cfg["returning_test.folder"]
    course.server_table.observe("receiving_join_in",
                                lambda server, msg: _note(folder, f"join {msg.sender} {server.round}"))
    send = course.comm.send

    def noting_send(msg):
        if msg.msg_type == "models":
            _note(folder, " ".join(map(str, ["models", msg.round, *msg.receivers])))
        return send(msg)
    course.comm.send = noting_send


def install(course) -> None:
    if course.trainer is not None:
        _install_client(course)
    elif getattr(course, "comm", None) is not None:   # a deployed server
        _install_server(course)


install.enabled = lambda cfg: bool(cfg["returning_test.folder"])
behaviours.register("returning_test", install)
