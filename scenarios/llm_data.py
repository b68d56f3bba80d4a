"""Text for language models: local files or a generated corpus, tokenized into windows.

Dataset `text_files`: documents from local JSON-lines, text or parquet files
(`data.text.files`; parquet through `datasets`' local loader). Each document
gets a group, the natural client it belongs to (`data.text.group_by`): its
file, or the value of one of its fields (author, task, ...), which is the
non-IID split `data.partition: natural` uses; `data.partition:
dirichlet_groups` spreads each group over clients by Dir(`data.alpha`) shares
instead. Dataset `synthetic_text`: a deterministic corpus of
`data.synthetic_text.authors` authors, each writing from its own small
grammar, so there is something to learn and each author is a natural client.

Tokens come from a local tokenizer directory (`data.text.tokenizer`) or, by
default, from bytes: ids 0-255 are the UTF-8 bytes and 256-258 are BOS, EOS and
PAD. A group's documents are joined ([BOS] doc [EOS] ...) and cut into windows
of `seq_len + 1` tokens: x is a window's first `seq_len` tokens, y its last
`seq_len` (the next token at each position). Windows never cross groups.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from fedcore.kernel.config import declare, positive, validator
from fedcore.kernel.errors import ConfigError, first_line
from fedcore.kernel.registry import datasets, partitioners
from fedcore.scenarios.data import RawDataset, hold_out
from fedcore.scenarios.partition import dirichlet

__all__ = ["ByteTokenizer", "read_documents", "synthetic_documents", "token_windows", "text_files",
           "synthetic_text", "BYTE_VOCAB"]

declare("data.text.files", list, None, "text_files: local files of documents (.jsonl/.json lines, "
        ".txt: one document per line, .parquet)")
declare("data.text.field", str, "text", "text_files: the field of a JSON line or parquet row that "
        "holds the document")
declare("data.text.group_by", str, "file", "text_files: each document's natural client: 'file', "
        "or the name of a field (e.g. author, task)")
declare("data.text.tokenizer", str, None, "a local tokenizer directory (save_pretrained); unset: "
        "bytes (256 ids) plus BOS, EOS, PAD")
declare("data.text.seq_len", int, 32, "tokens of context per training window", check=positive)
declare("data.text.stride", int, None, "tokens between consecutive windows (default seq_len: no "
        "overlap)", check=positive)
declare("data.synthetic_text.authors", int, 4, "synthetic_text: authors (natural groups)",
        check=positive)
declare("data.synthetic_text.documents", int, 60, "synthetic_text: documents per author",
        check=positive)

BYTE_VOCAB = 259   # 256 bytes, BOS, EOS, PAD


log = logging.getLogger("fedcore.data")
TEXT_DATA = ("text_files", "synthetic_text")
# the zoo's models of float features (images, tables): they cannot read token ids
_FEATURE_MODELS = ("logreg", "mlp", "lenet5", "convnet2", "resnet18", "mlp_bn", "cnn_bn", "moon_mlp",
                   "moon_cnn")


@validator
def _check_context(cfg) -> None:
    if cfg["data.type"] in TEXT_DATA and cfg["model.type"] in _FEATURE_MODELS:
        raise ConfigError(f"model.type: {cfg['model.type']} reads float features, but data.type "
                          f"{cfg['data.type']} gives windows of token ids; use model.type: causal_lm")
    if cfg["model.type"] == "causal_lm" and not cfg["model.path"] \
            and cfg["data.text.seq_len"] > cfg["model.causal_lm.max_positions"]:
        raise ConfigError(f"data.text.seq_len: {cfg['data.text.seq_len']} exceeds "
                          f"model.causal_lm.max_positions ({cfg['model.causal_lm.max_positions']})")


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; BOS, EOS and PAD after them (no files, no downloads)."""

    vocab_size = BYTE_VOCAB
    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


# what save_pretrained writes for a fast tokenizer, or a slow one's vocabulary files
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt",
                    "tokenizer.model", "spiece.model")


class _LocalTokenizer:
    """A tokenizer saved in a local directory, with BOS/EOS ids where it has them."""

    def __init__(self, path: str):
        from fedcore.scenarios.llm_models import import_llm
        p = Path(path)
        if not p.is_dir():
            raise ConfigError(f"data.text.tokenizer: '{p}' is not a directory holding a saved tokenizer")
        if not any((p / f).is_file() for f in _TOKENIZER_FILES):
            raise ConfigError(f"data.text.tokenizer: '{p}' holds no tokenizer (none of "
                              f"{', '.join(_TOKENIZER_FILES)}); save one there with save_pretrained")
        try:
            self.tok = import_llm().AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as exc:   # noqa: BLE001  (a foreign loader's many error types: one line)
            raise ConfigError(f"data.text.tokenizer: cannot load '{p}' ({first_line(exc)})") from None
        self.vocab_size = len(self.tok)
        self.bos_token_id, self.eos_token_id = self.tok.bos_token_id, self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)


def _tokenizer(cfg):
    path = cfg["data.text.tokenizer"]
    return _LocalTokenizer(path) if path else ByteTokenizer()


def token_windows(docs: list[str], groups: list, tokenizer, seq_len: int, stride: int):
    """(x [N, seq_len], y [N, seq_len], group index of each window, group names), windows cut
    per group from its joined documents."""
    names = sorted(set(groups), key=str)
    if tokenizer.bos_token_id is None and tokenizer.eos_token_id is None:
        log.warning("data.text.tokenizer: the tokenizer has neither a BOS nor an EOS token, so a "
                    "group's documents are joined with nothing between them")
    xs, ys, gs, short = [], [], [], []
    for gi, name in enumerate(names):
        ids: list[int] = []
        for doc, g in zip(docs, groups):
            if g == name:
                ids += [t for t in (tokenizer.bos_token_id,) if t is not None]
                ids += tokenizer.encode(doc)
                ids += [t for t in (tokenizer.eos_token_id,) if t is not None]
        codes = torch.tensor(ids, dtype=torch.long)
        starts = torch.arange(0, max(0, len(ids) - seq_len), stride)
        if len(starts):
            w = codes[starts.unsqueeze(1) + torch.arange(seq_len + 1)]
            xs.append(w[:, :-1])
            ys.append(w[:, 1:])
            gs.append(np.full(len(starts), gi))
        else:
            short.append(str(name))
    if not xs:
        raise ConfigError(f"data.text.seq_len: no document group holds more than {seq_len} tokens")
    if short:
        log.warning("data.text: %d group(s) hold no more than data.text.seq_len (%d) tokens, so no "
                    "window and no client: %s", len(short), seq_len,
                    ", ".join(short[:5]) + (", ..." if len(short) > 5 else ""))
    return torch.cat(xs), torch.cat(ys), np.concatenate(gs), names


def read_documents(files: list[str], field: str, group_by: str) -> tuple[list[str], list]:
    """The documents of local files and each one's group (its file or a field's value)."""
    docs, groups = [], []
    for f in files:
        p = Path(f)
        if not p.is_file():
            raise ConfigError(f"data.text.files: '{p}' does not exist")
        for i, row in enumerate(_rows(p), start=1):
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"data.text.field: row {i} of '{p}' has no text field '{field}'")
            group = str(p) if group_by == "file" else row.get(group_by)
            if group is None:
                raise ConfigError(f"data.text.group_by: row {i} of '{p}' has no field '{group_by}'")
            docs.append(text)
            groups.append(group)
    if not docs:
        raise ConfigError(f"data.text.files: {', '.join(map(str, files))} hold no documents")
    return docs, groups


def _rows(p: Path):
    suffix = p.suffix.lower()
    if suffix == ".txt":
        return [{"text": line} for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if suffix in (".jsonl", ".json"):
        text = p.read_text(encoding="utf-8")
        if suffix == ".json" and text.lstrip().startswith("["):   # one JSON array of rows
            try:
                return json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"data.text.files: '{p}' is not a JSON array of rows ({exc})") from None
        rows = []
        for i, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ConfigError(f"data.text.files: line {i} of '{p}' is not JSON (a .jsonl file, or a "
                                  ".json file of one row per line or one array of rows)") from None
        return rows
    if suffix == ".parquet":
        from fedcore.scenarios.llm_models import import_llm
        return import_llm("datasets").load_dataset("parquet", data_files=str(p), split="train")
    raise ConfigError(f"data.text.files: '{p}' is not .jsonl, .json, .txt or .parquet")


def _raw(cfg, docs: list[str], groups: list) -> RawDataset:
    tokenizer = _tokenizer(cfg)
    seq_len = cfg["data.text.seq_len"]
    x, y, g, _ = token_windows(docs, groups, tokenizer, seq_len, cfg["data.text.stride"] or seq_len)
    return hold_out(RawDataset(x, y, tokenizer.vocab_size, g), cfg["data.test_size"], cfg["seed"])


@datasets.register("text_files")
def text_files(cfg) -> RawDataset:
    s = cfg.section("data.text")
    if not s["files"]:
        raise ConfigError("data.text.files: name the local files of documents for data.type text_files")
    docs, groups = read_documents(s["files"], s["field"], s["group_by"])
    return _raw(cfg, docs, groups)


# Each author's grammar: subjects, verbs and objects of its own, so authors differ (non-IID)
# and the text is predictable enough for a tiny model to learn within seconds.
_WORDS = {
    "subjects": ["the cat", "a dog", "my aunt", "the robot", "our king", "a farmer", "the ship",
                 "her friend"],
    "verbs": ["sees", "eats", "builds", "paints", "finds", "loves", "carries", "sells"],
    "objects": ["the apple", "a red house", "the river", "two stones", "a small boat", "the moon",
                "some bread", "a blue chair"],
}


def synthetic_documents(authors: int, documents: int, seed: int) -> tuple[list[str], list[str]]:
    """`documents` short texts by each of `authors` authors, drawn from its own grammar."""
    rng = np.random.default_rng(seed + 29)
    docs, groups = [], []
    for a in range(authors):
        vocab = {k: rng.choice(v, size=3, replace=False) for k, v in _WORDS.items()}
        for _ in range(documents):
            sentences = [f"{rng.choice(vocab['subjects'])} {rng.choice(vocab['verbs'])} "
                         f"{rng.choice(vocab['objects'])}." for _ in range(rng.integers(2, 5))]
            docs.append(" ".join(sentences))
            groups.append(f"author{a}")
    return docs, groups


@datasets.register("synthetic_text")
def synthetic_text(cfg) -> RawDataset:
    s = cfg.section("data.synthetic_text")
    return _raw(cfg, *synthetic_documents(s["authors"], s["documents"], cfg["seed"]))


@partitioners.register("dirichlet_groups")
def dirichlet_groups(raw: RawDataset, n: int, cfg) -> list[np.ndarray]:
    """Each natural group (author, task, file) spread over clients by Dir(data.alpha) shares."""
    if raw.groups is None:
        raise ConfigError("data.partition: dirichlet_groups needs a dataset with natural groups")
    codes = np.unique(raw.groups, return_inverse=True)[1]
    return dirichlet(RawDataset(raw.x, torch.from_numpy(codes), int(codes.max()) + 1), n, cfg)
