"""LoRA fine-tuning of a decoder built from config, many clients a round: fedcore's tokens per
second and peak memory, against the plain single-model loop.

    python -m bench.llm_lora [--size 160m] [--clients 16] [--steps 4] [--rounds 3]
    python -m bench.llm_lora --device cpu --size tiny        # a smoke test without a GPU
    python -m bench.llm_lora --device cpu --size 1b --clients 8 --steps 1 --batch 1 \
        --seq-len 64 --rounds 2 --course-only                # a 1.1B-parameter decoder on a CPU

`160m`: a Llama-style decoder (12 layers, hidden 768, MLP 3072, vocabulary 32,000: about
162M parameters); `1b`: 20 layers, hidden 2048, 16 heads, MLP 5504 (1,143M); both with LoRA
rank 16 on q_proj and v_proj and random weights (nothing downloads). Each round every client
loads the global adapters, takes `--steps` SGD steps on its own batches of random tokens and
sends its adapters; the server averages them (model.lora.aggregation: separate, the same
arithmetic as the plain loop's mean). The plain loop does the same work with one model and no
messages. Tokens per second count the training tokens of the rounds after the first (the
first builds and warms up) over those rounds' wall seconds; `cpu_s_timed` is the process's CPU
seconds in them.

The fedcore sequential course runs first; `peak_rss_gb` is the process's peak resident memory
(VmHWM) when it ends: imports, data, the model's build and the whole course, nothing else
yet. `base_copies` counts the copies of the frozen base that the server's model and the
trainer's hold together (1: they share it). Then, unless `--course-only`, the plain loop and
fedcore's vectorized executor (the adapters of a round's clients stacked over one shared
frozen base) where it accepts the course, else its reason is printed. The last line reads
`llm_lora_tokens_per_s_fedcore_sequential=... tokens_timed=... wall_s_timed=... cpu_s_timed=...
peak_rss_gb=... base_copies=... [plain=... ratio_sequential_over_plain=...
fedcore_vectorized=... ratio_vectorized_over_plain=...]`. Exits 1 with one line where the
peak exceeds `--max-rss-gb` (24), and 2 where `--device cuda` (the default) finds no GPU.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from dataclasses import dataclass

import torch

SIZES = {
    "1b": dict(arch="llama", layers=20, heads=16, hidden=2048, intermediate=5504, vocab=32000,
               rank=16, targets=["q_proj", "v_proj"]),
    "160m": dict(arch="llama", layers=12, heads=12, hidden=768, intermediate=3072, vocab=32000,
                 rank=16, targets=["q_proj", "v_proj"]),
    "tiny": dict(arch="gpt2", layers=2, heads=2, hidden=64, intermediate=256, vocab=259,
                 rank=4, targets=["c_attn"]),
}


@dataclass
class Timed:
    """Training tokens of the rounds after the first, their wall seconds and the process's CPU
    seconds in them (what a shared machine's load does not stretch)."""

    tokens: int
    seconds: float
    cpu_seconds: float

    @property
    def per_s(self) -> float:
        return self.tokens / self.seconds


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


def _timed(a, wall: list[float], cpu: list[float]) -> Timed:
    """The rounds after the first: every client's `steps` batches of `batch` x `seq_len` tokens."""
    return Timed(a.clients * a.steps * a.batch * a.seq_len * (len(wall) - 1), sum(wall[1:]), sum(cpu[1:]))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_plain(cfg, data, a) -> Timed:
    """One model; each client: load the adapters, `steps` SGD steps, keep its adapters; then their
    mean."""
    from fedcore.scenarios.models import build_model
    model = build_model(cfg, data.input_shape, data.num_classes).to(a.device)
    params = [p for p in model.parameters() if p.requires_grad]
    global_ = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=0.01)
    times, cpu = [], []
    for _ in range(a.rounds):
        _sync(a.device)
        t0, c0 = time.perf_counter(), time.process_time()
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
        cpu.append(time.process_time() - c0)
    return _timed(a, times, cpu)


def run_course(cfg, data, a, before_run=None) -> Timed:
    from bench.common import run_fedcore
    rounds = run_fedcore(cfg, data, before_run)
    return _timed(a, rounds.wall_rounds, rounds.cpu_rounds)


def base_copies(*models: torch.nn.Module) -> int:
    """Copies of the frozen base that `models` hold together: the distinct bytes of their frozen
    parameters over one model's."""
    storages: dict[int, int] = {}
    for m in models:
        for p in m.parameters():
            if not p.requires_grad:
                storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    one = sum(p.untyped_storage().nbytes() for p in models[0].parameters() if not p.requires_grad)
    return round(sum(storages.values()) / one) if one else 0


def main(argv=None) -> int:
    from bench.peak_rss import peak_rss
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--size", default="160m", choices=sorted(SIZES))
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--course-only", action="store_true",
                   help="the fedcore sequential course alone: no plain loop, no vectorized run")
    p.add_argument("--max-rss-gb", type=float, default=24.0,
                   help="exit 1 where the course's peak resident memory exceeds this many GB")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench.llm_lora: torch sees no GPU; run it on a CUDA machine, or with --device cpu "
              "--size tiny as a smoke test", file=sys.stderr)
        return 2
    if a.rounds < 2:
        p.error("--rounds must be at least 2 (the first round is not timed)")
    size = SIZES[a.size]
    data = _data(size, a)
    seen: dict = {}

    def before_run(course) -> None:   # the course is built: its models, and the vectorized verdict
        from fedcore.execution.vectorized import VectorEngine
        trainable, total = course.server.model.parameter_counts()
        print(f"model {a.size}: {total:,} parameters, {trainable:,} in adapters; {a.clients} clients "
              f"x {a.steps} steps x {a.batch} x {a.seq_len} tokens a round on "
              f"{torch.cuda.get_device_name() if a.device == 'cuda' else 'the CPU'}", flush=True)
        seen["why_not_vectorized"] = VectorEngine.unsupported(course.trainer, _config(size, a, "vectorized"))
        seen["base_copies"] = base_copies(course.server.model, course.trainer.model)

    sequential = run_course(_config(size, a, "sequential"), data, a, before_run)
    peak_gb = peak_rss() / 1e9
    gc.collect()
    print(f"fedcore sequential:      {sequential.per_s:,.3f} tokens/s; peak RSS {peak_gb:.3f} GB", flush=True)
    line = (f"llm_lora_tokens_per_s_fedcore_sequential={sequential.per_s:.3f} "
            f"tokens_timed={sequential.tokens} wall_s_timed={sequential.seconds:.6f} "
            f"cpu_s_timed={sequential.cpu_seconds:.6f} "
            f"peak_rss_gb={peak_gb:.3f} base_copies={seen['base_copies']}")
    if not a.course_only:
        plain = run_plain(_config(size, a, "sequential"), data, a).per_s
        print(f"plain single-model loop: {plain:,.3f} tokens/s", flush=True)
        line += f" plain={plain:.3f} ratio_sequential_over_plain={sequential.per_s / plain:.3f}"
        why = seen["why_not_vectorized"]
        if why is None:
            vectorized = run_course(_config(size, a, "vectorized"), data, a).per_s
            print(f"fedcore vectorized:      {vectorized:,.3f} tokens/s")
            line += f" fedcore_vectorized={vectorized:.3f} ratio_vectorized_over_plain={vectorized / plain:.3f}"
        else:
            print(f"fedcore vectorized:      not run ({why})")
    print(line)
    if peak_gb > a.max_rss_gb:
        print(f"bench.llm_lora: the course's peak resident memory {peak_gb:.3f} GB exceeds "
              f"--max-rss-gb {a.max_rss_gb:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
