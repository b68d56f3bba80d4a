"""bench/llm_lora.py end to end on the CPU at its `tiny` size: the last line's tokens, seconds,
tokens per second and peak memory agree with the arguments and with each other, and a peak
above --max-rss-gb exits 1 with one line."""
import pytest

from tests.conftest import skip_module_without

skip_module_without("llm", "transformers", "peft")

from bench.llm_lora import main  # noqa: E402
from bench.peak_rss import peak_rss  # noqa: E402

CLIENTS, STEPS, BATCH, SEQ, ROUNDS = 3, 2, 2, 8, 3
ARGS = ["--device", "cpu", "--size", "tiny", "--clients", str(CLIENTS), "--steps", str(STEPS),
        "--batch", str(BATCH), "--seq-len", str(SEQ), "--rounds", str(ROUNDS)]


def _last_line(out: str) -> dict[str, str]:
    return dict(field.split("=") for field in out.strip().splitlines()[-1].split())


def test_the_tiny_course_reports_its_tokens_per_second_and_its_peak_memory(capsys):
    before = peak_rss()
    assert main([*ARGS, "--course-only"]) == 0
    after = peak_rss()
    f = _last_line(capsys.readouterr().out)
    assert set(f) == {"llm_lora_tokens_per_s_fedcore_sequential", "tokens_timed", "wall_s_timed",
                      "cpu_s_timed", "peak_rss_gb", "base_copies"}
    # every client's steps x batch x window, in each round after the first
    tokens = CLIENTS * STEPS * BATCH * SEQ * (ROUNDS - 1)
    assert int(f["tokens_timed"]) == tokens
    seconds = float(f["wall_s_timed"])
    assert seconds > 0 and float(f["cpu_s_timed"]) > 0
    assert float(f["llm_lora_tokens_per_s_fedcore_sequential"]) == pytest.approx(tokens / seconds, rel=1e-4)
    # this process's high-water mark, read after the course: between the marks around the run
    assert before / 1e9 - 5e-4 <= float(f["peak_rss_gb"]) <= after / 1e9 + 5e-4
    assert f["base_copies"] == "1"          # the server's model and the trainer's share the base


def test_with_the_plain_loop_and_a_peak_above_the_limit_the_bench_exits_1_with_one_line(capsys):
    assert main([*ARGS, "--max-rss-gb", "0.01"]) == 1
    out, err = capsys.readouterr()
    f = _last_line(out)
    sequential, plain = float(f["llm_lora_tokens_per_s_fedcore_sequential"]), float(f["plain"])
    assert float(f["ratio_sequential_over_plain"]) == pytest.approx(sequential / plain, abs=2e-3)
    assert "fedcore_vectorized" in f or "vectorized:      not run (" in out
    assert err.count("\n") == 1 and "exceeds --max-rss-gb 0.01" in err and f["peak_rss_gb"] in err
