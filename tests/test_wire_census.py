"""The census of an encoded envelope: its count of values, made without decoding it, is the
count protobuf's own parse gives, and a message above the limit is refused."""
import random

import pytest

from fedcore.wire import fedcore_pb2 as pb
from fedcore.wire.census import check_values
from fedcore.wire.codec import WireError, encode_value, uvarint


def _parsed_count(msg) -> int:
    """Fields set in `msg` and below it, as protobuf's parse sees them: one per field, one per
    element of a repeated field (the independent count the census must agree with)."""
    total = 0
    for field, value in msg.ListFields():
        if getattr(field, "is_repeated", None) or getattr(field, "label", None) == field.LABEL_REPEATED:
            if field.message_type is None:
                total += len(value) + 1      # a packed list: its field, and one per number
            else:
                total += sum(1 + _parsed_count(v) for v in value)
        elif field.message_type is not None:
            total += 1 + _parsed_count(value)
        else:
            total += 1
    return total


def _random_content(rng, depth=0):
    kind = rng.choice(["none", "int", "float", "str", "bytes", "tensor", "list", "dict"][: 6 if depth > 3 else 8])
    if kind == "none":
        return None
    if kind == "int":
        return rng.randint(-2 ** 40, 2 ** 40)
    if kind == "float":
        return rng.random()
    if kind == "str":
        return "k" * rng.randint(1, 5)
    if kind == "bytes":
        return bytes(rng.randint(1, 300))
    if kind == "tensor":
        import numpy as np
        return np.zeros([rng.randint(1, 4) for _ in range(rng.randint(1, 3))], dtype=np.float32)
    if kind == "list":
        return [_random_content(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{i}": _random_content(rng, depth + 1) for i in range(rng.randint(0, 4))}


def _envelope(content, receivers=(0,)) -> bytes:
    head = pb.Envelope(msg_type="updates", sender=3, receivers=list(receivers), round=2,
                       timestamp=1.5).SerializeToString()
    body = encode_value(content)
    return head + b"\x3a" + uvarint(len(body)) + body


def test_a_small_envelope_is_counted_by_hand():
    import numpy as np
    data = _envelope({"a": np.zeros((2, 3), dtype=np.float32)})
    # envelope: msg_type, sender, receivers (1 + one number), round, timestamp, content = 7;
    # the content's map 1, its entry 1, the entry's key and value 2, the value's tensor 1,
    # the tensor's dtype, shape (1 + two numbers) and data 5: 17 in all
    assert check_values(data, 17) == 17
    with pytest.raises(WireError, match="more values"):
        check_values(data, 16)


def test_the_census_agrees_with_protobufs_parse_on_random_content():
    rng = random.Random(5)
    for _ in range(300):
        data = _envelope(_random_content(rng), receivers=[0] * rng.randint(0, 3))
        env = pb.Envelope.FromString(data)
        assert check_values(data, 10 ** 6) == _parsed_count(env)


def test_a_message_of_empty_values_is_refused_after_a_walk_the_size_of_the_limit():
    n = 1_000_000   # 2 MB of empty list items: 1,000,000 values protobuf would build
    items = b"\x0a\x00" * n
    value = b"\x42" + uvarint(len(items)) + items
    data = pb.Envelope(msg_type="updates", sender=1, receivers=[0]).SerializeToString() \
        + b"\x3a" + uvarint(len(value)) + value
    with pytest.raises(WireError, match="more values"):
        check_values(data, 5000)
    assert check_values(data, 2 * n) == n + 6   # the items, the list, the value, and 4 of the envelope


@pytest.mark.parametrize("data", [b"\x3a\x05\x42", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
                                  b"\x0f", b"\x3a\x02\x42\x05"])
def test_malformed_bytes_are_refused_with_a_wire_error(data):
    with pytest.raises(WireError, match="malformed"):
        check_values(data, 100)
