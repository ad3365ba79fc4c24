"""Fabric follows PyTorch's AMP recipe (promises 3-7, 9 and 10 of the fork's design).

Every cell trains a tiny MLP through a hand-written Fabric loop and through the hand-written PyTorch AMP recipe and
compares parameters bitwise, the scale after every batch, the norms clipping returned and, per batch and optimizer,
whether the step was skipped (``amp_oracle/fabric.py`` explains both loops). The cells cover:

1. ``fabric.clip_gradients`` by norm and by value, fused and for-loop ``AdamW``/``Adam``/``SGD(momentum)``, in
   32-true, bf16-mixed and 16-mixed (``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", ...))``);
2. idempotent unscaling: ``clip_gradients`` twice, the user's own ``scaler.unscale_`` on the Fabric-wrapped optimizer
   or on ``optimizer.optimizer`` before clipping, the user's own ``scaler.update()``;
3. two optimizers fed by one backward: one scale update per iteration;
4. ``optimizer.step_was_skipped``: true exactly on the steps whose gradients held inf, false without a scaler;
5. the scaler saved and restored by ``fabric.save``/``fabric.load``;
6. misuse under a scaler: ``loss.backward()`` on a loss of the unwrapped module and a step of the raw optimizer raise,
   changing nothing, where stock Fabric steps on gradients divided or multiplied by the scale.

The negative controls run the same cells against the unpatched Fabric 2.6.6, ``stock_lightning_fabric`` (upstream's
wheel renamed, importable in this process), and show that the comparisons catch what stock Fabric does.
"""

import gc
import warnings
from typing import Any, Callable
from unittest import mock

import pytest
import torch
from amp_oracle.fabric import (
    CLIPS,
    DATA_SEED,
    NET_SEED,
    OPTIMIZERS,
    Cell,
    FabricLoop,
    assert_cell_is_sharp,
    fabric_api,
    fabric_run,
    recipe_run,
)
from amp_oracle.run import Run, assert_same_run
from amp_oracle.torch_features import OptState, cpu_grad_scaler
from amp_oracle.world import (
    CLIP_NORM,
    INF_BATCH,
    INIT_SCALE,
    N_BATCHES,
    PRECISIONS,
    inject_inf,
    make_batches,
    make_optimizer,
    mlp,
    new_scaler,
    params_differ,
    uses_scaler,
)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(GradScaler|grad_scaler).*")
        yield


def _check(cell: Cell) -> Run:
    recipe = recipe_run(cell)
    assert_cell_is_sharp(recipe, cell)
    run = fabric_run(cell)
    assert_same_run(run, recipe, records=cell.clip == "norm")
    return run


# --------------------------------------------------------------------------------------------------------------------
# 1. clip_gradients, fused and for-loop
# --------------------------------------------------------------------------------------------------------------------

CLIP_CELLS = [
    Cell(precision, optimizer, fused, clip)
    for precision in PRECISIONS
    for optimizer in OPTIMIZERS
    for fused in (False, True)
    for clip in CLIPS
]


@pytest.mark.parametrize("cell", CLIP_CELLS, ids=lambda c: c.id)
def test_clip_gradients_matches_recipe(cell):
    """``fabric.clip_gradients`` clips true (unscaled) gradients, fused optimizers included, bitwise like the recipe's
    ``scaler.unscale_(opt)`` + ``clip_grad_norm_``/``clip_grad_value_``; the injected inf is skipped and backs off."""
    _check(cell)


def _weights(loop: FabricLoop) -> list:
    return [p.detach().clone() for p in loop.model.parameters()]


def _unchanged(loop: FabricLoop, before: list) -> bool:
    return all(torch.equal(a, b) for a, b in zip(loop.model.parameters(), before))


def _loss(loop: FabricLoop, batch: int = 0) -> torch.Tensor:
    x, y = make_batches(seed=DATA_SEED)[batch]
    return torch.nn.functional.mse_loss(loop.model(x), y)


def _overflow_loop(package: str = "lightning", fused: bool = True) -> "FabricLoop":
    loop = FabricLoop(Cell("16-mixed", "AdamW", fused=fused, clip="norm"), package=package).train(range(INF_BATCH))
    loss = torch.nn.functional.mse_loss(loop.model(torch.ones(4, 8)), torch.zeros(4, 4)) * float("inf")
    loop.fabric.backward(loss)
    return loop


def test_clip_by_norm_tolerates_the_overflow_step_the_scaler_skips():
    """Under a scaler ``clip_gradients`` no longer raises on non-finite gradients by default: overflow steps are normal
    in fp16 training and the scaler skips them. The returned norm is the unscaled gradients' (inf here), the step is
    skipped and the weights are untouched, as in PyTorch's recipe."""
    loop = _overflow_loop()
    before = _weights(loop)
    norm = loop.fabric.clip_gradients(loop.model, loop.opts[0], max_norm=CLIP_NORM)
    assert not torch.isfinite(norm)
    loop.opts[0].step()
    assert loop.opts[0].step_was_skipped
    assert _unchanged(loop, before)


def test_clip_by_norm_returns_the_unscaled_norm():
    loop = FabricLoop(Cell("16-mixed", "AdamW", fused=False, clip="norm"))
    loop.fabric.backward(_loss(loop))
    grads = [p.grad.detach().clone() / loop.scaler.get_scale() for p in loop.model.parameters()]
    norm = loop.fabric.clip_gradients(loop.model, loop.opts[0], max_norm=CLIP_NORM)
    assert torch.equal(norm, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def test_clip_by_norm_raises_when_asked_to():
    loop = _overflow_loop()
    with pytest.raises(RuntimeError, match="non-finite"):
        loop.fabric.clip_gradients(loop.model, loop.opts[0], max_norm=CLIP_NORM, error_if_nonfinite=True)


def test_stock_fabric_clip_by_norm_raises_on_the_overflow_step():
    """Negative control: stock Fabric 2.6.6 raises on a step the scaler would skip (with a non-fused optimizer: it
    cannot clip fused ones at all)."""
    loop = _overflow_loop("stock_lightning_fabric", fused=False)
    with pytest.raises(RuntimeError, match="non-finite"):
        loop.fabric.clip_gradients(loop.model, loop.opts[0], max_norm=CLIP_NORM)


# --------------------------------------------------------------------------------------------------------------------
# 2. unscaling is idempotent
# --------------------------------------------------------------------------------------------------------------------

_UNSCALE_OPTIMIZERS = [("AdamW", False), ("AdamW", True), ("SGD-momentum", True)]
UNSCALE_CELLS = [
    Cell("16-mixed", optimizer, fused, clip, unscaler)
    for optimizer, fused in _UNSCALE_OPTIMIZERS
    for unscaler, clips in (
        ("clip-twice", ("norm", "value")),
        ("user-wrapper", ("none", "norm", "value")),
        ("user-raw", ("none", "norm", "value")),
    )
    for clip in clips
]


def _misused_loop(misuse: str, package: str = "lightning") -> tuple["FabricLoop", list[torch.Tensor]]:
    """One correct iteration, then a second whose gradients come from ``loss.backward()`` (``"unscaled-backward"``),
    or whose step goes to the raw optimizer on scaled gradients (``"raw-step"``); returns the weights before it.

    The unscaled backward runs on the module Fabric wrapped (``model.module``, or the reference to it a user kept
    from before ``fabric.setup``): on the wrapper's own outputs Fabric already refuses ``loss.backward()``, stock too.
    """
    loop = FabricLoop(Cell("16-mixed", "SGD-momentum"), package=package, watch_misuse=True).train(range(1))
    x, y = make_batches(seed=DATA_SEED)[1]
    loop.opts[0].zero_grad()
    before = _weights(loop)
    if misuse == "unscaled-backward":
        with loop.fabric.autocast():
            loss = torch.nn.functional.mse_loss(loop.model.module(x), y)
        loss.backward()
    else:
        loop.fabric.backward(_loss(loop, 1))
    return loop, before


UNSCALED = "a backward without the loss scale accumulated"


@pytest.mark.parametrize("action", ["step", "clip"])
def test_loss_backward_instead_of_fabric_backward_raises(action):
    """``loss.backward()`` under 16-mixed leaves gradients the scaler did not scale, which its step would divide by
    the scale: the step (or clipping) raises, naming ``fabric.backward(loss)``, and changes nothing (stock steps)."""
    loop, before = _misused_loop("unscaled-backward")
    scale = loop.scaler.get_scale()
    with pytest.raises(RuntimeError, match=UNSCALED) as error:
        if action == "step":
            loop.opts[0].step()
        else:
            loop.fabric.clip_gradients(loop.model, loop.opts[0], max_norm=CLIP_NORM)
    assert "fabric.backward(loss)" in str(error.value)
    assert _unchanged(loop, before)
    assert loop.scaler.get_scale() == scale


def test_loss_backward_is_forgiven_once_the_gradients_are_cleared():
    """Gradients of an unscaled backward that ``zero_grad`` cleared are gone: the next iteration is the recipe's."""
    loop, _ = _misused_loop("unscaled-backward")
    loop.opts[0].zero_grad()
    loop.train(range(2, N_BATCHES))
    # the recipe over the same batches, without batch 1; its inf stays in batch 2 (position 1 there)
    batches = [b for i, b in enumerate(make_batches(seed=DATA_SEED)) if i != 1]
    expected = recipe_run(Cell("16-mixed", "SGD-momentum", inf_at=(1,)), data=batches)
    assert params_differ(loop.finish().params, expected.params) == {}


def test_raw_optimizer_step_on_scaled_gradients_raises():
    loop, before = _misused_loop("raw-step")
    with pytest.raises(RuntimeError, match="was called on the raw optimizer"):
        loop.opts[0].optimizer.step()
    assert _unchanged(loop, before)
    loop.opts[0].step()  # the wrapper's step is the recipe's
    assert not _unchanged(loop, before)


def test_teardown_removes_the_watch():
    """The strategy's teardown takes the opt-in watch's hooks off the parameters (they outlive the run otherwise)."""
    loop = FabricLoop(Cell("16-mixed", "SGD-momentum"), watch_misuse=True)
    recipe = loop.precision_plugin._recipe
    assert recipe.watched
    loop.fabric.strategy.teardown()
    assert recipe.watched == 0
    assert recipe.watch is None


def test_the_default_path_puts_no_hook_on_the_parameters():
    """Without ``watch_misuse`` nothing watches the parameters: no hook on any of them after setup and training."""
    loop = FabricLoop(Cell("16-mixed", "SGD-momentum")).train(range(3))
    assert loop.precision_plugin._recipe.watch is None
    for p in loop.model.parameters():
        assert not p._post_accumulate_grad_hooks and not p._backward_hooks


@pytest.mark.parametrize("action", ["step", "clip"])
def test_loss_backward_with_nothing_scaled_raises_by_default(action):
    """Without the watch, the free check: a step or clipping before the scaler scaled any loss raises and names
    ``fabric.backward(loss)`` first (stock: torch's bare assertion), changing nothing."""
    loop = FabricLoop(Cell("16-mixed", "SGD-momentum"))
    x, y = make_batches(seed=DATA_SEED)[0]
    before = _weights(loop)
    with loop.fabric.autocast():
        loss = torch.nn.functional.mse_loss(loop.model.module(x), y)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"^Call `fabric.backward\(loss\)` instead of `loss.backward\(\)`"):
        if action == "step":
            loop.opts[0].step()
        else:
            loop.fabric.clip_gradients(loop.model, loop.opts[0], max_norm=CLIP_NORM)
    assert _unchanged(loop, before)


def _gradient_stepped(loop: "FabricLoop", step: Callable[[], Any]) -> float:
    """The largest gradient entry that ``step`` applied: SGD's new momentum buffer minus the decayed old one."""
    opt = loop.opts[0].optimizer
    old = [opt.state[p]["momentum_buffer"].clone() for p in loop.model.parameters()]
    step()
    momentum = opt.param_groups[0]["momentum"]
    return max(
        (opt.state[p]["momentum_buffer"] - momentum * b).abs().max().item()
        for p, b in zip(loop.model.parameters(), old)
    )


@pytest.mark.parametrize("misuse", ["unscaled-backward", "raw-step"])
def test_stock_fabric_trains_silently_wrong_on_misuse(misuse):
    """Negative control: stock Fabric 2.6.6 takes both steps without a word, on gradients divided by the scale or
    multiplied by it."""
    stock, _ = _misused_loop(misuse, package="stock_lightning_fabric")
    wrong = _gradient_stepped(
        stock, stock.opts[0].step if misuse == "unscaled-backward" else stock.opts[0].optimizer.step
    )
    reference, _ = _misused_loop("raw-step")  # the same batch through fabric.backward and the wrapper's step
    scale = reference.scaler.get_scale()  # the scale of that batch (its update follows the step)
    right = _gradient_stepped(reference, reference.opts[0].step)
    expected = right / scale if misuse == "unscaled-backward" else right * scale
    assert wrong == pytest.approx(expected, rel=1e-2)  # fp16 rounding of the unscaled backward


@pytest.mark.parametrize("cell", UNSCALE_CELLS, ids=lambda c: c.id)
def test_unscaling_is_idempotent(cell):
    """Whoever unscales first (``clip_gradients``, the user's ``scaler.unscale_`` on the ``_FabricOptimizer`` or on
    the optimizer it wraps), gradients are unscaled exactly once before clipping and stepping."""
    _check(cell)


def test_user_unscale_through_the_wrapper_is_read_not_moved():
    """After ``scaler.unscale_(fabric_optimizer)`` torch keeps the state under the wrapper's id; Fabric's clipping and
    step read it there (no second unscale) and leave torch's state as torch wrote it."""
    loop = FabricLoop(Cell("16-mixed", "AdamW", fused=True, clip="norm", unscaler="user-wrapper"))
    loop.train(range(1))
    opt = loop.opts[0]
    opt.zero_grad()
    loop.fabric.backward(_loss(loop, 1))
    loop.scaler.unscale_(opt)
    params = [p for group in opt.param_groups for p in group["params"]]
    grads = [p.grad.clone() for p in params]
    loop.fabric.clip_gradients(loop.model, opt, max_norm=1e9)
    states = loop.scaler._per_optimizer_states
    assert states[id(opt)]["stage"] is OptState.UNSCALED
    assert id(opt.optimizer) not in states
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, params))  # not unscaled a second time


# --------------------------------------------------------------------------------------------------------------------
# 3. two optimizers fed by one backward: one update per iteration
# --------------------------------------------------------------------------------------------------------------------

TWO_OPTIMIZER_CELLS = [
    Cell(precision, optimizer, fused, clip, two_optimizers=True)
    for precision in PRECISIONS
    for optimizer in ("AdamW", "SGD-momentum")
    for fused in (False, True)
    for clip in ("none", "norm")
]


@pytest.mark.parametrize("cell", TWO_OPTIMIZER_CELLS, ids=lambda c: c.id)
def test_two_optimizers_one_update_per_iteration(cell):
    """``fabric.backward(loss); opt_a.step(); opt_b.step()`` equals the recipe's ``scaler.scale(loss).backward();
    scaler.step(a); scaler.step(b); scaler.update()``: both optimizers are unscaled with the scale that scaled their
    gradients, and the scale trajectory (``growth_interval=1``: it moves on every update) is the recipe's."""
    _check(cell)


def test_update_count_and_placement():
    """Exactly one ``scaler.update()`` per iteration with two optimizers fed by one backward: right after the step of
    the last of them, as in PyTorch's recipe. With only one of them stepped, the update waits for the next
    ``fabric.backward()`` (Fabric has no end-of-iteration hook), or for the strategy's teardown;
    ``precision.state_dict()`` holds it without applying it."""
    loop = FabricLoop(Cell("16-mixed", "SGD-momentum", two_optimizers=True))
    with mock.patch.object(loop.scaler, "update", wraps=loop.scaler.update) as update:
        for i in range(N_BATCHES):
            loop.train(range(i, i + 1))
            assert update.call_count == i + 1, "the update follows the last optimizer's step"
        run = loop.finish()
        assert update.call_count == N_BATCHES
        loop.fabric.backward(_loss(loop))
        loop.opts[0].step()  # the second optimizer does not step: the update waits
        assert update.call_count == N_BATCHES
        saved = loop.precision_plugin.state_dict()
        assert update.call_count == N_BATCHES, "saving changes nothing"
        loop.fabric.strategy.teardown()
        assert update.call_count == N_BATCHES + 1
        assert loop.scaler.state_dict() == saved
    assert_same_run(run, recipe_run(Cell("16-mixed", "SGD-momentum", two_optimizers=True)))


def test_interleaved_backward_and_step_update_before_the_next_backward():
    """Two optimizers, each zeroed, fed by its own backward of the whole network and stepped in turn: the update the
    first step owes comes before the second backward (nothing waits for it), exactly where torch's own loop must put
    it (``scaler.step(opt); scaler.update()`` per optimizer)."""
    mse = torch.nn.functional.mse_loss

    net = mlp(NET_SEED)
    opts = [make_optimizer("SGD-momentum", net[i].parameters(), fused=False) for i in (0, 2)]
    scaler = new_scaler()
    expected_scales = []
    for x, y in make_batches(seed=DATA_SEED):
        for opt in opts:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = mse(net(x), y)
            scaler.scale(loss).backward()
            expected_scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
    expected = {n: p.detach().clone() for n, p in net.named_parameters()}

    loop = FabricLoop(Cell("16-mixed", "SGD-momentum", two_optimizers=True))
    scales = []
    for x, y in make_batches(seed=DATA_SEED):
        for opt in loop.opts:
            opt.zero_grad()
            loop.fabric.backward(mse(loop.model(x), y))
            scales.append(loop.scaler.get_scale())
            opt.step()
    assert scales == expected_scales
    assert not params_differ({n: p.detach() for n, p in loop.model.module.named_parameters()}, expected)


# --------------------------------------------------------------------------------------------------------------------
# 4. the skip signal
# --------------------------------------------------------------------------------------------------------------------

SKIP_CELLS = [
    Cell("16-mixed", optimizer, fused, clip, inf_at=inf_at, two_optimizers=two)
    for optimizer, fused in [("AdamW", False), ("AdamW", True), ("Adam", True), ("SGD-momentum", False)]
    for clip, inf_at, two in [("none", (0, 3, 4), False), ("norm", (1, 5), False), ("value", (0, 3), True)]
] + [Cell("16-mixed", "SGD-momentum", True, "norm", inf_at=(2, 3, 5))]


@pytest.mark.parametrize("cell", SKIP_CELLS, ids=lambda c: c.id)
def test_step_was_skipped_exactly_on_inf_steps(cell):
    """``optimizer.step_was_skipped`` is True exactly after the steps whose gradients held inf (the first step and
    consecutive ones included), for every optimizer fed by the backward, fused or not; the run equals the recipe."""
    run = _check(cell)
    assert run.skipped == [tuple(i in cell.inf_batches for _ in row) for i, row in enumerate(run.skipped)]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
@pytest.mark.parametrize("fused", [False, True])
def test_step_was_skipped_is_false_without_scaler(precision, fused):
    run = _check(Cell(precision, "AdamW", fused, "norm", two_optimizers=True))
    assert all(flag is False for row in run.skipped for flag in row)


def test_step_was_skipped_before_the_first_step():
    loop = FabricLoop(Cell("16-mixed", "AdamW", fused=True))
    assert loop.opts[0].step_was_skipped is False


def test_fused_sgd_momentum_survives_a_skipped_first_step():
    """torch leaves fused SGD's momentum buffers uninitialised when the scaler skips its first step; Fabric's step goes
    through the same ``GradScalerRecipe`` as the Trainer's, which gives them zeros first. The reference is the recipe
    with the buffers zeroed by hand before the first step (exactly the first step of for-loop SGD, ``dampening=0``)."""
    cell = Cell("16-mixed", "SGD-momentum", fused=True, clip="norm", inf_at=(0, 3))
    run = fabric_run(cell)
    assert run.skipped == [(i in (0, 3),) for i in range(N_BATCHES)]

    original_step = torch.optim.SGD.step

    def step_with_zeroed_buffers(self, *args, **kwargs):
        for p in (p for group in self.param_groups for p in group["params"]):
            if p.grad is not None and "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        return original_step(self, *args, **kwargs)

    with mock.patch.object(torch.optim.SGD, "step", step_with_zeroed_buffers):
        recipe = recipe_run(cell)
    assert_cell_is_sharp(recipe, cell)
    assert_same_run(run, recipe, records=True)


# --------------------------------------------------------------------------------------------------------------------
# 5. the scaler saved and restored
# --------------------------------------------------------------------------------------------------------------------

#: the run is split after the inf batch, so the update pending at the save is the back-off
SPLIT = INF_BATCH + 1

RESUME_CELLS = [
    Cell("16-mixed", "AdamW", False, "norm"),
    Cell("16-mixed", "AdamW", True, "norm"),
    Cell("16-mixed", "SGD-momentum", True, "value"),
    Cell("16-mixed", "Adam", True, "none", two_optimizers=True),
    Cell("bf16-mixed", "AdamW", True, "norm"),
    Cell("32", "SGD-momentum", False, "value"),
]


def _resumed_run(cell: Cell, path, scaler_entry: str = "plugin", package: str = "lightning") -> Run:
    first = FabricLoop(cell, package).train(range(SPLIT))
    first.save(path, scaler_entry)
    # a fresh Fabric, a network with other weights and fresh optimizers: everything must come from the checkpoint
    second = FabricLoop(cell, package, seed=99).resumes(first)
    assert second.load(path, scaler_entry) == {}
    return second.train(range(SPLIT, N_BATCHES)).finish()


@pytest.mark.parametrize("cell", RESUME_CELLS, ids=lambda c: c.id)
def test_resume_is_exact(cell, tmp_path):
    """``fabric.save(path, {"model": model, "optimizer": opt, "precision": fabric.strategy.precision})`` and
    ``fabric.load`` into a fresh Fabric continue bitwise like the uninterrupted run: the plugin's ``state_dict`` holds
    the pending update, so the checkpoint holds the scale the next iteration uses."""
    recipe = recipe_run(cell)
    path = tmp_path / "fabric.ckpt"
    resumed = _resumed_run(cell, path)
    assert_same_run(resumed, recipe, records=cell.clip == "norm")
    assert_same_run(resumed, fabric_run(cell), records=True)  # the uninterrupted Fabric run
    if uses_scaler(cell.precision):
        assert torch.load(path, weights_only=True)["precision"]["scale"] == recipe.scales[SPLIT - 1]


def test_save_holds_the_scale_of_the_next_iteration_and_does_not_perturb_the_run(tmp_path):
    cell = Cell("16-mixed", "AdamW", True, "norm")
    recipe = recipe_run(cell)
    loop = FabricLoop(cell).train(range(SPLIT))
    # the back-off of the inf batch followed its step at once
    assert loop.scaler.get_scale() == recipe.scales[SPLIT - 1] == recipe.scales[SPLIT - 2] / 2
    loop.save(tmp_path / "fabric.ckpt")
    assert loop.scaler.get_scale() == recipe.scales[SPLIT - 1]
    assert torch.load(tmp_path / "fabric.ckpt", weights_only=True)["precision"]["scale"] == recipe.scales[SPLIT - 1]
    assert_same_run(loop.train(range(SPLIT, N_BATCHES)).finish(), recipe, records=True)


def test_resume_without_precision_in_state_is_exact(tmp_path):
    """The checkpoint guide's state, ``{"model": model, "optimizer": opt}``: ``fabric.save`` carries the scaler's state
    under ``"MixedPrecision"`` and ``fabric.load`` restores it, so the resumed run continues with the same scale."""
    cell = Cell("16-mixed", "AdamW", True, "norm")
    recipe = recipe_run(cell)
    run = _resumed_run(cell, tmp_path / "fabric.ckpt", scaler_entry="none")
    assert run.scales == recipe.scales
    assert not params_differ(run.params, recipe.params)
    assert "MixedPrecision" in torch.load(tmp_path / "fabric.ckpt", weights_only=False)


def test_stock_fabric_resume_without_precision_in_state_restarts_the_scale(tmp_path):
    """Negative control: stock Fabric 2.6.6 saves no scaler state; the resumed run restarts at the initial scale."""
    cell = Cell("16-mixed", "AdamW", False, "norm")  # unfused: stock cannot clip fused optimizers
    recipe = recipe_run(cell)
    run = _resumed_run(cell, tmp_path / "fabric.ckpt", scaler_entry="none", package="stock_lightning_fabric")
    assert run.scales[SPLIT - 1] == INIT_SCALE != recipe.scales[SPLIT - 1]  # the scale batch SPLIT trained with


def test_checkpoints_load_across_fork_and_stock(tmp_path):
    """Stock Fabric loads the fork's checkpoint (the scaler's entry comes back in the remainder), and the fork loads
    a stock one (no entry: the scaler keeps its state)."""
    cell = Cell("16-mixed", "AdamW", False, "norm")
    fork = FabricLoop(cell).train(range(SPLIT))
    fork.save(tmp_path / "fork.ckpt", scaler_entry="none")
    stock = FabricLoop(cell, package="stock_lightning_fabric")
    remainder = stock.load(tmp_path / "fork.ckpt", scaler_entry="none")
    assert remainder["MixedPrecision"]["scale"] == fork.precision_plugin.state_dict()["scale"]
    stock.save(tmp_path / "stock.ckpt", scaler_entry="none")
    again = FabricLoop(cell)
    assert again.load(tmp_path / "stock.ckpt", scaler_entry="none") == {}
    assert again.scaler.get_scale() == INIT_SCALE


@pytest.mark.parametrize("package", ["lightning", "stock_lightning_fabric"])
def test_resume_with_the_bare_scaler_in_state(package, tmp_path):
    """``{"scaler": scaler}`` instead of the plugin: with stock Fabric that resumes exactly, since it updates after
    every step. With the fork's lazy update it must too (a user may hold the ``GradScaler`` they passed in)."""
    cell = Cell("16-mixed", "AdamW", False, "norm")  # unfused: stock cannot clip fused optimizers
    run = _resumed_run(cell, tmp_path / "fabric.ckpt", scaler_entry="scaler", package=package)
    recipe = recipe_run(cell)
    assert run.scales == recipe.scales
    assert not params_differ(run.params, recipe.params)


# --------------------------------------------------------------------------------------------------------------------
# negative controls: stock Fabric 2.6.6 (``stock_lightning_fabric``) fails these comparisons
# --------------------------------------------------------------------------------------------------------------------


def test_stock_fabric_is_the_unpatched_copy():
    stock = fabric_api("stock_lightning_fabric").MixedPrecision("16-mixed", "cpu", scaler=cpu_grad_scaler())
    assert not hasattr(stock, "optimizer_step_was_skipped")
    assert not hasattr(stock, "_recipe")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_stock_fabric_cannot_clip_fused(optimizer, clip):
    cell = Cell("16-mixed", optimizer, fused=True, clip=clip)
    _check(cell)
    with pytest.raises(NotImplementedError, match="Gradient clipping is not implemented"):
        fabric_run(cell, "stock_lightning_fabric")


@pytest.mark.parametrize(
    ("cell", "error"),
    [
        (Cell("16-mixed", clip="norm", unscaler="clip-twice"), "unscale_\\(\\) has already been called"),
        (Cell("16-mixed", clip="value", unscaler="user-raw"), "unscale_\\(\\) has already been called"),
    ],
    ids=["clip-twice", "user-raw"],
)
def test_stock_fabric_raises_on_a_second_unscale(cell, error):
    _check(cell)
    with pytest.raises((RuntimeError, AssertionError), match=error):
        fabric_run(cell, "stock_lightning_fabric")


@pytest.mark.parametrize("package", ["lightning", "stock_lightning_fabric"])
def test_the_users_own_update_after_the_last_step_raises_as_in_stock(package):
    """The update follows the last optimizer's step at once (as in stock Fabric, which updates after every step), so
    a ``scaler.update()`` of the user's own after it finds no inf check, and torch's scaler raises."""
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        fabric_run(Cell("16-mixed", clip="norm", user_update=True), package)


def test_stock_fabric_unscales_twice_through_the_wrapper():
    """``scaler.unscale_(fabric_optimizer)`` then ``clip_gradients``: stock keys the first unscale by the wrapper and
    unscales the wrapped optimizer a second time, silently; the weights end up far from the recipe's."""
    cell = Cell("16-mixed", clip="norm", unscaler="user-wrapper")
    recipe = recipe_run(cell)
    assert_same_run(fabric_run(cell), recipe, records=True)
    stock = fabric_run(cell, "stock_lightning_fabric")
    assert max(params_differ(stock.params, recipe.params).values()) > 1e-3


def test_stock_fabric_updates_after_every_step():
    """Two optimizers from one backward: stock updates after each step, so the scale moves twice per iteration and the
    second optimizer is unscaled with a scale that did not scale its gradients."""
    cell = Cell("16-mixed", "SGD-momentum", two_optimizers=True)
    recipe = recipe_run(cell)
    assert_same_run(fabric_run(cell), recipe)
    stock = fabric_run(cell, "stock_lightning_fabric")
    assert stock.scales[:-1] != recipe.scales[:-1]
    assert stock.scales[-1] != recipe.scales[-1]  # the final scale
    assert max(params_differ(stock.params, recipe.params).values()) > 1e-3


def test_stock_fabric_has_no_skip_signal():
    stock = fabric_run(Cell("16-mixed", "AdamW"), "stock_lightning_fabric")
    assert all(flag is None for row in stock.skipped for flag in row)


def test_a_wrong_recipe_is_caught():
    """The comparison itself is sharp: a recipe that updates after every step (stock's schedule) differs from the
    fork's Fabric run in the scale trajectory and the weights."""
    cell = Cell("16-mixed", "SGD-momentum", two_optimizers=True)
    net = mlp(NET_SEED)
    opts = [make_optimizer("SGD-momentum", net[i].parameters(), fused=False) for i in (0, 2)]
    scaler = cpu_grad_scaler(init_scale=INIT_SCALE, growth_interval=1)
    for batch_idx, (x, y) in enumerate(make_batches(seed=DATA_SEED)):
        for opt in opts:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(net(x), y)
        scaler.scale(inject_inf(loss, batch_idx, cell.inf_batches)).backward()
        for opt in opts:
            scaler.step(opt)
            scaler.update()  # wrong: after every step
    run = fabric_run(cell)
    assert run.scales[-1] != scaler.get_scale()
    assert params_differ(run.params, {n: p.detach() for n, p in net.named_parameters()})


# --------------------------------------------------------------------------------------------------------------------
# exceptions, saves and lifecycle: transitions that change nothing they should not
# --------------------------------------------------------------------------------------------------------------------


def test_a_closure_passed_to_step_raises_as_torch_does():
    """``opt.step(closure)`` whose closure runs ``fabric.backward`` after ``zero_grad``: the gradients the closure makes
    are scaled and nobody unscales them. torch's scaler refuses closures, and so do stock Fabric and the fork; the
    weights stay as they were."""
    for package in ("lightning", "stock_lightning_fabric"):
        loop = FabricLoop(Cell("16-mixed", "SGD-momentum"), package)
        x, y = make_batches(seed=DATA_SEED)[0]
        opt = loop.opts[0]
        before = _weights(loop)

        def closure():
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(loop.model(x), y)
            loop.fabric.backward(loss)
            return loss

        with pytest.raises(RuntimeError, match="(?i)closure"):
            opt.step(closure)
        assert _unchanged(loop, before), package


def test_an_exception_caught_between_two_steps_loses_no_update():
    """An exception raised (and caught by the user) after the first optimizer's step: the update that step owes is
    applied before the next backward (the loop zeroes the gradients first, so nothing waits for it), the scale backs
    off on a later inf again, and training goes on exactly as the recipe's."""
    cell = Cell("16-mixed", "SGD-momentum", clip="norm", two_optimizers=True, inf_at=(3,))
    loop = FabricLoop(cell)

    def fail(i: int, k: int) -> None:
        if (i, k) == (1, 1):
            raise ValueError("the user's own error, after the first step")

    for i in range(N_BATCHES):
        try:
            loop.train(range(i, i + 1), before_step=fail)
        except ValueError:
            pass
    expected = recipe_run(cell, first_step_only_at=1)
    assert any(b < a for a, b in zip(expected.scales, expected.scales[1:]))  # the inf batch backed the scale off
    run = loop.finish()  # the batch that raised has no row of its own: its scales and parameters are compared
    assert run.scales == expected.scales
    assert params_differ(run.params, expected.params) == {}


@pytest.mark.parametrize("where", ["after-clip", "between-steps", "last-in-iteration"])
def test_a_save_changes_nothing_and_holds_what_the_run_continues_with(where, tmp_path):
    """``fabric.save`` after clipping and before the step, between two optimizers' steps, or as the last statement of
    an iteration: the live run is the recipe's, as without the save; a save at the end of an iteration holds the scale
    the next iteration uses."""
    cell = Cell("16-mixed", "SGD-momentum", clip="norm", two_optimizers=True)
    loop = FabricLoop(cell)
    path = tmp_path / "fabric.ckpt"
    saved = []

    def save() -> None:
        loop.save(path)
        saved.append(torch.load(path, weights_only=True)["precision"]["scale"])

    def before_step(i: int, k: int) -> None:
        if where == "after-clip" or (where == "between-steps" and k == 1):
            save()

    for i in range(N_BATCHES):
        loop.train(range(i, i + 1), before_step=before_step)
        if where == "last-in-iteration":
            save()
    expected = recipe_run(cell)
    assert_same_run(loop.finish(), expected)
    if where == "last-in-iteration":
        assert saved == expected.scales


def test_the_watch_of_a_collected_model_goes_with_it():
    """A fresh model per fold (cross-validation) with one Fabric: the hooks of the watch go away with the parameters
    and optimizers they watch, instead of piling up fold after fold."""
    fabric = FabricLoop(Cell("16-mixed", "SGD-momentum"), watch_misuse=True).fabric
    recipe = fabric.strategy.precision._recipe
    counts = []
    for _ in range(5):
        net = mlp(NET_SEED)
        model, opt = fabric.setup(net, make_optimizer("SGD-momentum", net.parameters(), fused=False))
        x, y = make_batches(seed=DATA_SEED)[0]
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        del net, model, opt
        gc.collect()
        counts.append(recipe.watched)
    assert counts == [counts[0]] * 5
    assert counts[0] <= 1 + len(list(mlp(NET_SEED).parameters()))  # the first loop's model, still alive


def test_the_scale_after_the_step_says_whether_it_was_skipped():
    """``scale = scaler.get_scale(); opt.step(); skipped = scaler.get_scale() < scale``: once every optimizer
    ``fabric.setup`` wrapped has stepped, the update follows at once, as in PyTorch's recipe."""
    loop = FabricLoop(Cell("16-mixed", "SGD-momentum"))
    (opt,) = loop.opts
    skipped = []
    for i, (x, y) in enumerate(make_batches(seed=DATA_SEED)):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(loop.model(x), y)
        loop.fabric.backward(inject_inf(loss, i, loop.cell.inf_batches))
        scale = loop.scaler.get_scale()
        opt.step()
        skipped.append(loop.scaler.get_scale() < scale)
    assert skipped == [i == INF_BATCH for i in range(N_BATCHES)]


def test_a_bare_scaler_in_the_saved_state_holds_the_owed_update(tmp_path):
    """``fabric.save(path, {..., "scaler": scaler})`` while an update is owed (the second optimizer did not step, so it
    waits for the next backward): the saved scaler holds the update, and the live scaler is left alone."""
    cell = Cell("16-mixed", "SGD-momentum", two_optimizers=True, inf_at=(0,))
    loop = FabricLoop(cell)
    loop.fabric.backward(inject_inf(_loss(loop), 0, cell.inf_batches))
    loop.opts[0].step()
    live = loop.scaler.state_dict()
    loop.save(tmp_path / "fabric.ckpt", scaler_entry="scaler")
    saved = torch.load(tmp_path / "fabric.ckpt", weights_only=True)["scaler"]
    assert saved["scale"] == live["scale"] / 2  # the owed back-off
    assert saved == loop.precision_plugin.state_dict()
    assert loop.scaler.state_dict() == live
