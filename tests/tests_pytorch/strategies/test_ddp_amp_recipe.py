"""Mixed precision under DDP follows PyTorch's AMP recipe (promise 10 of the fork's design).

``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` with 2 processes over gloo trains the cases of
``amp_oracle/ddp.py``: manual clipping under 16-mixed, two optimizers from one backward, fused AdamW with
clipping (16-mixed and bf16-mixed), skipped steps (an inf on both ranks, the first step included, and on one rank
only), and a resume from a checkpoint. Each rank trains on its half of every global batch.

Why ``strategy="ddp"`` and a subprocess: "ddp" is what users run, and Lightning's launcher re-runs the main script as
the other rank, which a pytest process cannot be. So the test runs ``python -m amp_oracle.ddp`` once; all cases (and
the negative controls through ``stock_pytorch_lightning``) share one process start-up. Both ranks save what they
recorded; the test checks that they agree, then compares rank 0 with the references (the oracle module's docstring
explains them):

* **bitwise** with the single-process recipe that computes the two halves' gradients separately, sums them in fp32
  and halves them: that is the arithmetic of a two-rank all-reduce, exactly;
* **within a tolerance** with the single-process recipe on the whole global batch (:func:`global_tolerance` says which
  and why); scale trajectory and skipped steps exactly.

The stock 2.6.6 (``stock_pytorch_lightning``) runs the manual-clipping and two-optimizer cases through the same script
and fails both comparisons (off by ~1e-2 in the weights: 150 and 37 times the tolerance), so they can fail.
"""

import functools
import math
from typing import Optional

import pytest
import torch
from amp_oracle.ddp import CASES, RUNS, STOCK_CASES, Case, case_of, launch, recipe_run
from amp_oracle.run import Run, TensorCheck, assert_same_run
from amp_oracle.torch_features import requires_cpu_16_mixed, requires_cpu_fused
from amp_oracle.trainer import FORK, NO_STOCK, STOCK, stock_is_unpatched
from amp_oracle.world import CLIP_NORM, LOW_INIT_SCALE

#: every case trains 16-mixed on CPU, or fused AdamW under bf16-mixed; the subprocess runs them all
pytestmark = [requires_cpu_16_mixed, requires_cpu_fused("AdamW")]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Train every case once; return ``load(package, run, rank) -> Run``."""
    return launch(tmp_path_factory.mktemp("ddp_amp_recipe"), stock=stock_is_unpatched())


recipe = functools.cache(recipe_run)


def within(tolerance: float) -> TensorCheck:
    """A ``check`` for :func:`~amp_oracle.run.assert_same_run`: max abs difference at most ``tolerance``."""

    def check(actual: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
        diff = (actual - expected).abs().max().item()
        return None if diff <= tolerance else f"max abs diff {diff:.3g} > tolerance {tolerance:.3g}"

    return check


#: unit roundoff of the autocast dtype
_UNIT_ROUNDOFF = {"16-mixed": 2.0**-11, "bf16-mixed": 2.0**-8, "32": 2.0**-24}


def global_tolerance(case: Case, expected: Run) -> float:
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
    assert_same_run(ddp_runs(FORK, run, rank=1), ddp_runs(FORK, run, rank=0))


@pytest.mark.parametrize("run", RUNS)
def test_ddp_equals_the_split_recipe_bitwise(ddp_runs, run):
    """Bitwise equal to the recipe that sums the two halves' gradients as the all-reduce does, skipped steps and scale
    trajectory included."""
    assert_same_run(ddp_runs(FORK, run), recipe(case_of(run), split=True))


@pytest.mark.parametrize("run", RUNS)
def test_ddp_matches_the_global_batch_recipe(ddp_runs, run):
    """The single-process recipe on the global batch (mean loss): scales and skips exactly, weights within
    :func:`global_tolerance`."""
    case = case_of(run)
    expected = recipe(case, split=False)
    assert_same_run(ddp_runs(FORK, run), expected, check=within(global_tolerance(case, expected)))


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
    for rank in (0, 1):
        assert_same_run(ddp_runs(FORK, "resume-resumed", rank), ddp_runs(FORK, "resume", rank))


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
    with pytest.raises(AssertionError, match="parameters differ"):  # the bitwise comparison fails by far
        assert_same_run(stock, split, check=within(1e-3))
    with pytest.raises(AssertionError, match="parameters differ"):
        assert_same_run(stock, whole, check=within(10 * global_tolerance(case, whole)))
    assert all(flag is None for row in stock.skipped for flag in row)
    if case.two_optimizers:
        assert stock.scales != whole.scales
