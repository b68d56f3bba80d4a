"""W6 in Flower's simulation: the same course as `bench.w6_time_to_accuracy`, for a
side-by-side time to accuracy. Optional: it runs only where `flwr` (with its `simulation`
extra) is installed, and is not part of the tests. It imports no fedcore (the two pin
different protobuf versions, so they are installed in separate environments).

    python -m bench.w6_flower [--target 0.9] [--max-rounds 100]

The same data (`bench.images.image_samples`, made on access from `seed + client_id`), LeNet-5,
one local epoch of SGD (batch 32, lr 0.05), FedAvg over 100 of 1000 clients per round,
the server's test shard evaluated after every round. Flower samples clients and orders
mini-batches its own way, so the models differ from fedcore's; the accuracy curve is what
compares. The clock starts before the simulation starts (its start-up is part of the time)
and stops at the evaluation that reaches the target; the script then ends at once. Last
line: `flower_s_to_target=... flower_rounds=... flower_start_s=...`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from bench.images import LeNet5, class_templates, image_samples   # torch only: no fedcore here


def _shutdown_ray() -> None:
    """Stop the simulation's Ray processes (an exit from inside a round would leave them)."""
    try:
        import ray
        ray.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--max-rounds", type=int, default=100)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--samples", type=int, default=100)
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--test-samples", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    try:
        import flwr as fl
        from flwr.common import ndarrays_to_parameters
    except ImportError:
        print("W6 Flower: flwr is not installed (pip install 'flwr[simulation]'); nothing to run",
              file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    templates = class_templates(0)
    test_x, test_y = image_samples(0, 10_000_000, a.test_samples, templates)   # W6's test shard
    keys = list(LeNet5().state_dict())

    def set_weights(model: nn.Module, arrays) -> None:
        model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in zip(keys, arrays)})

    def get_weights(model: nn.Module):
        return [v.detach().cpu().numpy() for v in model.state_dict().values()]

    class Client(fl.client.NumPyClient):
        def __init__(self, cid: int):
            self.cid = cid

        def fit(self, parameters, config):
            torch.set_num_threads(a.threads)
            model = LeNet5()
            set_weights(model, parameters)
            x, y = image_samples(0, self.cid, a.samples, templates)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(self.cid))
            for start in range(0, len(y), 32):
                idx = perm[start:start + 32]
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
            return get_weights(model), len(y), {}

    def client_fn(cid: str):
        return Client(int(cid) + 1).to_client()   # fedcore's client ids start at 1

    model = LeNet5()
    start = time.perf_counter()
    started: list[float] = []

    def evaluate(server_round, parameters, config):
        if not started:
            started.append(time.perf_counter() - start)   # the first call: round 0, the initial model
        set_weights(model, parameters)
        model.eval()
        with torch.no_grad():
            out = model(test_x)
            loss = float(nn.functional.cross_entropy(out, test_y))
            acc = float((out.argmax(1) == test_y).float().mean())
        print(f"W6 Flower round {server_round}: test acc {acc:.4f} at {time.perf_counter() - start:.2f} s",
              flush=True)
        if server_round > 0 and acc >= a.target:
            print(f"flower_s_to_target={time.perf_counter() - start:.3f} flower_rounds={server_round} "
                  f"flower_start_s={started[0]:.3f} clock=wall", flush=True)
            _shutdown_ray()
            os._exit(0)   # the target is reached: the remaining rounds would only cost time
        return loss, {"accuracy": acc}

    strategy = fl.server.strategy.FedAvg(
        fraction_fit=a.per_round / a.clients, min_fit_clients=a.per_round,
        fraction_evaluate=0.0, min_evaluate_clients=0, min_available_clients=a.clients,
        evaluate_fn=evaluate, initial_parameters=ndarrays_to_parameters(get_weights(model)))
    fl.simulation.start_simulation(
        client_fn=client_fn, num_clients=a.clients, strategy=strategy,
        config=fl.server.ServerConfig(num_rounds=a.max_rounds),
        client_resources={"num_cpus": 1, "num_gpus": 0.0})
    print(f"W6 Flower: the target {a.target} was not reached in {a.max_rounds} rounds", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
