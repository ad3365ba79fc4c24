"""Fused optimizers under mixed precision (promise 6 of the fork's design).

``Adam``/``AdamW``/``SGD``/``Adagrad(fused=True)`` are unscaled through the ``GradScaler`` like any other optimizer, so
clipping works and ``on_before_optimizer_step`` sees true gradients, never unscaled twice; inf/NaN steps are skipped as
for unfused optimizers; fused ``SGD`` with momentum survives a skipped first step; an optimizer that unscales inside its
own ``step()`` gets a clear error when its gradients must be clipped.

The matrix trains a tiny MLP through the Trainer and through a hand-written PyTorch AMP loop
(``amp_oracle/fused.py`` explains both and what they record).
"""

import math
from dataclasses import replace

import pytest
import torch
from amp_oracle.fused import (
    BITWISE,
    CLIPS,
    MODES,
    NET_SEED,
    OPTIMIZERS,
    Tolerance,
    cached_run,
    lightning_run,
    recipe_run,
    uninitialised_memory_is_nan,
)
from amp_oracle.run import Run, assert_same_run
from amp_oracle.torch_features import OptState, requires_cpu_16_mixed, requires_cpu_fused
from amp_oracle.trainer import FORK, STOCK, lightning_api, quiet_trainer
from amp_oracle.world import (
    CLIP_NORM,
    CLIP_VALUE,
    INIT_SCALE,
    MIXED_PRECISIONS,
    inf_batch,
    mlp,
    named_params,
    optimizer_params,
    uses_scaler,
)


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


#: How far a fused optimizer may drift from its for-loop twin (``foreach=False``) over the 6 batches, in ulps of each
#: tensor's largest element (``Tolerance``), final parameters and optimizer state: the fused CPU kernels round in
#: another order. Measured maxima on torch 2.13 CPU, no margin (at most 6e-8 absolute); a double unscale moves these
#: weights by ~1e-2 to ~2e-1 (the negative control below). Step counters and the gradients the hook sees stay bitwise
#: (the cast to fp16/bf16 absorbs the few-ulp weight differences; should a kernel cross a rounding boundary, relax the
#: later steps to the autocast dtype's resolution, no more).
FUSED_TOLERANCE = {
    "Adam": Tolerance(2),
    "AdamW": Tolerance(2),
    "Adagrad": Tolerance(1),
    "SGD-momentum": Tolerance(1),
    "SGD": BITWISE,
}
STATELESS = {"SGD"}


def _assert_recipe_is_sharp(recipe, precision, clip):
    """The reference run exercises what it claims: every finite step really clipped, the injected inf was skipped."""
    assert all(algorithm == clip for algorithm, _ in recipe.records)
    finite = [s for _, s in recipe.records if s == s and s != float("inf")]
    if clip in ("norm", "value"):
        assert len(finite) == len(recipe.changed) - (precision == "16-mixed")
        limit = CLIP_NORM if clip == "norm" else CLIP_VALUE
        assert min(finite) > 2 * limit, f"clip by {clip} does not clip: total norms / max |grad| {finite}"
    else:
        assert recipe.records == []
    inf_at = inf_batch(precision)
    assert recipe.changed == [i != inf_at for i in range(len(recipe.changed))]


def _assert_skips_exactly(run: Run, precision: str, inf_at, stateful: bool) -> None:
    """The injected inf skipped its step completely (weights and optimizer state untouched, scale halved); every other
    step updated the weights (and the state, for an optimizer that has one), and grew the scale."""
    scales = [INIT_SCALE, *run.scales] if uses_scaler(precision) else [None] * (len(run.changed) + 1)
    for i, (before, after) in enumerate(zip(scales, scales[1:])):
        if i == inf_at:
            assert not run.changed[i], f"batch {i} (inf): the weights changed"
            assert not run.state_changed[i], f"batch {i} (inf): the optimizer state changed"
            assert after == before / 2, f"batch {i} (inf): scale {before} -> {after}"
        else:
            assert run.changed[i], f"batch {i}: the weights did not change"
            assert run.state_changed[i] == stateful, f"batch {i}: optimizer state changed: {run.state_changed[i]}"
            if uses_scaler(precision):
                assert after == before * 2, f"batch {i}: scale {before} -> {after}"
            else:
                assert run.scales is None
    for p in run.params.values():
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("precision", MIXED_PRECISIONS)
@pytest.mark.parametrize("fused", [False, True], ids=["forloop", "fused"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fused_optimizer_matrix(optimizer, fused, precision, clip, mode):
    """Every cell: the Trainer equals PyTorch's AMP recipe with the same optimizer bitwise (weights, optimizer state,
    gradients seen by ``on_before_optimizer_step``, scale trajectory, skipped steps); the injected inf skips its step
    completely; and a fused optimizer equals its for-loop twin within ``FUSED_TOLERANCE``, with the same scale
    trajectory, the same skipped steps and bitwise the same gradients in the hook, i.e. true, unscaled ones."""
    run = cached_run("lightning", optimizer, fused, precision, clip, mode)
    recipe = cached_run("recipe", optimizer, fused, precision, clip, mode)
    _assert_recipe_is_sharp(recipe, precision, clip)

    assert_same_run(run, recipe, check=BITWISE)
    _assert_skips_exactly(run, precision, inf_batch(precision), stateful=optimizer not in STATELESS)
    if precision == "16-mixed":
        # growth every step (growth_interval=1), one back-off at the inf
        assert [int(math.log2(s)) for s in run.scales] == [11, 12, 11, 12, 13, 14]

    if fused:
        forloop = cached_run("lightning", optimizer, False, precision, clip, mode)
        assert_same_run(run, forloop, check=FUSED_TOLERANCE[optimizer], grad_check=BITWISE)


#: two ways to a skipped first step: an injected inf, and fp16's usual start (2**18 overflows this model's gradients)
SKIPPED_FIRST_STEP = {
    "inf-at-batch-0": {"inf_at": 0},
    "overflowing-init-scale": {"inf_at": None, "init_scale": 2.0**18},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("start", list(SKIPPED_FIRST_STEP))
@requires_cpu_16_mixed
@requires_cpu_fused("SGD")
def test_fused_sgd_momentum_survives_a_skipped_first_step(start, mode):
    """Fused SGD with momentum whose first step is skipped equals for-loop SGD: the fork gives it zero momentum
    buffers, which is exact with ``dampening=0``. Uninitialised memory is NaN here, so a buffer torch left uninitialised
    could not go unnoticed."""
    kwargs = SKIPPED_FIRST_STEP[start]
    with uninitialised_memory_is_nan():
        fused = lightning_run("SGD-momentum", True, "16-mixed", "none", mode, **kwargs)
    forloop = lightning_run("SGD-momentum", False, "16-mixed", "none", mode, **kwargs)
    recipe = recipe_run("SGD-momentum", False, "16-mixed", "none", mode, **kwargs)

    assert not fused.changed[0], "the first step was not skipped: the test would prove nothing"
    assert any(fused.changed)
    assert_same_run(forloop, recipe, check=BITWISE)
    # the only difference allowed: the skipped first step left zero momentum buffers where for-loop SGD has none yet
    tolerance = FUSED_TOLERANCE["SGD-momentum"]
    assert_same_run(replace(fused, state_changed=None), forloop, check=tolerance, grad_check=BITWISE)
    assert fused.state_changed == [True] + forloop.state_changed[1:]
    for p in fused.params.values():
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("start", list(SKIPPED_FIRST_STEP))
@requires_cpu_16_mixed
@requires_cpu_fused("SGD")
def test_raw_torch_fused_sgd_momentum_breaks_on_a_skipped_first_step(start):
    """Negative control for the test above: PyTorch's own AMP recipe with fused SGD (no Lightning, no protection) leaves
    the momentum buffers uninitialised when the scaler skips the first step, and training is destroyed."""
    kwargs = SKIPPED_FIRST_STEP[start]
    with uninitialised_memory_is_nan():
        raw = recipe_run("SGD-momentum", True, "16-mixed", "none", "automatic", **kwargs)
    forloop = recipe_run("SGD-momentum", False, "16-mixed", "none", "automatic", **kwargs)
    assert not raw.changed[0]
    assert all(torch.isnan(buf["momentum_buffer"]).all() for buf in raw.state), "torch initialised the buffers"
    assert not any(torch.isfinite(p).any() for p in raw.params.values())
    with pytest.raises(AssertionError, match="parameters differ"):
        assert_same_run(raw, forloop, check=FUSED_TOLERANCE["SGD-momentum"])


def _fit_until_error(optimizer: str, fused: bool, clip: str, mode: str) -> None:
    net = mlp(NET_SEED)
    before = named_params(net)
    try:
        lightning_run(optimizer, fused, "16-mixed", clip, mode, inf_at=None, net=net)
    finally:
        for n, p in net.named_parameters():
            assert torch.equal(p, before[n]), f"{n} changed before the error"


@pytest.mark.parametrize("mode", MODES)
def test_fused_sgd_with_dampening_is_refused_before_any_step(mode):
    """Zero buffers are not exact with dampening (for-loop SGD's first step does not dampen), so it is an error."""
    with pytest.raises(ValueError, match=r"SGD\(fused=True, momentum=0.9, dampening=0.1\).*dampening=0"):
        _fit_until_error("SGD-dampening", True, "none", mode)


class _UnscaleAgainInHook(lightning_api(FORK).Callback):
    """A double unscale where the hook can see it: the gradients are divided by the scale a second time."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in optimizer_params(optimizer) if p.grad is not None]
        inv_scale = trainer.precision_plugin.scaler._scale.double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), inv_scale)


class _KernelUnscalesAgain(lightning_api(FORK).Callback):
    """torch 1.13's bug, the reason upstream stopped unscaling fused optimizers: after ``unscale_``, ``scaler.step``
    still passed ``grad_scale`` to the fused kernel, which unscaled again. Making the scaler forget the unscale
    reproduces it; the hook then sees correct gradients, only the weights tell."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        raw = getattr(optimizer, "optimizer", optimizer)
        trainer.precision_plugin.scaler._per_optimizer_states[id(raw)]["stage"] = OptState.READY


@pytest.mark.parametrize("optimizer", ["Adam", "SGD-momentum"])
@pytest.mark.parametrize("double_unscale", [_UnscaleAgainInHook, _KernelUnscalesAgain], ids=["in-hook", "in-kernel"])
def test_the_comparison_catches_a_double_unscale(double_unscale, optimizer):
    """Negative control for the matrix: a fused run that unscales twice fails the very checks the matrix makes. Adam is
    the hard case: nearly invariant to the gradients' scale (only ``eps`` notices), yet the tolerance catches it."""
    bad = lightning_run(optimizer, True, "16-mixed", "none", "automatic", callbacks=(double_unscale(),))
    recipe = cached_run("recipe", optimizer, True, "16-mixed", "none", "automatic")
    forloop = cached_run("lightning", optimizer, False, "16-mixed", "none", "automatic")
    # the sabotage breaks neither the trajectory nor the skipped step: only the values tell
    assert (bad.scales, bad.changed, bad.state_changed) == (forloop.scales, forloop.changed, forloop.state_changed)
    with pytest.raises(AssertionError, match="parameters differ"):
        assert_same_run(bad, forloop, check=FUSED_TOLERANCE[optimizer], grad_check=BITWISE)
    with pytest.raises(AssertionError, match="parameters differ"):
        assert_same_run(bad, recipe, check=BITWISE)
    if double_unscale is _UnscaleAgainInHook:
        with pytest.raises(AssertionError, match=r"gradients at step 0\["):
            assert_same_run(bad, forloop, check=BITWISE)
    else:
        # the hook saw true gradients at the first step; the kernel then unscaled them again
        for name, g in bad.grads[0].items():
            assert torch.equal(g, forloop.grads[0][name])


SELF_UNSCALING_ERROR = (
    r"^Use an optimizer that follows torch's `grad_scale`/`found_inf` protocol .* or do not clip gradients with"
    r" SelfUnscalingSGD: it unscales gradients inside its own `step\(\)` \(it takes a `grad_scaler` argument\)"
    r".*cannot be clipped"
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_optimizer_unscaling_inside_its_step_cannot_be_clipped(clip, mode):
    """The guard that remains: an optimizer of the old ``grad_scaler=`` protocol unscales inside ``step()``, so its
    gradients cannot be unscaled before it without being unscaled twice. Clipping them is refused, before any step."""
    with pytest.raises(RuntimeError, match=SELF_UNSCALING_ERROR):
        _fit_until_error("SelfUnscalingSGD", False, clip, mode)


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_unscaling_inside_its_step_trains_without_clipping(mode):
    """Without clipping it trains: the scaler passes itself as ``grad_scaler`` (torch warns that this protocol is
    deprecated), and the result equals PyTorch's recipe with the same SGD bitwise. Its gradients stay scaled until its
    own step, which is what ``on_before_optimizer_step`` then sees."""
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        run = lightning_run("SelfUnscalingSGD", False, "16-mixed", "none", mode)
    recipe = recipe_run("SGD-momentum", False, "16-mixed", "none", mode)
    assert_same_run(replace(run, grads=None), recipe, check=BITWISE)
    for name, g in run.grads[0].items():
        assert torch.equal(g, recipe.grads[0][name] * INIT_SCALE)


# --------------------------------------------------------------------------------------------------------------------
# negative controls: the unpatched stock_pytorch_lightning 2.6.6
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", MIXED_PRECISIONS)
def test_stock_lightning_refuses_to_clip_fused_optimizers(precision, mode):
    """Stock 2.6.6 raises when a fused optimizer is clipped, even under bf16-mixed where there is no scaler at all;
    the fork's matrix above clips them (bf16-mixed and 16-mixed cells with ``clip != 'none'``)."""
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        lightning_run("Adam", True, precision, "norm", mode, package=STOCK)


def test_stock_lightning_hook_sees_scaled_gradients_of_fused_optimizers():
    """Stock 2.6.6 does not unscale fused optimizers before ``on_before_optimizer_step``: the hook sees gradients
    multiplied by the loss scale, and the matrix's gradient check would catch it."""
    stock = lightning_run("Adam", True, "16-mixed", "none", "automatic", package=STOCK)
    recipe = cached_run("recipe", "Adam", True, "16-mixed", "none", "automatic")
    with pytest.raises(AssertionError, match=r"gradients at step 0\["):
        assert_same_run(stock, recipe, check=BITWISE)
    for name, g in stock.grads[0].items():
        assert torch.equal(g, recipe.grads[0][name] * INIT_SCALE)
