"""Attack simulation as a participant plug-in (`attack.type`, `attack.clients | attack.fraction`).

The named clients are moved to a derived role, `attacker`, whose
`receiving_models` handler trains on poisoned data and/or poisons the update
before replying; every other handler is the clients' own, and the clients'
table is left untouched. With `backdoor`, each evaluation round's record also
gets `backdoor_acc`: the share of the server's test samples whose label is
not the target that the global model assigns to the target once triggered
(the attack's success rate, next to the clean `test_acc`).
"""
from __future__ import annotations

import torch

from fedcore.kernel import registry
from fedcore.algorithms.attacks import (add_trigger, drift_update, fixed_direction, flip_labels,
                                        gaussian_update, poison_backdoor, scale_update, sign_flip)
from fedcore.algorithms.participants import chosen_clients
from fedcore.kernel.config import declare, fraction, positive, validator
from fedcore.kernel.errors import ConfigError
from fedcore.handlers.derived_role import DerivedTable
from fedcore.handlers.evaluation import load_global
from fedcore.handlers.rounds import is_eval_round
from fedcore.kernel.hooks import Wrapper
from fedcore.kernel.message import SERVER_ID
from fedcore.scenarios.data import ClientData, Split
from fedcore.kernel.worker import Stopwatch

__all__ = ["ATTACKS", "attack_and_reply", "backdoor_success", "install"]

ATTACKS = ("none", "label_flip", "sign_flip", "scaled_replacement", "gaussian", "backdoor", "drift")

declare("attack.type", str, "none", "what the malicious clients do", choices=ATTACKS)
declare("attack.clients", list, None, "ids of the malicious clients")
declare("attack.fraction", float, None, "fraction of clients (seeded draw) that are malicious",
        check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]")
declare("attack.scale", float, None, "sign_flip: sent w - scale*delta (default 1); "
        "scaled_replacement and backdoor: sent w + scale*delta (default: clients per round, "
        "resp. 1); drift: sent w + scale*|delta|*e along one fixed unit direction e (default 7)",
        check=positive)
declare("attack.noise_std", float, 1.0, "gaussian: std of the noise sent as an update",
        check=positive)
declare("attack.target_label", int, 0, "backdoor: the label triggered inputs should get")
declare("attack.poison_ratio", float, 0.5, "backdoor: share of an attacker's training samples "
        "that are triggered and relabelled", check=fraction)
declare("attack.trigger_size", int, 3, "backdoor: side of the pixel patch (or number of trailing "
        "features) set by the trigger", check=positive)
declare("attack.trigger_value", float, 3.0, "backdoor: value written by the trigger")


@validator
def _check_attack(cfg) -> None:
    if cfg["attack.type"] == "none":
        return
    if cfg["attack.clients"] is not None and cfg["attack.fraction"] is not None:
        raise ConfigError("attack.clients and attack.fraction are both set; keep one")
    if cfg["attack.clients"] is None and cfg["attack.fraction"] is None:
        raise ConfigError(f"attack.type: {cfg['attack.type']} needs attack.clients=[ids] or "
                          "attack.fraction=<share of clients>")


class _Attack:
    """The configured attack: poisoned data per client (cached) and the update transform."""

    def __init__(self, course):
        cfg = course.cfg
        self.course = course
        self.kind = cfg["attack.type"]
        self.seed = cfg["seed"]
        default = {"sign_flip": 1.0, "backdoor": 1.0, "drift": 7.0}.get(self.kind)
        if default is None:
            from fedcore.kernel.schema import clients_per_round
            default = float(clients_per_round(cfg))
        self.scale = cfg["attack.scale"] if cfg["attack.scale"] is not None else default
        self.noise_std = cfg["attack.noise_std"]
        self.trigger = (cfg["attack.trigger_size"], cfg["attack.trigger_value"])
        self.target = cfg["attack.target_label"]
        self.ratio = cfg["attack.poison_ratio"]
        self._data: dict[int, ClientData] = {}
        self._direction: dict[int, dict] = {}

    def _gen(self, client_id: int, round_: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 7919 + client_id) * 104_729 + round_)

    def data(self, client) -> ClientData:
        if client.id not in self._data:
            d = client.data
            if self.kind == "label_flip":
                nc = self.course.data.num_classes
                d = ClientData(Split(d.train.x, flip_labels(d.train.y, nc)), d.val, d.test)
            elif self.kind == "backdoor":
                d = poison_backdoor(d, self.ratio, self.target, *self.trigger, self._gen(client.id, 0))
            self._data[client.id] = d
        return self._data[client.id]

    def poison(self, content: dict, received: dict, client_id: int, round_: int) -> dict:
        model, ref = content["model"], received["model"]
        if self.kind == "sign_flip":
            model = sign_flip(model, ref, self.scale)
        elif self.kind in ("scaled_replacement", "backdoor"):
            model = scale_update(model, ref, self.scale) if self.scale != 1.0 else model
        elif self.kind == "gaussian":
            model = gaussian_update(model, ref, self.noise_std, self._gen(client_id, round_))
        elif self.kind == "drift":   # one direction per attacker for the whole course
            if client_id not in self._direction:
                self._direction[client_id] = fixed_direction(ref, self._gen(client_id, 0))
            model = drift_update(model, ref, self.scale, self._direction[client_id])
        return dict(content, model=model)


def attack_and_reply(client, msg) -> None:
    """Attacker `receiving_models`: train on (poisoned) data, poison the update, reply."""
    attack: _Attack = client.course.attack
    client.round = msg.round
    with Stopwatch() as sw:
        result = client.course.trainer.fit(client.id, attack.data(client), msg.content, msg.round)
        content = attack.poison(result.content, msg.content, client.id, msg.round)
    client.spend(result.work, sw.seconds)
    client.send("updates", SERVER_ID, content, round_=msg.round)


@torch.no_grad()
def backdoor_success(model, x: torch.Tensor, y: torch.Tensor, target: int, size: int,
                     value: float) -> float | None:
    """Share of non-target samples classified as `target` once the trigger is added."""
    keep = y != target
    if not keep.any():
        return None
    was = model.training
    model.eval()
    pred = model(add_trigger(x[keep], size, value)).argmax(1)
    model.train(was)
    return (pred == target).double().mean().item()


def install(course) -> None:
    """Behaviour: move the malicious clients to the `attacker` role."""
    cfg = course.cfg
    course.attack = attack = _Attack(course)
    everyone = list(range(1, course.num_clients + 1))  # a deployed client knows only itself
    bad = chosen_clients(everyone, cfg["attack.clients"], cfg["attack.fraction"],
                         cfg["seed"], 6007, "attack")
    table = DerivedTable("attacker", course.client_table)
    table.register("receiving_models", attack_and_reply, sends=("updates",))
    course.extra_tables.append(table)
    for cid in bad:
        client = course.clients.get(cid)
        if client is None:
            continue  # a deployed client process holds only itself
        client.handlers = table
        # The attacker's data is its poisoned data, for whatever trains it: an executor that
        # batches the fits of one broadcast reads `client.data`, not `attack.data(client)`.
        client.data = attack.data(client)
    course.monitor.add_summary("attack", {"attack": attack.kind, "attackers": sorted(bad)})
    if attack.kind == "backdoor" and course.server is not None:
        server = course.server

        def with_backdoor_metric(aggregate, updates, round_):
            out = dict(aggregate(updates, round_) or {})
            if is_eval_round(server):
                test = course.data.server_test
                load_global(server)   # viewed, not copied into the module: its tensors are the
                # previous model's, which admission's snapshot may still have to put back
                rate = backdoor_success(server.model, test.x, test.y, attack.target, *attack.trigger)
                if rate is not None:
                    out["backdoor_acc"] = rate
                    course.monitor.add_summary("attack", {"final_backdoor_acc": rate})
            return out
        server.aggregator.wrap(Wrapper("attack backdoor metric", "aggregate", with_backdoor_metric))


install.enabled = lambda cfg: cfg["attack.type"] != "none"
registry.behaviours.register("attack", install)
