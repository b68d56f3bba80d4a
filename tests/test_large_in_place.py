"""A received large message is decoded without copying its big tensors (wire/large.py's
`consume`), and a message over 2 GiB goes through the chunked, protobuf-free path. Neither
test allocates a model's worth: the 2 GiB envelope lives in an anonymous mapping whose
untouched pages cost nothing."""
import mmap
import struct

import pytest
import torch

from fedcore.comm.chunking import Reassembler
from fedcore.wire.serialization import encode_envelope
from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.codec import WireError, from_value, uvarint
from fedcore.wire.large import IN_PLACE_BYTES, PROTOBUF_LIMIT, decode_large

MIB = 2 ** 20


def _content():
    g = torch.Generator().manual_seed(3)
    # keys of odd lengths put the tensors' data at unaligned offsets of the envelope
    return {"model": {"a": torch.randn(MIB // 4 + 1, generator=g),
                      "bbb": torch.randn(MIB // 8 + 3, generator=g, dtype=torch.float64),
                      "cc": torch.randint(-999, 999, (MIB // 2 + 7,), generator=g, dtype=torch.int16),
                      "d": torch.randn(3, MIB // 6, generator=g).to(torch.bfloat16),
                      "small": torch.randn(5, generator=g)},
            "num_samples": 7}


def _inside(t: torch.Tensor, buf) -> bool:
    start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    return start <= t.data_ptr() < start + len(buf)


def test_consumed_bytes_become_the_tensors_aligned_and_equal():
    content = _content()
    data = encode_envelope("updates", 2, (0,), 1, 0.5, content)
    buf = bytearray(data)
    got = from_value(decode_large(buf, consume=True).content)
    for name, t in content["model"].items():
        out = got["model"][name]
        assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t), name
        big = t.numel() * t.element_size() >= IN_PLACE_BYTES
        assert _inside(out, buf) == big, name                  # viewed, not copied
        assert out.data_ptr() % t.element_size() == 0, name   # at an address its dtype allows
    assert got["num_samples"] == 7
    # at least one tensor had to move to be aligned: the bytes were rearranged in place
    assert bytes(buf) != data
    # the views do not overlap: writing one leaves the others as sent
    got["model"]["a"].fill_(0.0)
    for name in ("bbb", "cc", "d"):
        assert torch.equal(got["model"][name], content["model"][name]), name


def test_without_consume_the_received_bytes_are_left_alone():
    content = _content()
    data = encode_envelope("updates", 2, (0,), 1, 0.5, content)
    buf = bytearray(data)
    got = from_value(decode_large(buf).content)
    assert bytes(buf) == data
    assert not any(_inside(t, buf) for t in got["model"].values())
    assert torch.equal(got["model"]["cc"], content["model"]["cc"])


def _field(number: int, wire: int) -> bytes:
    return uvarint(number << 3 | wire)


def _delimited(number: int, body: bytes) -> bytes:
    return _field(number, 2) + uvarint(len(body)) + body


@pytest.mark.skipif(not hasattr(mmap, "MAP_PRIVATE"), reason="needs anonymous mappings")
def test_an_envelope_over_2_gib_decodes_as_a_view_of_its_bytes():
    n = (PROTOBUF_LIMIT + 1) // 4 + 1000           # float32s: a tensor of 2 GiB + 4000 bytes
    tensor_head = _delimited(1, b"float32") + _delimited(2, uvarint(n)) + _field(3, 2) + uvarint(4 * n)
    tensor_value_len = len(tensor_head) + 4 * n
    value_head = _field(7, 2) + uvarint(tensor_value_len)            # Value.tensor
    entry_body_len = len(_delimited(1, b"w")) + len(_field(2, 2) + uvarint(len(value_head) + tensor_value_len)) \
        + len(value_head) + tensor_value_len
    entry_head = _field(1, 2) + uvarint(entry_body_len) + _delimited(1, b"w") \
        + _field(2, 2) + uvarint(len(value_head) + tensor_value_len) + value_head
    map_len = len(entry_head) + len(tensor_head) + 4 * n
    content_head = _field(9, 2) + uvarint(map_len) + entry_head        # Value.map
    content_len = len(content_head) + len(tensor_head) + 4 * n
    header = pb.Envelope(msg_type="updates", sender=5, receivers=[0], round=3).SerializeToString()
    head = header + _field(7, 2) + uvarint(content_len) + content_head + tensor_head
    total = len(head) + 4 * n
    assert total > 2 ** 31
    with mmap.mmap(-1, total) as mm:                 # pages not written stay unallocated
        mm[:len(head)] = head
        mm[len(head):len(head) + 4] = struct.pack("<f", 1.5)            # the first float
        mm[total - 4:total] = struct.pack("<f", -2.25)                   # the last one
        env = decode_large(mm, consume=True)
        assert (env.msg_type, env.sender, list(env.receivers), env.round) == ("updates", 5, [0], 3)
        w = from_value(env.content)["w"]
        assert w.shape == (n,) and w.dtype == torch.float32
        assert w[0].item() == 1.5 and w[-1].item() == -2.25 and w[n // 2].item() == 0.0
        del w, env


def test_a_message_announced_over_2_gib_is_taken_chunk_by_chunk():
    total = 2 ** 31 + 3 * 2 ** 20
    r = Reassembler(max_message_bytes=2 ** 32, max_chunk_bytes=MIB)
    first = pb.Chunk(message_id=1, offset=0, total_size=total, sha256=b"\x00" * 32, data=b"x" * MIB)
    assert r.feed(first) is None and r.in_progress    # buffered, not refused at 2^31
    assert r.feed(pb.Chunk(message_id=1, offset=MIB, total_size=total, data=b"y" * MIB)) is None
    with pytest.raises(WireError, match="out of order"):
        r.feed(pb.Chunk(message_id=1, offset=5 * MIB, total_size=total, data=b"z"))
