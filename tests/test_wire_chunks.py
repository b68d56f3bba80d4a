"""Chunked envelopes: exact reassembly, and every irregular stream refused by name."""
import hashlib
import random

import pytest
import torch

from fedcore.comm.chunking import Reassembler, chunk_frames, envelope_parts
from fedcore.comm.grpc_client import backoff_delay
from fedcore.wire.serialization import WireError, encode_envelope, envelope_size
from tests.wire_reference import reference_envelope, to_value
from fedcore.wire import fedcore_pb2 as pb


def _chunks(parts, mid=1, size=10):
    return [pb.Frame.FromString(f).chunk for f in chunk_frames(parts, mid, size)]


@pytest.mark.parametrize("n", [0, 1, 9, 10, 11, 30, 31])
def test_chunks_reassemble_to_the_same_bytes(n):
    data = bytes(range(256))[:n] if n <= 256 else b""
    parts = (data[:n // 3], data[n // 3:])
    chunks = _chunks(parts, size=10)
    assert len(chunks) == max(1, -(-n // 10))          # ceil(n / 10), one chunk for empty
    assert all(len(c.data) <= 10 for c in chunks)
    r = Reassembler(max_message_bytes=1000, max_chunk_bytes=10)
    out = [r.feed(c) for c in chunks]
    assert out[:-1] == [None] * (len(chunks) - 1) and out[-1] == data
    assert not r.in_progress


def test_envelope_parts_parse_as_the_envelope_and_have_its_exact_size():
    content = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, "num_samples": 7}
    header = pb.Envelope(msg_type="updates", sender=3, receivers=[0], round=2, timestamp=1.5)
    joined = b"".join(envelope_parts(header, to_value(content).SerializeToString()))
    reference = reference_envelope("updates", 3, [0], 2, 1.5, content)   # protobuf's own, fields in order
    assert pb.Envelope.FromString(joined) == pb.Envelope.FromString(reference)
    assert joined == encode_envelope("updates", 3, [0], 2, 1.5, content)
    assert len(joined) == len(reference) == envelope_size("updates", 3, [0], 2, 1.5, content)


def _feed_all(r, chunks):
    for c in chunks:
        r.feed(c)


def test_irregular_streams_are_refused():
    data = bytes(50)
    good = _chunks((data,), size=10)
    cases = {
        "exceeds the 40-byte limit": (Reassembler(40, 10), good),
        "starts at offset": (Reassembler(100, 10), good[1:]),
        "out of order": (Reassembler(100, 10), [good[0], good[2]]),
        "truncated": (Reassembler(100, 10), good[:2] + _chunks((data,), mid=2, size=10)),
        "chunk of 20 bytes": (Reassembler(100, 10), _chunks((data,), size=20)),
    }
    for match, (r, chunks) in cases.items():
        with pytest.raises(WireError, match=match):
            _feed_all(r, chunks)
    bad_hash = _chunks((data,), size=10)
    bad_hash[0].sha256 = hashlib.sha256(b"other").digest()
    with pytest.raises(WireError, match="integrity"):
        _feed_all(Reassembler(100, 10), bad_hash)
    flipped = _chunks((data,), size=10)
    flipped[3].data = b"\x01" * 10
    with pytest.raises(WireError, match="integrity"):
        _feed_all(Reassembler(100, 10), flipped)
    r = Reassembler(100, 10)
    _feed_all(r, good[:3])
    with pytest.raises(WireError, match="stream ended inside message 1 \\(30 of 50 bytes\\)"):
        r.end_of_stream()


def test_announced_size_is_checked_before_anything_is_buffered():
    r = Reassembler(max_message_bytes=1 << 20, max_chunk_bytes=10)
    huge = pb.Chunk(message_id=1, offset=0, total_size=1 << 40, sha256=bytes(32), data=b"x")
    with pytest.raises(WireError, match="exceeds"):
        r.feed(huge)
    assert not r.in_progress


def test_backoff_doubles_up_to_its_cap_with_jitter():
    rng = random.Random(0)
    for attempt, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (6, 10.0), (100, 10.0)]:
        delays = [backoff_delay(attempt, 0.5, 10.0, rng) for _ in range(200)]
        assert all(cap / 2 <= d <= cap for d in delays)
        assert max(delays) - min(delays) > cap / 4  # jittered, not a constant


@pytest.mark.parametrize("n,size,mid", [(0, 10, 1), (1, 10, 7), (25, 10, 300), (200, 64, 2**40), (130, 128, 5)])
def test_hand_encoded_frames_are_protobufs_canonical_bytes(n, size, mid):
    data = bytes(random.Random(n).randrange(256) for _ in range(n))
    a = min(3, n)
    b = max(a, n // 2)
    parts = (data[:a], b"", data[a:b], data[b:])
    frames = list(chunk_frames(parts, mid, size))
    sha = hashlib.sha256(data).digest()
    for k, raw in enumerate(frames):
        piece = data[k * size:(k + 1) * size]
        expected = pb.Frame(chunk=pb.Chunk(message_id=mid, offset=k * size, total_size=n,
                                           sha256=sha if k == 0 else b"", data=piece))
        assert raw == expected.SerializeToString()
