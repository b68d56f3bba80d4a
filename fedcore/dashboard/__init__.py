"""A live dashboard of runs: `python -m fedcore.dashboard OUTDIR [OUTDIR ...] [--port P]`.

One page, with uPlot (MIT, bundled in `static/` with its license) drawing what the
runs' `metrics.jsonl` (and a study's `trials.jsonl`) hold, polled as they grow. A deployed
server serves the same page on its operations port (`distribute.dashboard`).
"""
from fedcore.dashboard.app import Dashboard

__all__ = ["Dashboard"]
