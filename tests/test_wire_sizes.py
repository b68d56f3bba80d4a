"""Byte counts computed without encoding equal the encoded lengths (fast paths included)."""
import pytest
import torch

from fedcore.kernel.message import Message
from fedcore.wire.serialization import encoded_size
from tests.wire_reference import reference_envelope, to_value

CONTENTS = [
    torch.zeros(3, 4), torch.zeros(()), torch.zeros(0, 5, dtype=torch.int64),
    torch.ones(300, dtype=torch.bool), torch.zeros(2, 70, dtype=torch.float64),
    {"model": {"w": torch.zeros(784, 10), "b": torch.zeros(10)}, "num_samples": 10},
    {"é-key": torch.ones(2), "": 1, "nested": {"x": [1, 2.5, None, "s", b"raw"]}},
    {}, [], {"x": {}}, [torch.zeros(129)], -7, 2 ** 40, "text",
]


@pytest.mark.parametrize("content", CONTENTS, ids=range(len(CONTENTS)))
def test_encoded_size_is_exact(content):
    assert encoded_size(content) == len(to_value(content).SerializeToString())


@pytest.mark.parametrize("sender", [0, 5, 300])
def test_envelope_size_per_receiver_is_exact(sender):
    content = {"model": {"w": torch.zeros(5, 3)}, "num_samples": 3}
    receivers = (1, 63, 64, 127, 8191, 8192, 100_000)
    msg = Message("models", sender, receivers, 3, 1.25, content)
    for r in receivers:   # the cache is per id width: every width must still be exact
        assert msg.nbytes_to(r) == len(reference_envelope("models", sender, [r], 3, 1.25, content))
    assert msg.nbytes == sum(len(reference_envelope("models", sender, [r], 3, 1.25, content))
                             for r in receivers)


def test_messages_of_one_layout_share_sizes_that_stay_exact():
    # the size tables are shared by messages whose ids, rounds and timestamps encode to the
    # same lengths: every combination of lengths (0 included) must still be exact
    content = {"model": {"w": torch.zeros(4)}, "num_samples": 2}
    for sender in (0, 1, 63, 64, 8191, 8192, -1, -65):
        for round_ in (0, 1, 63, 64, 9000):
            for ts in (0.0, -0.0, 2.5, 1e300):
                msg = Message("updates", sender, (0, 70), round_, ts, content)
                for r in (0, 70):
                    assert msg.nbytes_to(r) == len(reference_envelope("updates", sender, [r], round_, ts,
                                                                   content))


@pytest.mark.parametrize("content", CONTENTS + [True, False, None, 0, -2 ** 63, 2 ** 63 - 1, 1e-300,
                                                 torch.arange(12.0).reshape(3, 4).t(),
                                                 [[{"a": []}], ()], {"k": b""}],
                         ids=range(len(CONTENTS) + 10))
def test_direct_encoding_is_protobufs_encoding(content):
    from fedcore.wire.serialization import encode_value
    assert encode_value(content) == to_value(content).SerializeToString()
