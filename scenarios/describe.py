"""`python -m fedcore.scenarios.describe --cfg FILE.yaml [KEY=VALUE ...] [--png FILE]`.

Prints the federated data a config produces, without training: the server's
test size, each client's train/val/test sizes and label histogram, and a
summary of size and label skew. `--png` writes a clients x labels heat map
(each row is that client's label distribution). Exit codes as for
`fedcore.run`: 2 for a bad config or missing data files.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from fedcore.kernel.errors import EXIT_OK, ConfigError, FedcoreError

__all__ = ["label_histograms", "label_entropy", "describe", "heat_map", "main"]


def label_histograms(data) -> np.ndarray:
    """clients x classes counts over each client's train+val+test samples."""
    hist = np.zeros((len(data.clients), data.num_classes), dtype=np.int64)
    for row, cid in enumerate(sorted(data.clients)):
        c = data.clients[cid]
        for split in (c.train, c.val, c.test):
            if len(split):
                hist[row] += np.bincount(split.y.long().numpy(), minlength=data.num_classes)
    return hist


def label_entropy(hist: np.ndarray) -> np.ndarray:
    """Per-row Shannon entropy (nats) of the label distribution; 0 for an empty row."""
    totals = hist.sum(axis=1, keepdims=True)
    p = np.divide(hist, totals, out=np.zeros(hist.shape, dtype=np.float64), where=totals > 0)
    logs = np.log(p, out=np.zeros_like(p), where=p > 0)
    return -(p * logs).sum(axis=1)


def describe(cfg, data, out=None) -> np.ndarray:
    """Print the per-client table and summary; returns the label histograms."""
    out = out if out is not None else sys.stdout
    hist = label_histograms(data)
    sizes = hist.sum(axis=1)
    ent = label_entropy(hist)
    print(f"data.type={cfg['data.type']} partition={cfg['data.partition']} clients={len(data.clients)} "
          f"classes={data.num_classes} input_shape={tuple(data.input_shape)} "
          f"server_test={len(data.server_test)}", file=out)
    width = max(5, len(str(int(hist.max(initial=0)))))
    print(f"{'client':>6} {'train':>6} {'val':>5} {'test':>5}  labels 0..{data.num_classes - 1}", file=out)
    for row, cid in enumerate(sorted(data.clients)):
        c = data.clients[cid]
        counts = " ".join(f"{v:>{width}d}" for v in hist[row])
        print(f"{cid:>6} {len(c.train):>6} {len(c.val):>5} {len(c.test):>5}  {counts}", file=out)
    max_ent = np.log(data.num_classes) if data.num_classes > 1 else 1.0
    print(f"sizes: total {int(sizes.sum())}, min {int(sizes.min())}, median {float(np.median(sizes)):g}, "
          f"max {int(sizes.max())}; labels per client: mean "
          f"{float((hist > 0).sum(axis=1).mean()):.2f}; label entropy: mean {float(ent.mean()):.3f} "
          f"nats ({float(ent.mean() / max_ent):.2f} of uniform)", file=out)
    return hist


def heat_map(hist: np.ndarray, path: str | Path):
    """Draw the clients x labels distribution (each row normalised to sum 1) and save it to
    `path` (png, svg, pdf, ... by suffix); returns the matplotlib Figure."""
    from fedcore.plot import new_figure
    totals = hist.sum(axis=1, keepdims=True)
    frac = np.divide(hist, totals, out=np.zeros(hist.shape, dtype=np.float64), where=totals > 0)
    n_clients, n_labels = frac.shape
    fig = new_figure(min(12.0, 2.5 + 0.35 * n_labels), min(12.0, 1.5 + 0.25 * n_clients))
    ax = fig.subplots()
    image = ax.imshow(frac, cmap="Reds", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest",
                      extent=(-0.5, n_labels - 0.5, n_clients + 0.5, 0.5))
    ax.set_xlabel("label")
    ax.set_ylabel("client")
    fig.colorbar(image, ax=ax, label="fraction of the client's samples")
    fig.savefig(path)
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedcore.scenarios.describe",
                                description="Describe the federated data a config produces.")
    p.add_argument("--cfg", help="the course's YAML config (omit to use defaults and overrides)")
    p.add_argument("--png", metavar="FILE", help="write a clients x labels heat map (matplotlib; "
                   "png, svg or pdf by the suffix)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    args = p.parse_intermixed_args(argv)
    try:
        from fedcore.kernel.config import load_config
        from fedcore.scenarios.data import build_federated_data
        cfg = load_config(args.cfg, args.overrides)
        if cfg["train.loss"] == "mse":
            raise ConfigError("train.loss: describe shows label histograms; it needs a classification "
                              "task (train.loss=cross_entropy)")
        data = build_federated_data(cfg)
        hist = describe(cfg, data)
        if args.png:
            heat_map(hist, args.png)
            print(f"heat map: {args.png} ({hist.shape[0]} clients x {hist.shape[1]} labels)")
    except FedcoreError as exc:
        print(f"fedcore: {exc}", file=sys.stderr)
        return exc.exit_code
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
