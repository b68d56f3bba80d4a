"""Wire encoding: no pickle, exact sizes computed without encoding, malformed input refused."""
import pickle
import random

import pytest
import torch

from fedcore.kernel.message import Message
from fedcore.wire.serialization import (WireError, decode_envelope, encode_envelope, encode_value, encoded_size,
                                   envelope_size, from_value)
from tests.wire_reference import to_value


def _random_content(rng: random.Random, depth: int = 0):
    kinds = ["none", "bool", "int", "float", "str", "bytes", "tensor"]
    if depth < 3:
        kinds += ["list", "dict"]
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 127, 128, -129, 2 ** 40, -(2 ** 62), rng.randint(-10 ** 6, 10 ** 6)])
    if kind == "float":
        return rng.choice([0.0, -1.5, 1e300, rng.random()])
    if kind == "str":
        return rng.choice(["", "a", "héllo wörld", "x" * 300])
    if kind == "bytes":
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 200])))
    if kind == "tensor":
        dtype = rng.choice([torch.float32, torch.float64, torch.int64, torch.uint8, torch.bool,
                            torch.bfloat16, torch.float16, torch.int32])
        shape = rng.choice([(), (0,), (3,), (2, 5), (1, 1, 200)])
        return (torch.rand(shape) * 100).to(dtype)
    if kind == "list":
        return [_random_content(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["", "k", "model", "ü"]) + str(i): _random_content(rng, depth + 1)
            for i in range(rng.randrange(4))}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


def test_random_contents_round_trip_with_exact_predicted_size():
    rng = random.Random(7)
    for _ in range(300):
        content = _random_content(rng)
        v = to_value(content)
        assert len(v.SerializeToString()) == encoded_size(content)
        assert _equal(content, from_value(v))


def test_envelope_size_matches_encoding():
    content = {"model": {"w": torch.randn(10, 7), "b": torch.zeros(7)}, "num_samples": 42}
    for sender, receivers, rnd, ts in [(0, [1], 1, 0.5), (3, [0], 0, 0.0), (3, [0], 0, -0.0),
                                       (0, [1000], 77, 123.25)]:
        data = encode_envelope("updates", sender, receivers, rnd, ts, content, auth="")
        assert len(data) == envelope_size("updates", sender, receivers, rnd, ts, content)
        env = decode_envelope(data)
        assert env.msg_type == "updates" and list(env.receivers) == receivers


def test_message_nbytes_is_the_sum_of_its_wire_copies():
    content = {"model": {"w": torch.randn(4, 3)}}
    msg = Message("models", 0, (1, 2, 300), 3, 1.5, content)
    expected = sum(len(encode_envelope("models", 0, [r], 3, 1.5, content)) for r in (1, 2, 300))
    assert msg.nbytes == expected
    # a 26 MB model is counted as 26 MB, not as the few bytes of a Python object header
    big = Message("models", 0, (1,), 1, 0.0, {"w": torch.zeros(26 * 2 ** 20 // 4)})
    assert big.nbytes > 26 * 2 ** 20


@pytest.mark.parametrize("bad", [object(), {1: 2}, {"x": {1, 2}}, torch.zeros(2, dtype=torch.complex64)])
def test_disallowed_content_is_refused(bad):
    with pytest.raises(WireError):
        encode_value(bad)
    with pytest.raises(WireError):
        encoded_size(bad)


def test_malformed_bytes_and_pickles_are_refused():
    with pytest.raises(WireError):
        decode_envelope(b"\xff\xff\xff\xff")
    with pytest.raises(WireError):
        decode_envelope(pickle.dumps({"model": torch.zeros(3)}))
    good = to_value({"t": torch.zeros(4)})
    good.map.entries[0].value.tensor.shape[:] = [5]  # claims more elements than it carries
    with pytest.raises(WireError):
        from_value(good)
    good.map.entries[0].value.tensor.dtype = "object"
    with pytest.raises(WireError):
        from_value(good)


@pytest.mark.parametrize("form", ["torch", "numpy"])
def test_an_empty_tensor_of_impossible_shape_is_refused_not_a_crash(form):
    # zero elements, so its (empty) bytes match; no library can lay the shape out
    from fedcore.wire import fedcore_pb2 as pb
    from fedcore.wire.codec import decode_tensor
    for shape in ([0, 2 ** 62, 2 ** 62], [0, 2 ** 40, 2 ** 30]):
        with pytest.raises(WireError, match="too large"):
            decode_tensor(pb.Tensor(dtype="float32", shape=shape, data=b""), form)
    assert tuple(decode_tensor(pb.Tensor(dtype="float32", shape=[0, 5], data=b""), form).shape) == (0, 5)
