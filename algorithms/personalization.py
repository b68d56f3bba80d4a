"""Personalization: FedBN, Ditto and local fine-tuning (`personalization.method`).

- `fedbn` (Li et al., 2021): BatchNorm weights and statistics are never
  exchanged; each client keeps its own in its state (the exchanged entries
  are `federate.share_params` minus every BatchNorm entry).
- `ditto` (Li et al., 2021): besides the usual update from the global model
  w, each client trains a personal model v on its data with the objective
  F_k(v) + lambda/2 ||v - w||^2 (`personalization.ditto_lambda`) and is
  evaluated with v. As in the paper's Algorithm 1 and its authors' code, every
  personal model starts from w^0, the initial model shared by all (not from
  the first global model the client happens to receive), so lambda = 0 is pure
  local training from w^0; lambda -> infinity gives the global model.
- `finetune` ("localized FedAvg"): before each evaluation a client fine-tunes
  the received global model on its own training split for
  `personalization.local_steps` steps and is evaluated with the result
  (always, or only once it has raised `performance_drop`).

The clients' evaluation replies then describe personalized models, so the
rounds' `client_test_acc_mean / _p10 / _std` are the personalized accuracy.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from fedcore.kernel import registry
from fedcore.kernel.contract import BatchStream, Trainer, evaluate_model
from fedcore.kernel.config import declare, lives_elsewhere, non_negative, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.kernel.hooks import Wrapper

__all__ = ["batchnorm_entries", "ExcludeEntries", "local_train", "evaluate_with", "install"]

declare("personalization.method", str, "none", "none, fedbn (BatchNorm stays local), ditto "
        "(a personal model regularised toward the global one) or finetune (local fine-tuning "
        "before evaluation)", choices=("none", "fedbn", "ditto", "finetune"))
declare("personalization.ditto_lambda", float, 0.1, "ditto: lambda, the pull of the personal model "
        "toward the global one", check=non_negative)
declare("personalization.local_steps", int, None, "ditto: personal steps per round; finetune: "
        "fine-tuning steps (default: the round's local steps)",
        check=positive)
declare("personalization.finetune_on", str, "always", "finetune: every client (always) or only "
        "clients that raised performance_drop", choices=("always", "performance_drop"))
declare("personalization.drop_check", bool, False, "clients compare the received global model with "
        "their own on local validation and raise performance_drop when it is worse")
declare("personalization.drop_margin", float, 0.0, "performance_drop: how much worse (accuracy, or "
        "loss for mse) the global model must be", check=non_negative)
for _method in ("fedbn", "ditto", "finetune"):
    lives_elsewhere("algorithm.name", _method, f"personalization.method={_method} (beside any algorithm.name)")


@validator
def _check_personalization(cfg) -> None:
    if cfg["personalization.finetune_on"] == "performance_drop" and \
            cfg["personalization.method"] != "finetune":
        raise ConfigError("personalization.finetune_on: performance_drop applies to "
                          "personalization.method=finetune only")


def batchnorm_entries(model: nn.Module) -> set[str]:
    """State-dict names of every BatchNorm layer's weights and buffers."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            for name, _ in list(module.named_parameters(recurse=False)) + \
                    list(module.named_buffers(recurse=False)):
                names.add(f"{prefix}.{name}" if prefix else name)
    return names


class ExcludeEntries:
    """A share rule: what `base` shares, minus `names`."""

    def __init__(self, base: Callable[[str], bool], names: set[str]):
        self.base, self.names = base, frozenset(names)

    def __call__(self, name: str) -> bool:
        return name not in self.names and self.base(name)


def local_train(trainer: Trainer, client_id: int, data, steps: int, seed: int,
                penalty: Callable[[], torch.Tensor] | None = None) -> int:
    """`steps` SGD steps of the plain local loss (+ `penalty`) on the model as loaded, each
    on `train.grad_accum_steps` micro-batches as the trainer's own steps are (each loss
    weighted by its share of the step's samples, the penalty once). A fresh optimizer and
    batch stream: nothing of the round's training state is touched."""
    train = data.train
    if not len(train) or steps <= 0:
        return 0
    o = trainer.cfg.section("train.optimizer")
    opt = torch.optim.SGD(trainer.params, lr=o["lr"], momentum=o["momentum"])
    stream = BatchStream(len(train), trainer.cfg["train.batch_size"], seed, client_id,
                         shuffle=trainer.cfg["train.shuffle"])
    trainer.model.train()
    work = 0
    for _ in range(steps):
        batches = [stream.next() for _ in range(trainer.grad_accum)]
        total = sum(len(idx) for idx in batches)
        opt.zero_grad(set_to_none=True)
        for i, idx in enumerate(batches):
            loss = Trainer.objective(trainer, train.x[idx].to(trainer.device), train.y[idx].to(trainer.device))
            loss = loss * (len(idx) / total)   # one micro-batch: x 1.0, the loss unchanged
            if penalty is not None and i == len(batches) - 1:
                loss = loss + penalty()
            loss.backward()
        opt.step()
        work += total
    return work


@torch.no_grad()
def _load(trainer: Trainer, entries: dict[str, torch.Tensor]) -> None:
    for name, t in entries.items():
        trainer.entries[name].copy_(t)


def _snapshot(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.entries.items()}


def _install_fedbn(course) -> None:
    # A deployed client has only the trainer, the server only the aggregator.
    trainer, server = course.trainer, course.server
    model = trainer.model if trainer is not None else server.model
    bn = batchnorm_entries(model)
    if not bn:
        raise ConfigError(f"personalization.method: fedbn needs a model with BatchNorm layers; "
                          f"model.type {course.cfg['model.type']} has none (try mlp_bn or cnn_bn)")
    if trainer is not None:
        trainer.set_shared(ExcludeEntries(trainer.shared, bn))
    if server is not None:
        server.aggregator.set_shared(ExcludeEntries(server.aggregator.shared, bn))


def evaluate_with(trainer: Trainer, data, entries: dict[str, torch.Tensor]) -> dict[str, float]:
    """The trainer's model with `entries` loaded (a personal model), on the client's test split."""
    _load(trainer, entries)
    return evaluate_model(trainer.model, data.test.x, data.test.y, trainer.loss,
                          trainer.cfg["eval.batch_size"])


def _install_ditto(course) -> None:
    trainer, cfg = course.trainer, course.cfg
    lam, store = cfg["personalization.ditto_lambda"], trainer.store
    initial = _snapshot(trainer)   # w^0: installed before any training, from the course's model

    def ditto_fit(fit, client_id, data, received, round_):
        result = fit(client_id, data, received, round_)
        store = trainer.store   # a worker process's own, where one runs the fit
        state = store.load(client_id)
        trainer.load_global(received["model"], state)
        _load(trainer, state.get("ditto_model", initial))
        ref = {n: received["model"][n].detach() for n in trainer.param_names if n in received["model"]}
        named = [(p, ref[n]) for n, p in zip(trainer.param_names, trainer.params) if n in ref]

        def penalty() -> torch.Tensor:
            return 0.5 * lam * sum((p - w).pow(2).sum() for p, w in named)
        steps = cfg["personalization.local_steps"] or trainer.num_steps(len(data.train))
        result.work += local_train(trainer, client_id, data, steps,
                                   cfg["seed"] * 1009 + 3 * round_ + 1, penalty if lam > 0 else None)
        state["ditto_model"] = _snapshot(trainer)
        store.save(client_id, state)
        return result

    def ditto_evaluate(_evaluate, client_id, data, received):
        # a client not yet trained is evaluated with its personal model as it stands: w^0
        return evaluate_with(trainer, data, store.load(client_id).get("ditto_model", initial))
    # the personal model trains on the trainer's model after the global one: the random draws
    # of a model's dropout follow the plain fit's, so it runs where the fit runs
    trainer.wrap(Wrapper("personalization ditto", "fit", ditto_fit, process_safe=True))
    trainer.wrap(Wrapper("personalization ditto", "evaluate", ditto_evaluate))


def _install_finetune(course) -> None:
    trainer, cfg = course.trainer, course.cfg
    store = trainer.store
    only_dropped = cfg["personalization.finetune_on"] == "performance_drop"

    def finetuned_evaluate(evaluate, client_id, data, received):
        state = store.load(client_id)
        if only_dropped and not state.get("personalize"):
            return evaluate(client_id, data, received)
        trainer.load_global(received["model"], state)
        steps = cfg["personalization.local_steps"] or trainer.num_steps(len(data.train))
        local_train(trainer, client_id, data, steps, cfg["seed"] * 1013 + 5)
        return evaluate_model(trainer.model, data.test.x, data.test.y, trainer.loss,
                              cfg["eval.batch_size"])
    trainer.wrap(Wrapper("personalization finetune", "evaluate", finetuned_evaluate))


def install(course) -> None:
    """Behaviour: the configured personalization (trainer and aggregator level only)."""
    method = course.cfg["personalization.method"]
    if method != "fedbn" and course.trainer is None:
        return  # a deployed server: ditto and finetune act on the clients' trainer only
    {"fedbn": _install_fedbn, "ditto": _install_ditto, "finetune": _install_finetune}[method](course)
    course.monitor.add_summary("personalization", {"personalization": method})


install.enabled = lambda cfg: cfg["personalization.method"] != "none"
registry.behaviours.register("personalization", install)
