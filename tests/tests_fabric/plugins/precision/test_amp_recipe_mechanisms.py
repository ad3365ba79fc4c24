"""Mechanisms of ``GradScalerRecipe`` that no loop of the other tests tells apart, each against PyTorch's recipe written
by hand with torch's ``GradScaler``: weights bitwise, and the scaler's state (``growth_interval=1``, so an update too
many or too few shows in the scale). ``tests/mutation_check.py`` takes each mechanism out and needs a test here to fail.
"""

import contextlib
import copy

import torch
from amp_oracle.torch_features import GradScaler, cpu_grad_scaler, requires_cpu_grad_scaler
from torch import nn

from lightning.fabric.plugins.precision.amp_misuse_watch import _WatchedRecipe
from lightning.fabric.plugins.precision.amp_recipe import GradScalerRecipe

pytestmark = requires_cpu_grad_scaler

X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 2)


def _scaler() -> GradScaler:
    return cpu_grad_scaler(init_scale=2.0**10, growth_interval=1)


def _twins(n: int) -> tuple[list[nn.Module], list[torch.optim.SGD], list[nn.Module], list[torch.optim.SGD]]:
    torch.manual_seed(0)
    nets = [nn.Linear(4, 2) for _ in range(n)]
    twins = copy.deepcopy(nets)
    opts, twin_opts = ([torch.optim.SGD(m.parameters(), lr=0.1) for m in ms] for ms in (nets, twins))
    return nets, opts, twins, twin_opts


def _loss(net: nn.Module) -> torch.Tensor:
    return nn.functional.mse_loss(net(X), Y)


def _backward(recipe: GradScalerRecipe, loss: torch.Tensor) -> None:
    """The plugins' backward: scale, backward (inside the watch's scaled backward when it is on), after_backward."""
    scaled = recipe.scale(loss)
    with recipe.watch.scaled_backward() if recipe.watch is not None else contextlib.nullcontext():
        scaled.backward()
    if recipe.reach_marks:
        recipe.after_backward()


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_plain_step_before_a_backward_after_a_clip_is_not_counted_for_the_update():
    """B clipped (its gradients wait for its step), A steps without gradients (a plain step, owing nothing), a backward
    reaches A only, then B steps before A: the backward started a new cycle, so A's plain step does not count as a step
    of it, and the one update follows A's scaler step, as in torch's loop (``unscale_(B)``, ``A.step()``, backward,
    ``step(B)``, ``step(A)``, ``update()``). Counting A's plain step would update between B's and A's steps, and A's
    gradients, stepped in the cycle by that count, would be left out of the carry."""
    (a, b), (opt_a, opt_b), (twin_a, twin_b), (twin_opt_a, twin_opt_b) = _twins(2)
    recipe = GradScalerRecipe(_scaler())
    recipe.track(opt_a)
    recipe.track(opt_b)
    _backward(recipe, _loss(b))
    recipe.unscale(opt_b)
    recipe.step(opt_a)  # no gradients
    _backward(recipe, _loss(a))
    recipe.step(opt_b)
    recipe.step(opt_a)
    recipe.settle()  # the iteration's end

    scaler = _scaler()
    scaler.scale(_loss(twin_b)).backward()
    scaler.unscale_(twin_opt_b)
    twin_opt_a.step()
    scaler.scale(_loss(twin_a)).backward()
    scaler.step(twin_opt_b)
    scaler.step(twin_opt_a)
    scaler.update()

    assert _same(a, twin_a)
    assert _same(b, twin_b)
    assert recipe.updates == 1
    assert recipe.scaler.state_dict() == scaler.state_dict()


def test_with_the_watch_on_the_recipes_second_step_on_the_same_gradients_is_not_a_raw_step():
    """``bw; step; step``: the second step takes the true gradients as they are (the recipe's own ``optimizer.step()``,
    torch's stage back to ``READY`` after the update). The watch, which refuses a raw step on gradients still multiplied
    by the scale, knows it for the recipe's own step and lets it run."""
    (net,), (opt,), (twin,), (twin_opt,) = _twins(1)
    recipe = _WatchedRecipe(_scaler())
    recipe.track(opt)
    recipe.watch_unscaled_backward([opt])
    _backward(recipe, _loss(net))
    recipe.step(opt)
    recipe.step(opt)  # again, no backward since
    recipe.end_fit()

    scaler = _scaler()
    scaler.scale(_loss(twin)).backward()
    scaler.step(twin_opt)
    scaler.update()
    twin_opt.step()

    assert _same(net, twin)
    assert recipe.scaler.state_dict() == scaler.state_dict()


class _Wrapper:
    """An optimizer wrapper (Fabric's, the Trainer's ``LightningOptimizer``) as torch's ``unscale_`` sees it: the
    wrapped optimizer's param groups, under the wrapper's own ``id()``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups


def test_the_carry_leaves_the_gradients_of_an_optimizer_that_stepped_alone():
    """The user unscales through the wrapper (torch keeps the stage ``UNSCALED`` under the wrapper's id), the recipe
    steps the optimizer, and the update follows (rule (a)): the optimizer stepped in the cycle, so its gradients, true
    ones, are not carried into the new scale; they stay as torch's ``step`` and ``update`` leave them."""
    (net,), (opt,), (twin,), (twin_opt,) = _twins(1)
    recipe = GradScalerRecipe(_scaler())
    wrapper = _Wrapper(opt)
    recipe.track(opt, wrapper)
    _backward(recipe, _loss(net))
    recipe.scaler.unscale_(wrapper)
    recipe.step(opt)

    scaler = _scaler()
    scaler.scale(_loss(twin)).backward()
    scaler.unscale_(twin_opt)
    scaler.step(twin_opt)
    scaler.update()

    assert recipe.updates == 1
    assert _same(net, twin)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), twin.parameters()))
    assert recipe.scaler.state_dict() == scaler.state_dict()
