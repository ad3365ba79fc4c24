"""Mixed precision under DDP follows PyTorch's AMP recipe (promise 10 of the fork's design).

``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` with 2 processes over gloo trains the cases of
``tests_pytorch/helpers/amp_ddp.py``: manual clipping under 16-mixed, two optimizers from one backward, fused AdamW with
clipping (16-mixed and bf16-mixed), skipped steps (an inf on both ranks, the first step included, and on one rank
only), and a resume from a checkpoint. Each rank trains on its half of every global batch.

Why ``strategy="ddp"`` and a script: "ddp" is what users run, and Lightning's launcher re-runs the main script as the
other rank, which a pytest process cannot be. So the test runs ``strategies/scripts/ddp_amp_recipe.py`` once in a
subprocess; its first ``fit`` launches rank 1 and every later ``Trainer`` of the script joins the same two processes,
so all cases (and the negative controls through ``stock_pytorch_lightning``) share one process start-up. Both ranks
save what they recorded; the test checks that they agree, then compares rank 0 with the references (the module
docstring of the helper explains them):

* **bitwise** with the single-process recipe that computes the two halves' gradients separately, sums them in fp32
  and halves them: that is the arithmetic of a two-rank all-reduce, exactly;
* **within a tolerance** with the single-process recipe on the whole global batch (:func:`global_tolerance` says which
  and why); scale trajectory and skipped steps exactly.

The stock 2.6.6 (``stock_pytorch_lightning``) runs the manual-clipping and two-optimizer cases through the same script
and fails both comparisons (off by ~1e-2 in the weights: 150 and 37 times the tolerance), so they can fail.
"""

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from amp_oracle.torch_features import requires_cpu_16_mixed, requires_cpu_fused
from amp_oracle.trainer import FORK, NO_STOCK, STOCK, stock_is_unpatched
from amp_oracle.world import CLIP_NORM, LOW_INIT_SCALE
from tests_pytorch.helpers.amp_ddp import CASES, STOCK_CASES, Case, Result, recipe_run

SCRIPT = Path(__file__).parent / "scripts" / "ddp_amp_recipe.py"
#: the script takes ~15 s on 2 cores (process start-up dominates); this is the limit for a stuck collective
TIMEOUT = 300

#: every case trains 16-mixed on CPU, or fused AdamW under bf16-mixed; the script runs them all in one process
pytestmark = [requires_cpu_16_mixed, requires_cpu_fused("AdamW")]

#: every run the script records: the cases, and the resumed half of the resume case
RUNS = [*CASES, *(f"{name}-resumed" for name, case in CASES.items() if case.resume)]


def _case(run: str) -> Case:
    return CASES[run.removesuffix("-resumed")]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Run the script once; return ``load(package, run, rank) -> Result``."""
    outdir = tmp_path_factory.mktemp("ddp_amp_recipe")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(outdir), *(["--stock"] if stock_is_unpatched() else [])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # rank 1 is its child: on a timeout, end both
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the DDP script did not finish in {TIMEOUT} s:\n{output[-5000:]}")
    assert proc.returncode == 0, output[-5000:]
    assert (outdir / "done").exists(), output[-5000:]

    def load(package: str, run: str, rank: int = 0) -> Result:
        data = torch.load(outdir / f"{package}-{run}-rank{rank}.pt", weights_only=True)
        return Result(data["params"], data["scales"] or None, [tuple(row) for row in data["skipped"]])

    return load


_recipes: dict = {}


def recipe(case: Case, split: bool) -> Result:
    if (case, split) not in _recipes:
        _recipes[case, split] = recipe_run(case, split)
    return _recipes[case, split]


def max_abs_diff(actual: dict, expected: dict) -> float:
    assert actual.keys() == expected.keys()
    return max((actual[k] - expected[k]).abs().max().item() for k in expected)


def assert_bitwise(actual: Result, expected: Result) -> None:
    assert actual.scales == expected.scales
    assert actual.skipped == expected.skipped
    differ = {k: (actual.params[k] - p).abs().max().item() for k, p in expected.params.items()}
    assert not any(differ.values()), f"not bitwise equal (max abs diff per parameter): {differ}"


#: unit roundoff of the autocast dtype
_UNIT_ROUNDOFF = {"16-mixed": 2.0**-11, "bf16-mixed": 2.0**-8, "32": 2.0**-24}


def global_tolerance(case: Case, expected: Result) -> float:
    """How far a DDP run may be from the single-process recipe on the global batch, in absolute weight units.

    The only difference is the order of the batch reductions: DDP computes each half's weight gradients (in the
    autocast dtype, rounded to it once) and sums the halves in fp32; the global recipe sums all 8 samples before that
    one rounding. Every other operation is per sample or scales by powers of two (mean over 4 vs 8 samples, the
    all-reduce's 1/2, the loss scale), hence exact. So each step's gradient differs by about the unit roundoff ``u``
    of the autocast dtype (relative), and the weights by the optimizer's response to that, summed over the steps
    taken (to first order; the trajectory of skipped steps is the same, asserted exactly):

    * AdamW's update is normalised (``lr * m / sqrt(v)``): a relative error ``u`` in the gradients moves ``m`` and
      ``sqrt(v)`` by up to ``u`` each, so the update by up to ``2 u lr``; Adam's normalised step can exceed ``lr`` by
      up to ``(1 - beta1) / sqrt(1 - beta2) ~ 3`` at the start, which a factor of 2 on top covers in practice:
      ``4 u lr`` per step. Measured on torch 2.13 CPU: 0.70 (fp16, 5 steps), 0.76 (bf16, 6 steps) and 1.53 (fp16, 10
      steps) times ``u lr n``, so ``4 u lr n`` holds with a margin of 2.6 or more, and stock Lightning's manual
      clipping is off by 150 times it.
    * SGD with momentum after clipping by norm: each gradient element is at most ``CLIP_NORM``, so a step's error is
      at most ``u * CLIP_NORM``, accumulated by the momentum buffer to ``u * CLIP_NORM / (1 - momentum)``, times
      ``lr``, with the same factor 4. This bound assumes every element at the clip norm and every rounding error
      aligned; measured errors are 110 to 140 times below it (few elements are large, rounding errors partly
      cancel), and stock Lightning's two-optimizer run is off by 37 times it.
    """
    u = _UNIT_ROUNDOFF[case.precision]
    steps = sum(not skipped for row in expected.skipped for skipped in row[:1])
    if case.optimizer == "AdamW":
        per_step = 1e-2
    else:
        assert case.optimizer == "SGD-momentum"
        assert case.clip
        per_step = 0.1 * CLIP_NORM / (1 - 0.9)
    return 4 * u * per_step * steps


@pytest.mark.parametrize("run", RUNS)
def test_ranks_agree(ddp_runs, run):
    """DDP keeps the replicas in sync: both ranks end with the same weights, scales and skip signals."""
    assert_bitwise(ddp_runs(FORK, run, rank=1), ddp_runs(FORK, run, rank=0))


@pytest.mark.parametrize("run", RUNS)
def test_ddp_equals_the_split_recipe_bitwise(ddp_runs, run):
    """Bitwise equal to the recipe that sums the two halves' gradients as the all-reduce does, skipped steps and scale
    trajectory included."""
    expected = recipe(_case(run), split=True)
    assert_bitwise(ddp_runs(FORK, run), expected)


@pytest.mark.parametrize("run", RUNS)
def test_ddp_matches_the_global_batch_recipe(ddp_runs, run):
    """The single-process recipe on the global batch (mean loss): scales and skips exactly, weights within
    :func:`global_tolerance`."""
    case = _case(run)
    expected = recipe(case, split=False)
    actual = ddp_runs(FORK, run)
    assert actual.scales == expected.scales
    assert actual.skipped == expected.skipped
    diff, tol = max_abs_diff(actual.params, expected.params), global_tolerance(case, expected)
    assert diff <= tol, f"max abs diff {diff:.3g} > tolerance {tol:.3g}"


def test_skipped_steps(ddp_runs):
    """``step_was_skipped`` is True exactly on the batches with an inf (on both ranks, or on rank 1 only: the
    all-reduce spreads it), the first step included; the scale halves there and doubles elsewhere."""
    case = CASES["skips"]
    actual = ddp_runs(FORK, "skips")
    inf_batches = {batch for batch, _ in case.inf}
    assert actual.skipped == [(i in inf_batches,) for i in range(len(actual.skipped))]
    trajectory = [LOW_INIT_SCALE, *actual.scales]
    for i, (before, after) in enumerate(zip(trajectory, trajectory[1:])):
        assert after == before * (0.5 if i in inf_batches else 2.0), trajectory
    assert all(math.log2(s).is_integer() for s in actual.scales)


def test_resume_is_exact(ddp_runs):
    """Interrupted after the first epoch, resumed from the checkpoint by a fresh Trainer into a network with other
    weights: bitwise the uninterrupted DDP run (and the split recipe, above)."""
    assert_bitwise(ddp_runs(FORK, "resume-resumed"), ddp_runs(FORK, "resume"))
    for rank in (0, 1):
        assert_bitwise(ddp_runs(FORK, "resume-resumed", rank), ddp_runs(FORK, "resume", rank))


@pytest.mark.skipif(not stock_is_unpatched(), reason=NO_STOCK)
@pytest.mark.parametrize("run", STOCK_CASES)
def test_stock_ddp_is_caught(ddp_runs, run):
    """Negative control: the unpatched 2.6.6 (``stock_pytorch_lightning``) under the same DDP script clips scaled
    gradients (manual clipping) and updates the scale after every step (two optimizers): ~1e-2 off in the weights,
    which the bitwise comparison rejects and the tolerance too (by a factor of 150 for AdamW, 37 for SGD); no skip
    signal."""
    case = CASES[run]
    stock = ddp_runs(STOCK, run)
    split, whole = recipe(case, split=True), recipe(case, split=False)
    assert max_abs_diff(stock.params, split.params) > 1e-3  # the bitwise comparison fails by far
    assert max_abs_diff(stock.params, whole.params) > 10 * global_tolerance(case, whole)
    assert all(flag is None for row in stock.skipped for flag in row)
    if case.two_optimizers:
        assert stock.scales != whole.scales
