"""The tiny character-level language-model scenario: text shipped with Python, cut into
next-character windows, and a small recurrent model over them."""
import math

import pytest
import torch

from fedcore.runtime.course import Course
from fedcore.kernel.errors import ConfigError
from fedcore.scenarios.text import char_windows, python_text
from tests.conftest import small_cfg

TEXT = dict(data__type="python_text", data__partition="natural", model__type="char_lstm_tiny",
            data__python_text__max_chars=4000, data__python_text__seq_len=16,
            data__python_text__stride=8)


def test_windows_predict_the_next_character():
    x, y, vocab = char_windows("abcdef", seq_len=3, stride=1)
    assert vocab == "abcdef"
    assert x.tolist() == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    assert y.tolist() == [3, 4, 5]
    x2, y2, _ = char_windows("abcdef", seq_len=2, stride=3)
    assert x2.tolist() == [[0, 1], [3, 4]] and y2.tolist() == [2, 5]


def test_python_text_dataset_is_contiguous_per_client_and_long_typed():
    cfg = small_cfg(**TEXT)
    raw = python_text(cfg)
    assert raw.x.dtype == torch.long and raw.x.shape[1] == 16
    assert raw.num_classes > raw.x.max().item() and raw.num_classes > raw.y.max().item()
    groups = raw.groups.tolist()
    assert groups == sorted(groups) and len(set(groups)) == cfg["federate.client_num"]
    # consecutive windows overlap by seq_len - stride characters
    assert torch.equal(raw.x[1, :8], raw.x[0, 8:])


def test_python_text_needs_a_char_model_input():
    with pytest.raises(ConfigError, match="data.python_text.seq_len"):
        small_cfg(**dict(TEXT, data__python_text__seq_len=0))


def test_char_model_on_integer_windows_only():
    with pytest.raises(ConfigError, match="char_lstm_tiny"):
        Course(small_cfg(model__type="char_lstm_tiny")).build()


@pytest.mark.slow
def test_tiny_char_lm_diloco_course_trains(tmp_path):
    cfg = small_cfg(tmp_path, algorithm__name="diloco", train__local_steps=10,
                    train__optimizer__type="adamw", train__optimizer__lr=0.01,
                    train__preserve_optimizer_state=True, federate__client_num=2,
                    federate__total_round_num=2, eval__clients=False, **TEXT)
    summary = Course(cfg).run()
    vocab = Course(cfg).build().data.num_classes
    assert summary["rounds"] == 2
    assert math.isfinite(summary["final"]["test_loss"])
    assert summary["final"]["test_loss"] < math.log(vocab)        # better than a uniform guess
