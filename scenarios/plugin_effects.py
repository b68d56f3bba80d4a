"""Measure the plug-ins' effects on the bundled scenarios and print markdown tables.

    python -m fedcore.scenarios.plugin_effects [--rounds R] [--seeds 1 2 3]

Every accuracy table of docs/plugins.md and docs/personalization.md comes from this script
(synthetic data, no download). Accuracies are the final round's, averaged over the seeds.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from fedcore.kernel.config import load_config
from fedcore.runtime.course import Course
from fedcore.handlers.attack import backdoor_success

HERE = Path(__file__).resolve().parent


def run(scenario: str, seed: int, rounds: int | None, **overrides) -> dict:
    """Run `scenarios/<scenario>.yaml` with `key=value` overrides; returns the summary."""
    extra = {"seed": seed, "verbose": False}
    if rounds is not None:
        extra["federate.total_round_num"] = rounds
    extra.update({k.replace("__", "."): v for k, v in overrides.items()})
    cfg = load_config(HERE / f"{scenario}.yaml", extra=extra)
    course = Course(cfg, outdir=None)
    summary = course.run()
    if scenario == "backdoor_normbound":
        test, model = course.data.server_test, course.server.model
        model.load_state_dict(course.server.aggregator.global_state)
        summary["clean_backdoor_acc"] = backdoor_success(
            model, test.x, test.y, cfg["attack.target_label"], cfg["attack.trigger_size"],
            cfg["attack.trigger_value"])
    return summary


def mean_of(rows: list[dict], key: str, final: bool = False) -> float | None:
    vals = [(r["final"] if final else r).get(key) for r in rows]
    vals = [v for v in vals if v is not None]
    return statistics.fmean(vals) if vals else None


def fmt(v) -> str:
    return "–" if v is None else f"{v:.3f}" if abs(v) < 100 else f"{v:.3g}"


def table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) if isinstance(c, str) else fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def robust(seeds, rounds) -> str:
    cases = [("no attack, FedAvg", dict(attack__type="none", aggregator__robust_rule="none"))]
    for rule in ("none", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound"):
        kw = dict(aggregator__robust_rule=rule)
        if rule == "norm_bound":
            kw["aggregator__norm_bound"] = 0.5
        cases.append((f"20% sign-flip, {'FedAvg' if rule == 'none' else rule}", kw))
    rows = []
    for label, kw in cases:
        res = [run("robust_signflip", s, rounds, **kw) for s in seeds]
        rows.append([label, mean_of(res, "final_test_acc")])
    return table(["course", "test acc"], rows)


def attacks(seeds, rounds) -> str:
    rows = []
    for kind, extra in [("label_flip", {}), ("gaussian", {"attack__noise_std": 1.0}),
                        ("scaled_replacement", {"attack__scale": 20.0}), ("sign_flip", {})]:
        row = [f"20% {kind}"]
        for rule in ("none", "median", "krum"):
            res = [run("robust_signflip", s, rounds, attack__type=kind, aggregator__robust_rule=rule,
                       **extra) for s in seeds]
            row.append(mean_of(res, "final_test_acc"))
        rows.append(row)
    return table(["attack (robust_signflip.yaml)", "FedAvg", "median", "krum"], rows)


def backdoor(seeds, rounds) -> str:
    rows = []
    for label, kw in [("no attack", dict(attack__type="none", aggregator__robust_rule="none")),
                      ("backdoor x5, FedAvg", dict(aggregator__robust_rule="none")),
                      ("backdoor x5, norm_bound 1.0", dict(aggregator__norm_bound=1.0)),
                      ("backdoor x5, norm_bound 0.3", dict(aggregator__norm_bound=0.3)),
                      ("backdoor x5, median", dict(aggregator__robust_rule="median"))]:
        res = [run("backdoor_normbound", s, rounds, **kw) for s in seeds]
        if kw.get("attack__type") == "none":  # the trigger's effect on a clean model, for reference
            for r in res:
                r["final_backdoor_acc"] = r["clean_backdoor_acc"]
        rows.append([label, mean_of(res, "final_test_acc"), mean_of(res, "final_backdoor_acc")])
    return table(["course", "test acc", "backdoor success"], rows)


def dp_share(seeds, rounds) -> str:
    rows = []
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        res = [run("dp_fraction", s, rounds, privacy__dp__fraction=frac) for s in seeds]
        rows.append([f"{frac:.2f}", mean_of(res, "final_test_acc"), mean_of(res, "dp_epsilon")])
    return table(["share of clients adding noise (sigma 0.5, C 1)", "test acc",
                  "epsilon of a noisy client (delta 1e-5)"], rows)


def dp_central(seeds, rounds) -> str:
    rows = []
    for sigma in (0.0, 0.5, 1.0, 2.0):
        res = [run("dp_fraction", s, rounds, privacy__dp__mode="central", privacy__dp__fraction=None,
                   federate__sample_client_num=10, privacy__dp__noise_multiplier=sigma) for s in seeds]
        rows.append([f"{sigma}", mean_of(res, "final_test_acc"), mean_of(res, "dp_epsilon")])
    return table(["central DP sigma (C 1, 10 of 20 clients per round)", "test acc",
                  "client-level epsilon (delta 1e-5)"], rows)


def personalization(seeds, rounds) -> str:
    rows = []
    for label, kw in [("FedAvg", dict(personalization__method="none")),
                      ("FedBN", dict(personalization__method="fedbn")),
                      ("Ditto, lambda 0.1", dict(personalization__method="ditto")),
                      ("Ditto, lambda 1", dict(personalization__method="ditto",
                                               personalization__ditto_lambda=1.0)),
                      ("FedAvg + local fine-tuning", dict(personalization__method="finetune")),
                      ("FedRep, 2 head epochs", dict(personalization__method="none", algorithm__name="fedrep",
                                                     algorithm__fedrep__head_epochs=2)),
                      ("pFedMe, lambda 15", dict(personalization__method="none", algorithm__name="pfedme",
                                                 algorithm__pfedme__personal_lr=0.05))]:
        res = [run("personalization_dirichlet", s, rounds, **kw) for s in seeds]
        rows.append([label, mean_of(res, "client_test_acc_mean", True),
                     mean_of(res, "client_test_acc_p10", True), mean_of(res, "client_test_acc_std", True),
                     mean_of(res, "final_test_acc")])
    return table(["method", "client acc mean", "client acc p10", "client acc std",
                  "global model on server test"], rows)


def drift(seeds, rounds) -> str:
    nothing = dict(attack__type="scaled_replacement", attack__scale=1e-9, aggregator__robust_rule="none")
    cases = [("no attack, FedAvg", dict(attack__type="none", aggregator__robust_rule="none")),
             ("no attack, centered_clip", dict(attack__type="none")),
             ("client 1 sends its received model back (its data lost), FedAvg", nothing),
             ("client 1 drifts, FedAvg", dict(aggregator__robust_rule="none")),
             ("client 1 drifts, centered_clip", {}),
             ("no attack, centered_clip from the round's median", dict(attack__type="none",
                                                                     aggregator__cc_center="median")),
             ("client 1 drifts, centered_clip from the round's median", dict(aggregator__cc_center="median"))]
    data = [("natural, 30 a client (the tests' course)", {}),
            ("natural, 200 a client", dict(data__synthetic__samples_per_client=200)),
            ("iid, 100 a client", dict(data__synthetic__iid=True, data__synthetic__samples_per_client=100))]
    rows = [[label] + [mean_of([run("robust_drift", s, rounds, **kw, **d) for s in seeds], "final_test_acc")
                       for _, d in data] for label, kw in cases]
    return table(["course (robust_drift.yaml; test acc)"] + [name for name, _ in data], rows)


SECTIONS = {"robust": robust, "drift": drift,
            "attacks": attacks, "backdoor": backdoor, "dp_share": dp_share, "dp_central": dp_central,
            "personalization": personalization}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="override federate.total_round_num")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--only", nargs="+", choices=sorted(SECTIONS), default=list(SECTIONS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.only:
        print(f"## {name} (seeds {args.seeds})\n")
        print(SECTIONS[name](args.seeds, args.rounds) + "\n", flush=True)


if __name__ == "__main__":
    main()
