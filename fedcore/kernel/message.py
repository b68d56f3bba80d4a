"""Message: what workers send each other, and its honest size on the wire."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedcore.wire.codec import receiver_width, timestamp_size

__all__ = ["Message", "SERVER_ID", "receiving"]

SERVER_ID = 0


def _sizes():
    """The size functions, imported on first use: they know torch tensors, and a client
    without torch builds Messages but never asks their size."""
    global _SIZES
    if _SIZES is None:
        from fedcore.wire import serialization
        _SIZES = serialization
    return _SIZES


_SIZES = None


def receiving(msg_type: str) -> str:
    """The event a worker handles when a message of `msg_type` arrives."""
    return "receiving_" + msg_type


@dataclass(slots=True, eq=False)
class Message:
    """A typed message. `timestamp` is when it was sent (virtual or wall seconds).

    Content is passed by reference inside one process; it is serialized only
    when it crosses a process boundary. `nbytes` is the exact size of its
    protobuf envelope, computed once without encoding.
    """

    msg_type: str
    sender: int
    receivers: tuple[int, ...]
    round: int
    timestamp: float
    content: Any = None
    _content_size: int = field(default=-1, repr=False)
    _envelope_sizes: dict | None = field(default=None, repr=False)
    # the content was built for this receiver alone (decoded from the wire), not shared with
    # its sender: a handler may take it apart to free memory early (a folded update's model)
    owned: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.receivers, int):
            self.receivers = (self.receivers,)
        else:
            self.receivers = tuple(self.receivers)

    @property
    def content_size(self) -> int:
        """Bytes of the encoded content alone (computed once, without encoding)."""
        if self._content_size < 0:
            self._content_size = _sizes().encoded_size(self.content)
        return self._content_size

    def nbytes_to(self, receiver: int) -> int:
        """Exact bytes of the envelope that carries this message to `receiver`.

        Receivers differ only in their id's varint length, so a broadcast computes
        one size per id length, not one per receiver; and messages whose envelopes differ
        only in values of the same encoded length (a round's updates from many clients)
        share those sizes (`_envelope_sizes_of`).
        """
        width = _WIDTHS.get(receiver) or _width(receiver)
        sizes = self._envelope_sizes
        if sizes is None:
            sizes = self._envelope_sizes = _envelope_sizes_of(self)
        size = sizes.get(width)
        if size is None:
            size = sizes[width] = _sizes().envelope_size(self.msg_type, self.sender, (receiver,), self.round,
                                                self.timestamp, None, content_size=self.content_size)
        return size

    @property
    def nbytes(self) -> int:
        """Total bytes on the wire: one envelope per receiver."""
        return sum(self.nbytes_to(r) for r in self.receivers)


_WIDTHS: dict[int, int] = {}   # id (or round) -> its varint length in an envelope, as computed
_WIDTHS_LIMIT = 1 << 16        # values kept; beyond that the table starts afresh


def _width(value: int) -> int:
    """`receiver_width(value)`, remembered (every message asks it for two or three ids)."""
    if len(_WIDTHS) >= _WIDTHS_LIMIT:
        _WIDTHS.clear()
    width = _WIDTHS[value] = receiver_width(value)
    return width


_SHARED_SIZES: dict[tuple, dict[int, int]] = {}
_SHARED_LIMIT = 4096   # distinct envelope layouts kept; beyond that the table starts afresh


def _envelope_sizes_of(msg: Message) -> dict[int, int]:
    """The table of envelope sizes (by receiver id width) shared by every message of the same
    layout. An envelope's size depends on its sender and round only through their encoded
    lengths (nothing when 0), on its timestamp only through whether it is +0.0, and on its content
    only through the content's size: messages that agree on these have envelopes of one size."""
    sender, round_ = msg.sender, msg.round
    key = (msg.msg_type, (_WIDTHS.get(sender) or _width(sender)) if sender else 0,
           (_WIDTHS.get(round_) or _width(round_)) if round_ else 0, timestamp_size(msg.timestamp),
           msg.content_size)
    sizes = _SHARED_SIZES.get(key)
    if sizes is None:
        if len(_SHARED_SIZES) >= _SHARED_LIMIT:
            _SHARED_SIZES.clear()
        sizes = _SHARED_SIZES[key] = {}
    return sizes
