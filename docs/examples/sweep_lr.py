"""Sweep the client learning rate of the quickstart course and plot the curves.

Run it as a script (`python docs/examples/sweep_lr.py`) or paste it into a
notebook cell by cell: each course runs through `fedcore.run`, which returns
its records, and one call draws every run's test accuracy into one figure.
"""
from pathlib import Path

import fedcore
from fedcore.plot import plot_runs

QUICKSTART = Path(__file__).resolve().parents[2] / "scenarios" / "quickstart.yaml"


def sweep(lrs=(0.02, 0.1, 0.5), rounds=30, outdir="runs/sweep_lr"):
    """One course per learning rate; returns the results and the figure's path."""
    outdir = Path(outdir)
    results = []
    for lr in lrs:
        result = fedcore.run(QUICKSTART, train__optimizer__lr=lr, federate__total_round_num=rounds,
                             eval__freq=1, eval__clients=False, verbose=False,
                             name=f"lr={lr}", outdir=str(outdir / f"lr_{lr}"))
        print(f"lr={lr}: final test_acc {result.summary['final_test_acc']:.3f} after "
              f"{result.summary['virtual_time']:.0f}s of virtual time")
        results.append(result)
    figure = plot_runs([r.outdir for r in results], x="virtual_time", y="test_acc",
                       out=outdir / "test_acc.png", title="FedAvg, client learning rate")
    return results, figure


if __name__ == "__main__":
    _, figure = sweep()
    print(f"curves in {figure}")
