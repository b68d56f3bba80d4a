"""Content sent between the course and its workers (processes, Ray actors) in frames.

A model-sized message sent whole is one copy of it at the sender (its encoding) and two at
the receiver (the bytes and the tensors decoded from them). `framed` sends a header and then
the encoding in frames of FRAME bytes, each tensor's bytes from where they lie
(`encode_value_parts`, no copy; a parked global model's pages given back frame by frame), and
`receive_framed` writes the frames into one buffer of the announced size, or into an
unlinked file in the run's outdir where the round spills (`aggregator.spill`, wire/spooled.py),
and decodes the tensors in place there (wire/large.py): one copy, in the page cache where the
round spills. The wire format is `fedcore.wire.serialization`'s, never a pickle.
"""
from __future__ import annotations

import logging
from typing import Any

from fedcore.wire.codec import encode_value_parts
from fedcore.wire.large import RawValue, _placer, decode_raw_value
from fedcore.wire.serialization import WireError, encode_value
from fedcore.wire.spooled import Spool, release_view

__all__ = ["FRAME", "framed", "frames_of", "result_messages", "receive_framed"]

log = logging.getLogger("fedcore.executor")

FRAME = 2 ** 24   # bytes of an encoding sent at a time (a pipe's message, an object, a file's write)
JOINED = 2 ** 16  # pieces of an encoding smaller than this are joined into one frame


def framed(obj: Any, **header: Any):
    """`obj` as the messages that carry it: a header (`header` and the size of `obj`'s
    encoding), then that encoding in frames of at most FRAME bytes. A tensor's bytes are sent
    from where they lie (`encode_value_parts`), each frame's pages given back once sent where
    they lie in a file (a parked global model); the receiver writes the frames one by one
    into a buffer or a file (`receive_framed`): the encoding is never whole in the sender,
    and only once in the receiver."""
    parts = [memoryview(p).cast("B") for p in encode_value_parts(obj)]
    yield encode_value({**header, "size": sum(len(p) for p in parts)})
    run, joined = [], 0
    for part in parts:
        if len(part) < JOINED:   # the fields' heads between tensors, small values: joined
            run.append(part)
            joined += len(part)
            if joined < FRAME:
                continue
            part, run, joined = memoryview(b"".join(run)), [], 0
        elif run:
            yield b"".join(run)
            run, joined = [], 0
        for at in range(0, len(part), FRAME):
            yield part[at:at + FRAME]
            release_view(part[at:at + FRAME])
    if run:
        yield b"".join(run)


def result_messages(out: dict):
    """One client's result as the messages that carry it (`framed`): work and metrics in the
    header, the content and the new state (a model's size each, SCAFFOLD's c_i) in frames."""
    return framed({"content": out["content"], "state": out["state"]}, work=out["work"],
                  metrics=out["metrics"])


def frames_of(recv, size: int):
    """The frames of an encoding of `size` bytes, each from `recv()`."""
    got = 0
    while got < size:
        frame = recv()
        got += len(frame)
        if got > size:
            raise WireError(f"frames of {got} bytes for an encoding of {size}")
        yield frame


def decoded_in_place(buf) -> Any:
    """The value encoded in `buf` (a bytearray or a file's mapping, writable): its large
    tensors view `buf` instead of being copied (wire/large.py), so the encoding and the
    decoded tensors are not held at once."""
    view = memoryview(buf)
    return decode_raw_value(RawValue(view, 0, len(view), _placer(view)))


_SAID: set[str | None] = set()   # folders said to refuse a file (once each per process)


def _cannot(folder: str | None, exc: OSError) -> None:
    if folder not in _SAID:
        _SAID.add(folder)
        log.warning("aggregator.spill: a result could not be received into a file in %s (%s); "
                    "such results wait in memory", folder or "the temporary folder", exc)


def spooled(frames, size: int, folder: str | None):
    """`frames` (buffers, `size` bytes in all) written one by one to an unlinked file in
    `folder` and mapped (wire/spooled.py): the bytes cost the page cache, not the process.
    Where the file cannot be written, the rest is received into memory (said once)."""
    try:
        spool = Spool(folder, hashed=False)
    except OSError as exc:
        spool, buf = None, bytearray()
        _cannot(folder, exc)
    for frame in frames:
        if spool is not None:
            try:
                spool.write(frame)
                continue
            except OSError as exc:
                _cannot(folder, exc)
                buf, spool = spool.read_all(), None
        buf += frame
    if spool is None:
        return buf
    try:
        return spool.mapping()
    except OSError:
        return spool.read_all()


def receive_framed(frames, size: int, spill: bool, folder: str | None) -> Any:
    """What `framed` sent, from its `size` bytes of frames (`frames_of`), decoded in place:
    received into a file where the round spills (`spooled`), else into one buffer."""
    if spill:
        buf = spooled(frames, size, folder)
    else:
        buf, at = bytearray(size), 0
        for frame in frames:
            buf[at:at + len(frame)] = frame
            at += len(frame)
    return decoded_in_place(buf)
