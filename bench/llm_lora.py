"""LoRA fine-tuning of a decoder built from config, many clients a round: fedcore against the
plain single-model loop, in tokens per second.

    python -m bench.llm_lora [--size 160m] [--clients 16] [--steps 4] [--rounds 3]
    python -m bench.llm_lora --device cpu --size tiny        # a smoke test without a GPU

`160m`: a Llama-style decoder (12 layers, hidden 768, MLP 3072, vocabulary 32,000: about
162M parameters), LoRA rank 16 on q_proj and v_proj. Each round every client loads the global
adapters, takes `--steps` SGD steps on its own batches of random tokens and sends its adapters;
the server averages them (model.lora.aggregation: separate, the same arithmetic as the plain
loop's mean). The plain loop does the same work with one model and no messages. Tokens per
second count the training tokens of the rounds after the first (the first builds and warms up).
fedcore's vectorized executor (the adapters of a round's clients stacked over one shared frozen
base) is measured where it accepts the course, else its reason is printed. The last line reads
`llm_lora_tokens_per_s_plain=... fedcore_sequential=... ratio_sequential_over_plain=...`.
Exits 2 with one line where `--device cuda` (the default) finds no GPU.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

SIZES = {
    "160m": dict(arch="llama", layers=12, heads=12, hidden=768, intermediate=3072, vocab=32000,
                 rank=16, targets=["q_proj", "v_proj"]),
    "tiny": dict(arch="gpt2", layers=2, heads=2, hidden=64, intermediate=256, vocab=259,
                 rank=4, targets=["c_attn"]),
}


def _config(size: dict, a, executor: str):
    from bench.common import bench_cfg
    return bench_cfg(**{
        "federate.client_num": a.clients, "federate.total_round_num": a.rounds,
        "data.type": "synthetic_text", "data.text.seq_len": a.seq_len,
        "model.type": "causal_lm", "model.causal_lm.arch": size["arch"],
        "model.causal_lm.layers": size["layers"], "model.causal_lm.heads": size["heads"],
        "model.causal_lm.hidden": size["hidden"], "model.causal_lm.intermediate": size["intermediate"],
        "model.causal_lm.max_positions": max(a.seq_len, 64), "model.lora.r": size["rank"],
        "model.lora.target_modules": size["targets"], "model.lora.aggregation": "separate",
        "train.local_steps": a.steps, "train.batch_size": a.batch, "train.optimizer.type": "sgd",
        "train.optimizer.lr": 0.01, "device": a.device, "executor": executor, "torch_threads": None})


def _data(size: dict, a):
    """Random token windows, `a.batch * a.steps` per client (each client's batches are its own)."""
    from fedcore.scenarios.data import ClientData, FederatedData, Split
    g = torch.Generator().manual_seed(0)
    n = a.batch * a.steps

    def split(k: int) -> Split:
        w = torch.randint(0, size["vocab"], (k, a.seq_len + 1), generator=g)
        return Split(w[:, :-1], w[:, 1:])
    clients = {c: ClientData(split(n), split(0), split(0)) for c in range(1, a.clients + 1)}
    return FederatedData(clients, split(a.batch), (a.seq_len,), size["vocab"])


def _tokens_per_round(a) -> int:
    return a.clients * a.steps * a.batch * a.seq_len


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_plain(cfg, data, a) -> float:
    """One model; each client: load the adapters, `steps` SGD steps, keep its adapters; then their
    mean. Returns tokens per second over the rounds after the first."""
    from fedcore.scenarios.models import build_model
    model = build_model(cfg, data.input_shape, data.num_classes).to(a.device)
    params = [p for p in model.parameters() if p.requires_grad]
    global_ = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.01)
    times = []
    for _ in range(a.rounds):
        _sync(a.device)
        t0 = time.perf_counter()
        sums = [torch.zeros_like(p) for p in params]
        for cid in sorted(data.clients):
            train = data.clients[cid].train
            with torch.no_grad():
                for p, g in zip(params, global_):
                    p.copy_(g)
            for s in range(a.steps):
                x = train.x[s * a.batch:(s + 1) * a.batch].to(a.device)
                y = train.y[s * a.batch:(s + 1) * a.batch].to(a.device)
                opt.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                loss.item()
            for acc, p in zip(sums, params):
                acc.add_(p.detach())
        global_ = [acc / len(data.clients) for acc in sums]
        _sync(a.device)
        times.append(time.perf_counter() - t0)
    return _tokens_per_round(a) / float(np.mean(times[1:]))


def run_course(cfg, data, a) -> float:
    from bench.common import run_fedcore
    times = run_fedcore(cfg, data)
    return _tokens_per_round(a) / times.steady_wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--size", default="160m", choices=sorted(SIZES))
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench.llm_lora: torch sees no GPU; run it on a CUDA machine, or with --device cpu "
              "--size tiny as a smoke test", file=sys.stderr)
        return 2
    if a.rounds < 2:
        p.error("--rounds must be at least 2 (the first round is not timed)")
    size = SIZES[a.size]
    data = _data(size, a)
    cfg = _config(size, a, "sequential")
    model_params = _count(cfg, data)
    print(f"model {a.size}: {model_params[1]:,} parameters, {model_params[0]:,} in adapters; "
          f"{a.clients} clients x {a.steps} steps x {a.batch} x {a.seq_len} tokens "
          f"a round on {torch.cuda.get_device_name() if a.device == 'cuda' else 'the CPU'}")
    plain = run_plain(cfg, data, a)
    print(f"plain single-model loop: {plain:,.0f} tokens/s")
    sequential = run_course(cfg, data, a)
    print(f"fedcore sequential:      {sequential:,.0f} tokens/s")
    line = (f"llm_lora_tokens_per_s_plain={plain:.0f} fedcore_sequential={sequential:.0f} "
            f"ratio_sequential_over_plain={sequential / plain:.3f}")
    why = _why_not_vectorized(_config(size, a, "vectorized"), data)
    if why is None:
        vectorized = run_course(_config(size, a, "vectorized"), data, a)
        print(f"fedcore vectorized:      {vectorized:,.0f} tokens/s")
        line += f" fedcore_vectorized={vectorized:.0f} ratio_vectorized_over_plain={vectorized / plain:.3f}"
    else:
        print(f"fedcore vectorized:      not run ({why})")
    print(line)
    return 0


def _why_not_vectorized(cfg, data) -> str | None:
    """The vectorized executor's own reason for refusing this course (None: it accepts it)."""
    from fedcore.runtime.course import Course
    from fedcore.execution.vectorized import VectorEngine
    plain = Course(cfg.with_overrides(executor="sequential"), outdir=None).build(data)
    return VectorEngine.unsupported(plain.trainer, cfg)


def _count(cfg, data) -> tuple[int, int]:
    from fedcore.scenarios.models import build_model
    return build_model(cfg, data.input_shape, data.num_classes).parameter_counts()


if __name__ == "__main__":
    sys.exit(main())
