"""Accuracy of a vertical course against each party alone and against centralized training.

    python -m bench.vertical_table --cfg scenarios/vertical_split.yaml [--seeds 0 1 2]

For each seed: the vertical course itself (fedcore.run); the same model trained centrally on
the joined columns of the aligned rows (one process, one optimizer: equal to the course with
exact communication); and, for each party, the model trained centrally on that party's columns
alone as if it held the labels (only the active party does). Test rows are the course's.
Prints one markdown row per setting: mean test accuracy over the seeds (min-max).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import fedcore
from fedcore.algorithms.splitnn import batch_rows, batches_per_epoch, bottom_model, top_model, make_optimizer
from fedcore.kernel.config import load_config
from fedcore.scenarios.vertical_data import party_tables, standardize, train_test_ids


def _aligned(cfg):
    tables = party_tables(cfg)
    shared = sorted(set.intersection(*(set(t.ids) for t in tables)))
    tr_ids, te_ids = train_test_ids(shared, cfg)
    out = []
    for t in tables:
        tr, te = t.aligned(tr_ids), t.aligned(te_ids)
        if cfg["vertical.standardize"]:
            standardize(tr, te)
        out.append((tr, te))
    return out, out[0][0].y, out[0][1].y, tables[0].num_classes


def _central(cfg, parts, y_tr, y_te, classes, which: list[int]) -> float:
    """Test accuracy of the model over the columns of parties `which`, trained in one process."""
    xs_tr = [parts[p][0].x for p in which]
    xs_te = [parts[p][1].x for p in which]
    n, steps = len(y_tr), batches_per_epoch(len(y_tr), cfg["train.batch_size"]) * cfg["federate.total_round_num"]
    if cfg["vertical.method"] == "splitnn":
        bottoms = [bottom_model(cfg, p, tuple(x.shape[1:])) for p, x in zip(which, xs_tr)]
        top = top_model(cfg, len(which), classes)
        params = [q for m in [top, *bottoms] for q in m.parameters()]

        def forward(xs, rows=None):
            return top(torch.cat([b(x if rows is None else x[rows]) for b, x in zip(bottoms, xs)], 1))
        opt = make_optimizer(cfg, params)
    else:
        x_all = torch.cat([x.double() for x in xs_tr], 1)
        w = torch.zeros(x_all.shape[1], classes, dtype=torch.float64, requires_grad=True)
        b = torch.zeros(classes, dtype=torch.float64, requires_grad=True)

        def forward(xs, rows=None):
            x = torch.cat([v.double() for v in xs], 1)
            return (x if rows is None else x[rows]) @ w + b
        opt = torch.optim.SGD([w, b], lr=cfg["train.optimizer.lr"])
    for s in range(steps):
        rows = batch_rows(cfg["seed"], n, cfg["train.batch_size"], s)
        loss = torch.nn.functional.cross_entropy(forward(xs_tr, rows), y_tr[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float((forward(xs_te).argmax(1) == y_te).double().mean())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cfg", required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args(argv)
    rows: dict[str, list[float]] = {}
    for seed in args.seeds:
        cfg = load_config(args.cfg, extra={"seed": seed, "verbose": False})
        parts, y_tr, y_te, classes = _aligned(cfg)
        for p in range(len(parts)):
            rows.setdefault(f"party {p} alone" + (" (active)" if p == 0 else " (given the labels)"), []).append(
                _central(cfg, parts, y_tr, y_te, classes, [p]))
        with tempfile.TemporaryDirectory() as out:
            result = fedcore.run(args.cfg, seed=seed, verbose=False, outdir=out)
        rows.setdefault("vertical FL (fedcore course)", []).append(result.summary["final_test_acc"])
        rows.setdefault("centralized (joined columns)", []).append(
            _central(cfg, parts, y_tr, y_te, classes, list(range(len(parts)))))
    print(f"| setting | test accuracy, mean over seeds {args.seeds} (min-max) |\n|---|---|")
    for name, accs in rows.items():
        print(f"| {name} | {sum(accs) / len(accs):.4f} ({min(accs):.4f}-{max(accs):.4f}) |")


if __name__ == "__main__":
    main()
