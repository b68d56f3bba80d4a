"""A toy character-level language-modelling task on text that ships with Python.

Dataset `python_text`: the docstrings of a list of standard-library modules (and of
their public classes and functions), read at run time, cut into windows of
`seq_len` characters whose label is the next character. Each client gets a
contiguous stretch of the text (`groups`, for `data.partition: natural`), like
workers reading different shards of a corpus. Model `char_lstm_tiny`: an
embedding, one LSTM layer and a linear head on the last position.
"""
from __future__ import annotations

import importlib
import inspect

import numpy as np
import torch
from torch import nn

from fedcore.kernel.config import declare, positive
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.registry import datasets, models
from fedcore.scenarios.data import RawDataset

__all__ = ["char_windows", "python_text", "CharLSTM", "char_lstm_tiny", "CHARACTER_DATASETS"]


declare("data.python_text.modules", list,
        ["json", "argparse", "collections", "functools", "itertools", "pathlib", "textwrap",
         "string", "random", "statistics", "heapq", "bisect", "difflib", "csv", "logging"],
        "python_text: standard-library modules whose docstrings make the corpus")
declare("data.python_text.seq_len", int, 32, "python_text: characters of context per sample",
        check=positive)
declare("data.python_text.stride", int, 8, "python_text: characters between consecutive windows",
        check=positive)
declare("data.python_text.max_chars", int, 60000, "python_text: characters of the corpus used "
        "(from its start)", check=positive)
declare("model.char_lstm_tiny.embed_dim", int, 16, "char_lstm_tiny: character embedding width",
        check=positive)
declare("model.char_lstm_tiny.hidden_size", int, 64, "char_lstm_tiny: LSTM hidden width",
        check=positive)

# Datasets whose inputs are character indices in [0, num_classes) (add yours).
CHARACTER_DATASETS: set[str] = {"python_text"}


def char_windows(text: str, seq_len: int, stride: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Windows `text[i:i+seq_len]` for i = 0, stride, ... and the character after each.

    Returns (x [N, seq_len] long, y [N] long, vocabulary as a sorted string).
    """
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    codes = torch.tensor([index[c] for c in text], dtype=torch.long)
    starts = torch.arange(0, max(0, len(text) - seq_len), stride)
    x = codes[starts.unsqueeze(1) + torch.arange(seq_len)] if len(starts) else \
        torch.empty((0, seq_len), dtype=torch.long)
    y = codes[starts + seq_len]
    return x, y, vocab


def _corpus(module_names: list[str]) -> str:
    parts = []
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            raise ConfigError(f"data.python_text.modules: cannot import '{name}'") from None
        docs = [inspect.getdoc(module)]
        for member_name, member in sorted(vars(module).items()):
            if member_name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(member) or inspect.isfunction(member):
                docs.append(inspect.getdoc(member))
        parts.extend(d for d in docs if d)
    return "\n\n".join(parts)


@datasets.register("python_text")
def python_text(cfg) -> RawDataset:
    s = cfg.section("data.python_text")
    text = _corpus(s["modules"])[:s["max_chars"]]
    x, y, vocab = char_windows(text, s["seq_len"], s["stride"])
    n_clients = cfg["federate.client_num"]
    if len(y) < n_clients:
        raise ConfigError(f"data.python_text: {len(y)} windows for {n_clients} clients (is Python "
                          "running with -OO, which strips docstrings?); raise max_chars or add modules")
    groups = (np.arange(len(y)) * n_clients) // len(y)    # contiguous shards, one per client
    return RawDataset(x, y, len(vocab), groups)


class CharLSTM(nn.Module):
    """Embedding -> LSTM -> linear head on the last position: logits of the next character."""

    def __init__(self, vocab: int, embed_dim: int, hidden_size: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden_size, batch_first=True)
        self.head = nn.Linear(hidden_size, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])


@models.register("char_lstm_tiny")
def char_lstm_tiny(cfg, input_shape, num_classes: int) -> nn.Module:
    if cfg["data.type"] not in CHARACTER_DATASETS or len(input_shape) != 1:
        raise ConfigError(f"model.type: char_lstm_tiny reads windows of character indices; use "
                          f"data.type={'/'.join(sorted(CHARACTER_DATASETS))}, not {cfg['data.type']}")
    m = cfg.section("model.char_lstm_tiny")
    return CharLSTM(num_classes, m["embed_dim"], m["hidden_size"])
