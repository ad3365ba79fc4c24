"""The Python work the fork adds per training step, counted (``benchmarks/count_calls.py``), stays near stock's.

Counted, not timed, so the figures are exact and the test is not flaky: the calls per steady-state step of a 4x256 MLP
under 16-mixed, the fork against stock Lightning 2.6.6 installed beside it. The bound is what the fork costs today
(1.016 to 1.028, see the benchmarks' README), so a change that adds Python work to every step, such as a context
manager written in Python around each autocast-off region (10 calls more: 1.025), fails here. Host reads must not
exceed stock's, but for the one documented read: a fused optimizer's skipped step, asked by a step-interval scheduler
that holds on it (one per step).
"""

import pytest

from tests_benchmarks.benchmark_modules import load_benchmark

count_calls = load_benchmark("count_calls")


@pytest.mark.parametrize(
    ("mode", "fused", "clip", "bound", "scheduler_reads"),
    [("manual", False, 1.0, 1.02, 0), ("auto", True, 0.0, 1.025, 1), ("fabric", False, 1.0, 1.02, 0)],
    ids=["manual-clip", "auto-fused", "fabric-clip"],
)
def test_python_calls_per_step_stay_within_bounds_of_stocks(mode, fused, clip, bound, scheduler_reads):
    fork = count_calls.run_one("fork", "mlp", mode, "16-mixed", fused, clip)
    stock = count_calls.run_one("stock", "mlp", mode, "16-mixed", fused, clip)
    ratio = fork["calls_per_step"] / stock["calls_per_step"]
    added = count_calls.top_differences(fork, stock, 8)
    assert ratio <= bound, f"fork/stock {ratio:.3f} calls per step; most added: {added}"
    assert fork["reads_per_step"] <= stock["reads_per_step"] + scheduler_reads
