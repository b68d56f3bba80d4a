"""Run every workload, each in its own process, and print one table.

    bench/run_all [--quick]

Each workload script prints its measurements and, as its last line, `key=value`
pairs; this collects those lines into a table with the issue's targets.
`--quick` runs fewer repetitions (a smoke run, not for the record).
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time


def _last_fields(text: str) -> dict[str, str]:
    lines = [ln for ln in text.strip().splitlines() if "=" in ln and " " in ln]
    if not lines:
        return {}
    return dict(kv.split("=", 1) for kv in lines[-1].split() if "=" in kv)


def _run(module: str, args: list[str]) -> tuple[int, str]:
    cmd = [sys.executable, "-m", module, *args]
    print(f"$ {' '.join(['python', '-m', module, *args])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    print(out.rstrip() + f"\n  ({time.perf_counter() - t0:.0f} s)\n", flush=True)
    return proc.returncode, proc.stdout


def _f(v: str | None, fmt: str = "{:.4f}") -> str:
    try:
        return fmt.format(float(v))
    except (TypeError, ValueError):
        return "n/a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions: a smoke run")
    a = p.parse_args(argv)
    reps = ["--reps", "1"] if a.quick else []
    rows = []

    rc, out = _run("bench.w1_overhead", reps + ["--executors", "sequential,vectorized"])
    f = _last_fields(out)
    rows.append(("W1 overhead", "sequential", _f(f.get("fedcore_s_per_round")),
                 _f(f.get("plain_s_per_round")), _ratio(f, ""), "<= 2x",
                 _met(f.get("ratio"), lambda r: r <= 2.0)))
    vr = f.get("fedcore-vectorized_ratio")
    rows.append(("W1 overhead", "vectorized", _f(f.get("fedcore-vectorized_s_per_round")),
                 _f(f.get("plain_s_per_round")), _ratio(f, "fedcore-vectorized_"), "<= 0.10x (10x faster)",
                 _met(vr, lambda r: r <= 0.1)))

    rc, out = _run("bench.w2_compute", (["--reps", "1", "--rounds", "3"] if a.quick else [])
                   + ["--executors", "sequential,processes,vectorized"])
    f = _last_fields(out)
    rows.append(("W2 compute", "sequential", _f(f.get("fedcore_s_per_round")),
                 _f(f.get("plain_s_per_round")), _ratio(f, ""), "<= 1.10x",
                 _met(f.get("ratio"), lambda r: r <= 1.10)))
    pr = f.get("fedcore-processes_ratio")
    rows.append(("W2 compute", "processes (wall clock)", _f(f.get("fedcore-processes_s_per_round")),
                 _f(f.get("plain_wall_s_per_round")), _f(pr, "{:.2f}x"), "-", ""))
    vr = f.get("fedcore-vectorized_ratio")
    rows.append(("W2 compute", "vectorized", _f(f.get("fedcore-vectorized_s_per_round")),
                 _f(f.get("plain_s_per_round")), _ratio(f, "fedcore-vectorized_"), "<= 1x",
                 _met(vr, lambda r: r <= 1.0)))

    rc, out = _run("bench.w3_scale", [])
    f = _last_fields(out)
    rows.append(("W3 scale", "SCAFFOLD, 1,000,000 clients, disk store", _f(f.get("fedcore_s_per_round")),
                 _f(f.get("plain_s_per_round")), _f(f.get("ratio"), "{:.2f}x"),
                 f"RSS < 3072 MB (got {f.get('peak_rss_mb', '?')} MB, disk "
                 f"{f.get('disk_mb', '?')} MB)", _met(f.get("peak_rss_mb"), lambda r: r < 3072)))
    rows.append(("W3 scale", f"first round: build, 1,000,000 joins, round 1 (wall s; cpu "
                 f"{_f(f.get('first_round_cpu_s'), '{:.1f}')})",
                 _f(f.get("first_round_s"), "{:.1f}"), "-", "-", "< 30 s",
                 _met(f.get("first_round_s"), lambda r: r < 30)))
    rc, out = _run("bench.w3_scale", ["--executor", "vectorized"])
    f = _last_fields(out)
    rows.append(("W3 scale", "SCAFFOLD, disk store, vectorized", _f(f.get("fedcore_s_per_round")),
                 _f(f.get("plain_s_per_round")), _f(f.get("ratio"), "{:.2f}x"),
                 f"RSS {f.get('peak_rss_mb', '?')} MB", ""))

    rc, out = _run("bench.w6_time_to_accuracy", reps)
    f = _last_fields(out)
    for ex in ("sequential", "vectorized", "processes"):
        rows.append(("W6 time to accuracy", f"{ex}, wall s to target (RSS {f.get(f'{ex}_rss_mb', '?')} MB)",
                     _f(f.get(f"{ex}_s_to_target"), "{:.2f}"), _f(f.get("plain_s_to_target"), "{:.2f}"),
                     _ratio(f, f"{ex}_") + (f", cpu {_f(f.get(f'{ex}_cpu_ratio'), '{:.2f}x')}"
                                            if f.get(f"{ex}_cpu_ratio") else ""), "-", ""))

    rc, out = _run("bench.w4_events", reps)
    f = _last_fields(out)
    rows.append(("W4 events", "dispatch, events/s", _f(f.get("dispatch_events_per_s"), "{:,.0f}"), "-",
                 "-", ">= 200,000 events/s", _met(f.get("dispatch_events_per_s"),
                                                   lambda r: r >= 200_000)))
    rows.append(("W4 events", "send+dispatch, events/s", _f(f.get("send_events_per_s"), "{:,.0f}"),
                 "-", "-", "-", ""))
    rc, out = _run("bench.w5_wire", (["--reps", "1", "--latency-rounds", "5"] if a.quick else [])
                   + ["--tls"])
    f = _last_fields(out)
    for suffix, mode in (("", "insecure"), ("_tls", "TLS")):
        rows.append(("W5 wire", f"100 MB to 4 processes and back, {mode}, MB/s",
                     _f(f.get(f"w5_mb_per_s{suffix}"), "{:.0f}"), "-", "-", ">= 300 MB/s",
                     _met(f.get(f"w5_mb_per_s{suffix}"), lambda r: r >= 300)))
        rows.append(("W5 wire", f"round latency, 50 clients, tiny model, {mode}, s",
                     _f(f.get(f"w5_round_latency_s{suffix}")), "-", "-", "-", ""))

    try:
        import ray  # noqa: F401 - the optional extra 'ray'
        rc, out = _run("bench.w2_ray", ["--reps", "1", "--rounds", "3"] if a.quick else [])
        f = _last_fields(out)
        rows.append(("W2 on Ray", "ray vs processes, equal CPUs (wall clock)",
                     _f(f.get("ray_s_per_round")), _f(f.get("processes_s_per_round")),
                     _f(f.get("ray_over_processes"), "{:.2f}x"), "<= 1.2x",
                     _met(f.get("ray_over_processes"), lambda r: r <= 1.2)))
    except ImportError:
        rows.append(("W2 on Ray", "not run: the extra 'ray' is not installed", "-", "-", "-",
                     "<= 1.2x", "?"))
    rc, out = _run("bench.gpu", ["--reps", "1"] if a.quick else [])
    f = _last_fields(out)
    rows.append(("W2 on a GPU", "vectorized, device cuda (wall clock)" if rc == 0 else
                 "not run: no CUDA GPU", _f(f.get("W2_fedcore-cuda-vectorized_s_per_round")),
                 _f(f.get("W2_plain-cpu_s_per_round")),
                 _f(1 / float(f["W2_vectorized_speedup_over_plain_cpu"]) if rc == 0 else None,
                    "{:.3f}x"), ">= 10x faster than plain CPU",
                 _met(f.get("W2_vectorized_speedup_over_plain_cpu"), lambda r: r >= 10)))

    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}; load average {os.getloadavg()}")
    head = ("workload", "measurement", "fedcore s/round", "plain s/round", "ratio", "target", "met")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths)] + rows:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


def _ratio(f: dict, prefix: str) -> str:
    """A ratio and, where the script printed it, its min-max over the repetitions."""
    r = _f(f.get(f"{prefix}ratio"), "{:.2f}x")
    rng = f.get(f"{prefix}ratio_range")
    return f"{r} ({rng})" if rng else r


def _met(v, test) -> str:
    try:
        return "yes" if test(float(v)) else "NO"
    except (TypeError, ValueError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
