"""Envelopes of 2 GiB and more are read by fedcore/wire/large.py, which protobuf cannot parse:
on any envelope it must give what protobuf gives, and refuse what protobuf refuses."""
import pytest
import torch

from fedcore.wire.serialization import encode_envelope
from fedcore.wire.codec import WireError, decode_envelope, from_value
from fedcore.wire.large import decode_large

CONTENT = {
    "model": {"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),
              "i": torch.tensor([-3, 0, 7], dtype=torch.int64), "h": torch.ones(2, dtype=torch.float16),
              "empty": torch.zeros(0, 5), "q": torch.tensor([[-7, 7]], dtype=torch.int8)},
    "num_samples": 12, "neg": -(2 ** 40), "f": -1.5e-300, "none": None, "yes": True, "no": False,
    "s": "naïve", "raw": b"\x00\xff", "list": [1, [2.5, {"k": "v"}], []], "": {},
}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert type(a) is type(b) and a == b


def test_the_large_reader_gives_what_protobuf_gives():
    data = encode_envelope("updates", 7, (0, 300), -4, 12.25, CONTENT)
    parsed, read = decode_envelope(data), decode_large(data)
    for name in ("msg_type", "sender", "round", "timestamp", "auth"):
        assert getattr(read, name) == getattr(parsed, name), name
    assert list(read.receivers) == list(parsed.receivers) == [0, 300]
    _same(from_value(parsed.content), from_value(read.content))
    _same(from_value(read.content), CONTENT)
    numpy_side = from_value(read.content, "numpy")
    assert numpy_side["model"]["w"].tolist() == CONTENT["model"]["w"].tolist()


@pytest.mark.parametrize("cut", [1, 5, 40, -3])
def test_the_large_reader_refuses_truncated_envelopes(cut):
    data = encode_envelope("updates", 7, (0,), 1, 0.0, CONTENT)
    with pytest.raises(WireError):
        env = decode_large(data[:cut] if cut > 0 else data[:cut])
        from_value(env.content)


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_refused():
    data = bytearray(encode_envelope("updates", 1, (0,), 1, 0.0, {"t": torch.zeros(4)}))
    at = data.index(b"\x12\x01\x04")          # the shape field: [4] -> [5]
    data[at + 2] = 5
    with pytest.raises(WireError, match="needs 20 bytes"):
        from_value(decode_large(bytes(data)).content)
