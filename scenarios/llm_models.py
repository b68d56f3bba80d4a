"""`model.type: causal_lm`: a small decoder language model, optionally with LoRA adapters.

The decoder is GPT-2- or Llama-style, built from `model.causal_lm.*` with random
weights, or loaded from a local directory (`model.path`): nothing is ever
fetched from a hub (the Hugging Face offline switches are set before
`transformers` is imported). With `model.lora.r > 0` the base is frozen and
wrapped in `peft` LoRA adapters, and the model's `state_dict` holds the
adapter factors only: that dict is what the trainer, the aggregator, the wire,
checkpoints and `final_model.pt` see, so the frozen base never crosses it.

The forward pass returns logits as [batch, vocab, positions], so
`cross_entropy(model(x), y)` with next-token targets `y` [batch, positions] is
the mean token loss every trainer already computes.
"""
from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path

import torch
from torch import nn

from fedcore.kernel.config import declare, non_negative, positive, validator
from fedcore.kernel.errors import ConfigError, first_line
from fedcore.kernel.registry import models

__all__ = ["CausalLM", "causal_lm", "import_llm", "lora_pairs", "ARCH_TARGETS"]

declare("model.path", str, None, "causal_lm: a local directory holding a saved model "
        "(save_pretrained); never downloaded. Unset: built from model.causal_lm.* with random weights")
declare("model.causal_lm.arch", str, "gpt2", "causal_lm built from config: decoder family",
        choices=("gpt2", "llama"))
declare("model.causal_lm.layers", int, 2, "causal_lm built from config: decoder layers", check=positive)
declare("model.causal_lm.heads", int, 2, "causal_lm built from config: attention heads", check=positive)
declare("model.causal_lm.hidden", int, 64, "causal_lm built from config: hidden size (a multiple of heads)",
        check=positive)
declare("model.causal_lm.intermediate", int, None, "causal_lm built from config: MLP width "
        "(default 4 x hidden)", check=positive)
declare("model.causal_lm.max_positions", int, 256, "causal_lm built from config: longest context "
        "(at least data.text.seq_len)", check=positive)
declare("model.causal_lm.init_std", float, 0.02, "causal_lm built from config: standard deviation "
        "of the random initial weights (GPT-2's and Llama's 0.02)", check=positive)
declare("model.causal_lm.dropout", float, 0.0, "causal_lm built from config: dropout on embeddings, "
        "attention and residuals (masks from torch's generator, seeded by every fit from the client's "
        "own stream, in a deployed client as in the simulation)",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("model.lora.r", int, 0, "LoRA rank of the adapters (0: no adapters, every weight is trained "
        "and exchanged); the global rank when clients have their own (model.lora.ranks)",
        check=non_negative)
declare("model.lora.alpha", float, 16.0, "LoRA scaling numerator: adapters add (alpha / r) B A",
        check=positive)
declare("model.lora.dropout", float, 0.0, "LoRA dropout on the adapters' input",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)")
declare("model.lora.target_modules", list, None, "module names that get adapters (default: c_attn "
        "for gpt2, q_proj and v_proj for llama)")

# the modules that get adapters unless model.lora.target_modules says otherwise
ARCH_TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}
# config fields of attention dropout (GPT-2; Llama and most decoders; BERT-style)
_ATTENTION_DROPOUT = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
_OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@validator
def _check_lm(cfg) -> None:
    if cfg["model.type"] != "causal_lm":
        return
    m = cfg.section("model.causal_lm")
    if not cfg["model.path"] and m["hidden"] % m["heads"]:
        raise ConfigError(f"model.causal_lm.hidden: {m['hidden']} is not a multiple of "
                          f"model.causal_lm.heads ({m['heads']})")


def import_llm(what: str = "transformers"):
    """`transformers` (or `peft`), imported offline; a one-line error without the [llm] extra."""
    for k, v in _OFFLINE.items():
        os.environ.setdefault(k, v)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            module = __import__(what)
    except ImportError:
        raise ConfigError(f"model.type: causal_lm needs {what}: install the [llm] extra "
                          "(pip install 'fedcore[llm]')") from None
    if what == "transformers":   # its loading bars would interleave with the course's own lines
        module.utils.logging.disable_progress_bar()
    return module


class CausalLM(nn.Module):
    """A decoder whose logits come as [batch, vocab, positions]; with adapters, its state_dict
    (and so everything a course exchanges or saves) is the adapter factors only."""

    def __init__(self, lm: nn.Module, exchanged: set[str] | None = None):
        super().__init__()
        self.lm = lm
        self.exchanged = exchanged        # parameter names under this module; None: all
        # second names of one tensor (a head tied to the input embeddings): the state holds,
        # exchanges and saves it once, under its first name
        first: dict[int, str] = {}
        self.aliases: dict[str, str] = {}   # second name -> first name
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in first:
                self.aliases[name] = first[id(p)]
            first.setdefault(id(p), name)
        if exchanged is not None or self.aliases:
            self._register_state_dict_hook(_keep_exchanged)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x).logits.transpose(1, 2)

    def __deepcopy__(self, memo: dict) -> "CausalLM":
        """A copy with its own adapters over the same frozen base. A course copies its model
        (the trainer trains in a copy of the server's), and a base of a billion parameters held
        twice would double its memory; the base is never trained nor exchanged, so one copy
        serves every model of the process."""
        for p in self.frozen_base():
            memo[id(p)] = p
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def frozen_base(self) -> list[nn.Parameter]:
        """The parameters that adapters leave frozen and out of the state (none without them)."""
        if self.exchanged is None:
            return []
        return [p for n, p in self.named_parameters() if n not in self.exchanged and not p.requires_grad]

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        if self.exchanged is None and not self.aliases:
            return super().load_state_dict(state, strict, assign)
        result = super().load_state_dict(state, strict=False, assign=assign)
        if assign:   # the first name now holds another tensor: the second follows it
            for alias, source in self.aliases.items():
                owner, _, leaf = alias.rpartition(".")
                setattr(self.get_submodule(owner), leaf, self.get_parameter(source))
        missing = [k for k in result.missing_keys
                   if k not in self.aliases and (self.exchanged is None or k in self.exchanged)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"adapter state does not fit: missing {missing[:3]}, "
                               f"unexpected {result.unexpected_keys[:3]}")
        return result

    def unreplayed_randomness(self) -> str | None:
        """Attention dropout is drawn inside the attention function (a fused kernel), not by an
        `nn.Dropout` layer whose masks the vectorized engine replays."""
        conf = getattr(self.lm, "config", None)
        for key in _ATTENTION_DROPOUT:
            p = getattr(conf, key, None)
            if isinstance(p, (int, float)) and p > 0:
                return (f"its attention drops out inside the attention function ({key} {p}), "
                        "which the vectorized engine cannot replay; save the model with "
                        f"{key} 0 to train it batched")
        return None

    def parameter_counts(self) -> tuple[int, int]:
        """(trainable, total) parameters, each shared tensor counted once."""
        params = list(self.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _keep_exchanged(module: CausalLM, state: dict, prefix: str, _meta) -> None:
    for key in list(state):
        if key.startswith(prefix):
            name = key[len(prefix):]
            if name in module.aliases or (module.exchanged is not None and name not in module.exchanged):
                del state[key]


def lora_pairs(names) -> list[tuple[str, str]]:
    """(A, B) entry names of each adapted layer, in the order of `names`."""
    names = list(names)
    return [(a, a.replace("lora_A", "lora_B")) for a in names
            if ".lora_A." in a and a.replace("lora_A", "lora_B") in names]


def _from_config(cfg, vocab: int) -> nn.Module:
    transformers = import_llm()
    m = cfg.section("model.causal_lm")
    # the byte tokenizer's BOS and EOS; windows are never padded, so no pad id (a pad id seen
    # in the input makes transformers ask for an attention mask)
    specials = dict(bos_token_id=vocab - 3, eos_token_id=vocab - 2)
    if m["arch"] == "gpt2":
        conf = transformers.GPT2Config(vocab_size=vocab, n_layer=m["layers"], n_head=m["heads"],
                                       n_embd=m["hidden"], n_inner=m["intermediate"],
                                       n_positions=m["max_positions"], resid_pdrop=m["dropout"],
                                       embd_pdrop=m["dropout"], attn_pdrop=m["dropout"],
                                       initializer_range=m["init_std"], **specials)
        return transformers.GPT2LMHeadModel(conf)
    conf = transformers.LlamaConfig(vocab_size=vocab, num_hidden_layers=m["layers"],
                                    num_attention_heads=m["heads"], num_key_value_heads=m["heads"],
                                    hidden_size=m["hidden"],
                                    intermediate_size=m["intermediate"] or 4 * m["hidden"],
                                    max_position_embeddings=m["max_positions"],
                                    attention_dropout=m["dropout"],
                                    initializer_range=m["init_std"], **specials)
    return transformers.LlamaForCausalLM(conf)


def _from_directory(path: str, vocab: int, seq_len: int) -> nn.Module:
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"model.path: '{p}' {'is not a directory' if p.exists() else 'does not exist'}; "
                          "name a directory holding a model saved with save_pretrained")
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path: '{p}' holds no saved model (no config.json); save one there "
                          "with save_pretrained, models are never downloaded at run time")
    transformers = import_llm()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:   # noqa: BLE001  (a foreign loader's many error types: one line)
        raise ConfigError(f"model.path: cannot load '{p}' ({first_line(exc)})") from None
    if model.get_input_embeddings().num_embeddings < vocab:
        raise ConfigError(f"model.path: the model's {model.get_input_embeddings().num_embeddings} "
                          f"embeddings are fewer than the tokenizer's {vocab} tokens")
    positions = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:
        raise ConfigError(f"data.text.seq_len: {seq_len} exceeds the {positions} positions of the "
                          f"model in '{p}'")
    if not _causal(model, min(seq_len, 8), min(vocab, model.get_input_embeddings().num_embeddings)):
        raise ConfigError(f"model.path: the model in '{p}' ({type(model).__name__}) is not causal: its "
                          "outputs at a position depend on later tokens (an encoder such as BERT); "
                          "a causal_lm must be a decoder")
    return model


@torch.no_grad()
def _causal(model: nn.Module, length: int, vocab: int) -> bool:
    """Whether changing a window's last token leaves the logits of every earlier position as they
    were (eval mode; tokens from a generator of its own, so no random stream is touched)."""
    if length < 2:
        return True
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (1, length), generator=g)
    y = x.clone()
    y[0, -1] = (x[0, -1] + 1) % vocab
    was_training = model.training
    model.eval()
    try:
        a, b = model(input_ids=x).logits[0, :-1], model(input_ids=y).logits[0, :-1]
    finally:
        model.train(was_training)
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def _with_adapters(cfg, lm: nn.Module) -> CausalLM:
    peft = import_llm("peft")
    lo = cfg.section("model.lora")
    kind = getattr(lm.config, "model_type", "gpt2")
    targets = lo["target_modules"] or ARCH_TARGETS.get(kind)
    if not targets:
        raise ConfigError(f"model.lora.target_modules: no default for a {kind} model; name its "
                          "linear layers, e.g. [q_proj, v_proj]")
    conf = peft.LoraConfig(r=lo["r"], lora_alpha=lo["alpha"], lora_dropout=lo["dropout"],
                           target_modules=list(targets), fan_in_fan_out=kind == "gpt2")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # peft's notes on fan_in_fan_out and deprecations
            wrapped = peft.get_peft_model(lm, conf)
    except ValueError as exc:
        raise ConfigError(f"model.lora.target_modules: {targets} ({first_line(exc)})") from None
    names = {f"lm.{n}" for n, p in wrapped.named_parameters() if p.requires_grad}
    state = wrapped.state_dict()
    for a, b in lora_pairs(state):   # A is [r, in], B [out, r]
        d_in, d_out = state[a].shape[1], state[b].shape[0]
        if lo["r"] > min(d_in, d_out):
            raise ConfigError(f"model.lora.r: {lo['r']} exceeds the rank of the adapted layer "
                              f"{a.split('.lora_A')[0]} ({d_in} -> {d_out}): adapters that large cost "
                              "more than the layer; use a rank of at most min(inputs, outputs)")
    return CausalLM(wrapped, names)


@models.register("causal_lm")
def causal_lm(cfg, input_shape, num_classes: int) -> nn.Module:
    """A decoder for token windows (`data.type: text_files` or `synthetic_text`); num_classes is
    the tokenizer's vocabulary."""
    if len(input_shape) != 1:
        raise ConfigError(f"model.type: causal_lm reads windows of token ids (data.type text_files "
                          f"or synthetic_text); this data has shape {input_shape}")
    lm = _from_directory(cfg["model.path"], num_classes, input_shape[0]) if cfg["model.path"] \
        else _from_config(cfg, num_classes)
    if cfg["model.lora.r"] > 0:
        return _with_adapters(cfg, lm)
    return CausalLM(lm)
