"""The transitions of ``GradScalerRecipe``, the one state machine that both packages' plugins drive.

Each test takes one transition (or one illegal one) on a twin of PyTorch's recipe: the same tiny model, the same data,
power-of-two scales, ``growth_interval=1``, injected infs, and compares parameters and scales bitwise.
"""

import copy
import gc
import json
import os
import random
import socket
import subprocess
import _thread
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from lightning.fabric.plugins.precision.amp_misuse_watch import WATCHED_UPDATES
from lightning.fabric.plugins.precision.amp_recipe import (
    GradScalerRecipe,
    IterationPhase,
    _check_scaler_is_enabled,
)
from tests_fabric.helpers.torch_features import (
    GradScaler,
    OptState,
    cpu_grad_scaler,
    cuda_grad_scaler,
    requires_cpu_fused,
    requires_cpu_grad_scaler,
)

pytestmark = requires_cpu_grad_scaler


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    """Upstream's ``conftest.py`` fails a test that leaves a thread behind ("Test left zombie thread"): a test joins
    what it starts, and the watch must not register the autograd engine's threads with ``threading``."""
    before = set(threading.enumerate())
    yield
    assert set(threading.enumerate()) <= before

X, Y = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)), torch.randn(8, 2)


def _scaler() -> GradScaler:
    return cpu_grad_scaler(init_scale=2.0**10, growth_interval=1)


def _twins() -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    twin = copy.deepcopy(net)
    return net, torch.optim.SGD(net.parameters(), lr=0.1), twin, torch.optim.SGD(twin.parameters(), lr=0.1)


def _loss(net: nn.Module, inf: bool = False) -> torch.Tensor:
    loss = nn.functional.mse_loss(net(X), Y)
    return loss * float("inf") if inf else loss


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_one_iteration_equals_the_recipe():
    net, opt, twin, twin_opt = _twins()
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    for inf in (False, True, False):
        recipe.iteration_start()
        assert recipe.phase is IterationPhase.INSIDE
        with recipe.backward():
            recipe.scale(_loss(net, inf)).backward()
        recipe.unscale(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
        recipe.step(opt)
        assert recipe.step_was_skipped(opt) is inf
        recipe.iteration_end()
        opt.zero_grad()

        scaler.scale(_loss(twin, inf)).backward()
        scaler.unscale_(twin_opt)
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
        scaler.step(twin_opt)
        scaler.update()
        twin_opt.zero_grad()
        assert recipe.scaler.get_scale() == scaler.get_scale()
    assert _same(net, twin)
    assert int(recipe.skipped_steps) == 1


def test_unscale_is_idempotent_and_reads_the_users_own_unscale():
    net, opt, twin, twin_opt = _twins()
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    recipe.scale(_loss(net)).backward()
    recipe.scaler.unscale_(opt)  # the user, following torch's recipe
    recipe.unscale(opt)  # clipping: not a second unscale
    recipe.step(opt)
    recipe.iteration_end()
    scaler.scale(_loss(twin)).backward()
    scaler.unscale_(twin_opt)
    scaler.step(twin_opt)
    scaler.update()
    assert _same(net, twin)


def test_a_scaled_backward_onto_unscaled_gradients_is_refused_at_the_step():
    """Unscaled, not stepped, and a scaled backward reaches the parameters: the gradients mix two scales. The step
    (and clipping) refuse them and change nothing; zeroed, the optimizer goes on."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    with recipe.backward():
        recipe.scale(_loss(net)).backward()
    recipe.unscale(opt)
    with recipe.backward():
        recipe.scale(_loss(net), optimizers=lambda: [opt]).backward()
    before = copy.deepcopy(net)
    for event in (lambda: recipe.unscale(opt), lambda: recipe.step(opt)):
        with pytest.raises(RuntimeError, match="unscaled .* but the optimizer did not step before a later backward"):
            event()
    assert _same(net, before)
    opt.zero_grad()
    with recipe.backward():
        recipe.scale(_loss(net), optimizers=lambda: [opt]).backward()
    recipe.step(opt)
    assert not _same(net, before)


def test_unscaled_gradients_that_the_next_backward_does_not_reach_step_normally():
    """Two networks, each clipped right after its own backward, then both step: torch only needs an optimizer's
    gradients complete before its ``unscale_``, and so does the recipe."""
    torch.manual_seed(0)
    nets = [nn.Linear(4, 2), nn.Linear(4, 2)]
    twins = copy.deepcopy(nets)
    opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in nets]
    twin_opts = [torch.optim.SGD(n.parameters(), lr=0.1) for n in twins]
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    for inf in (False, True, False):
        recipe.iteration_start()
        for net, opt in zip(nets, opts):
            with recipe.backward():
                recipe.scale(_loss(net, inf and net is nets[1]), optimizers=lambda: opts).backward()
            recipe.unscale(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
        for opt in opts:
            recipe.step(opt)
            opt.zero_grad()
        recipe.iteration_end()
        for net, opt in zip(twins, twin_opts):
            scaler.scale(_loss(net, inf and net is twins[1])).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
        for opt in twin_opts:
            scaler.step(opt)
            opt.zero_grad()
        scaler.update()
        assert recipe.scaler.get_scale() == scaler.get_scale()
    assert all(_same(a, b) for a, b in zip(nets, twins))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_unscaled_then_cleared_is_not_live(set_to_none):
    """``zero_grad(set_to_none=False)`` leaves zeros: not live gradients, so no false error."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.scale(_loss(net)).backward()
    recipe.unscale(opt)
    opt.zero_grad(set_to_none=set_to_none)
    recipe.scale(_loss(net), optimizers=lambda: [opt]).backward()
    assert recipe.stage(opt) is OptState.READY


def test_an_inf_check_without_a_step_still_backs_the_scale_off():
    """A guard that clips, sees non-finite gradients and does not step: the recipe's update still runs."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.iteration_start()
    recipe.scale(_loss(net, inf=True)).backward()
    recipe.unscale(opt)
    opt.zero_grad()
    recipe.iteration_end()
    assert recipe.scaler.get_scale() == 2.0**9


def test_a_collected_optimizer_leaves_no_state_under_its_id():
    """torch keys its per-optimizer state by ``id()``, which CPython hands to the next object of the same size: an
    inner-loop optimizer created per step would inherit the stage of the one before (stepped, or unscaled) and have its
    step refused or its gradients stepped still scaled. A collected optimizer's state is set aside at once, and its
    inf check still backs the scale off at the update."""
    net, _, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.iteration_start()
    with recipe.backward():
        recipe.scale(_loss(net, inf=True)).backward()
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    recipe.step(inner)
    dead_id = id(inner)
    assert dead_id in recipe.scaler._per_optimizer_states
    del inner
    gc.collect()
    assert dead_id not in recipe.scaler._per_optimizer_states
    recipe.iteration_end()
    assert recipe.scaler.get_scale() == 2.0**9


def test_no_update_without_an_inf_check():
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.iteration_start()
    recipe.scale(_loss(net)).backward()  # accumulation: no unscale, no step
    recipe.iteration_end()
    assert recipe.scaler.get_scale() == 2.0**10
    assert recipe.updates == 0


def test_state_dict_inside_an_iteration_leaves_the_live_run_alone():
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.iteration_start()
    recipe.scale(_loss(net, inf=True)).backward()
    recipe.step(opt)
    assert recipe.state_dict()["scale"] == 2.0**10  # the iteration's own scale
    assert recipe.updates == 0
    recipe.iteration_end()
    assert recipe.scaler.get_scale() == 2.0**9


def test_state_dict_outside_an_iteration_holds_the_owed_update_and_changes_nothing():
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.scale(_loss(net, inf=True)).backward()
    recipe.step(opt)  # outside any iteration: Fabric, or a step in `on_train_epoch_end`
    states = copy.deepcopy(recipe.scaler._per_optimizer_states)
    assert recipe.state_dict()["scale"] == 2.0**9
    assert recipe.scaler.get_scale() == 2.0**10  # the live run: untouched
    assert recipe.scaler._per_optimizer_states == states
    assert recipe.updates == 0
    recipe.iteration_start()
    assert recipe.scaler.state_dict() == recipe.state_dict()


@pytest.mark.parametrize("inf", [False, True])
def test_the_owed_update_in_a_state_dict_is_torchs_update(inf):
    """The state a save holds is what ``scaler.update()`` leaves, computed by torch's own kernel (growth, back-off and
    the growth tracker), and asking for it leaves the live run alone (a save between clipping and the step)."""
    net, opt, twin, twin_opt = _twins()
    # growth_interval=2: the growth tracker counts too
    recipe = GradScalerRecipe(cpu_grad_scaler(init_scale=2.0**10, growth_interval=2))
    scaler = cpu_grad_scaler(init_scale=2.0**10, growth_interval=2)
    for i in range(3):
        with recipe.backward():
            recipe.scale(_loss(net, inf and i == 1)).backward()
        recipe.unscale(opt)
        projected = recipe.state_dict(include_owed_update=True)
        recipe.step(opt)
        recipe.iteration_end()
        opt.zero_grad()
        scaler.scale(_loss(twin, inf and i == 1)).backward()
        scaler.step(twin_opt)
        scaler.update()
        twin_opt.zero_grad()
        assert projected == scaler.state_dict() == recipe.scaler.state_dict()
    assert _same(net, twin)


def test_finish_applies_the_update_owed_outside_an_iteration():
    """A step in ``on_train_epoch_end`` is the last of the run: its update is applied when training ends, as the recipe
    applies it right after the step."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.scale(_loss(net, inf=True)).backward()
    recipe.step(opt)
    recipe.finish()
    assert recipe.scaler.get_scale() == 2.0**9
    assert recipe.updates == 1


def test_a_closure_under_the_scaler_raises_as_torch_does():
    """torch's scaler refuses closures; a closure that runs the backward after ``zero_grad`` would otherwise leave
    scaled gradients for a plain step."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    before = copy.deepcopy(net)

    def closure():
        opt.zero_grad()
        with recipe.backward():
            recipe.scale(_loss(net)).backward()

    with pytest.raises(RuntimeError, match="does not support closures"):
        recipe.step(opt, closure=closure)
    assert _same(net, before)


def test_every_step_goes_through_the_scalers_unscale():
    """FSDP's ``ShardedGradScaler.unscale_`` all-reduces the inf check: a rank whose shard got no gradients must call it
    too, in the same order, or the all-reduces of two ranks pair across iterations."""
    net, opt, _, _ = _twins()
    scaler = _scaler()
    unscaled = []
    unscale_ = scaler.unscale_
    scaler.unscale_ = lambda optimizer: (unscaled.append(optimizer), unscale_(optimizer))[1]
    recipe = GradScalerRecipe(scaler)
    before = copy.deepcopy(net)
    recipe.scale(torch.ones(()))  # the other ranks' backward
    recipe.step(opt)  # no gradients here
    assert unscaled == [opt]
    assert not recipe.step_was_skipped(opt)
    assert _same(net, before)


def test_a_step_on_an_inf_check_recorded_by_clipping_is_skipped():
    """Clipped (unscaled, inf found), then ``zero_grad()``, then stepped: torch counts the step as skipped, and so does
    the skip signal."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    with recipe.backward():
        recipe.scale(_loss(net, inf=True)).backward()
    recipe.unscale(opt)
    opt.zero_grad()
    recipe.step(opt)
    assert recipe.step_was_skipped(opt)
    recipe.iteration_end()
    assert recipe.scaler.get_scale() == 2.0**9


def test_gradients_unscaled_in_an_earlier_iteration_and_zeroed_step_as_torch_steps():
    """Clipped in one iteration and not stepped, zeroed with ``zero_grad(set_to_none=False)`` in the next, then stepped:
    nothing unscaled remains, so the step is taken (torch takes it), on the zeros."""
    net, opt, twin, twin_opt = _twins()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    recipe.iteration_start()
    recipe.scale(_loss(net)).backward()
    recipe.unscale(opt)
    recipe.iteration_end()
    opt.zero_grad(set_to_none=False)
    recipe.step(opt)
    recipe.iteration_end()
    scaler.scale(_loss(twin)).backward()
    scaler.unscale_(twin_opt)
    scaler.update()
    twin_opt.zero_grad(set_to_none=False)
    scaler.step(twin_opt)
    scaler.update()
    assert recipe.scaler.get_scale() == scaler.get_scale()
    assert opt.state_dict()["state"].keys() == twin_opt.state_dict()["state"].keys()
    assert _same(net, twin)


def test_a_step_outside_an_iteration_is_settled_when_the_next_one_starts():
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.iteration_start()
    recipe.scale(_loss(net, inf=True)).backward()
    recipe.iteration_end()
    recipe.step(opt)  # e.g. `on_train_epoch_end`
    recipe.iteration_start()
    assert recipe.scaler.get_scale() == 2.0**9  # before the next loss is scaled


def test_a_step_without_gradients_is_a_plain_step():
    """torch's scaler fails with a bare "No inf checks were recorded"; there is nothing to step on, nothing to skip."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    before = copy.deepcopy(net)
    recipe.step(opt)
    assert not recipe.step_was_skipped(opt)
    recipe.iteration_end()
    assert _same(net, before)
    scaler = _scaler()
    scaler.scale(torch.ones(()))
    with pytest.raises(AssertionError, match="No inf checks"):
        scaler.step(opt)


def test_watch_holds_what_it_watches_weakly():
    """The watch knows its optimizers and parameters by identity, weakly: once collected they leave it, so a new
    optimizer or parameter that CPython gives the same ``id()`` (an inner-loop optimizer created per step) is watched
    too, not taken for one already watched."""
    recipe = GradScalerRecipe(_scaler())
    net, opt, _, _ = _twins()
    recipe.watch_unscaled_backward([opt])
    assert recipe.watched == 3  # the optimizer, the weight and the bias
    del net, opt
    gc.collect()
    assert recipe.watched == 0
    net, opt, _, _ = _twins()
    recipe.watch_unscaled_backward([opt])
    _loss(net).backward()
    with pytest.raises(RuntimeError, match="a backward without the loss scale accumulated"):
        recipe.step(opt)


def test_watch_flags_a_plain_backward_at_the_step():
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.watch_unscaled_backward([opt])
    before = copy.deepcopy(net)
    _loss(net).backward()
    with pytest.raises(RuntimeError, match="without the loss scale"):
        recipe.step(opt)
    assert _same(net, before)
    recipe.unwatch()


class _PausedScaledBackward:
    """A scaled backward of ``recipe`` onto ``net``, in a thread of its own, paused mid-flight until :meth:`finish`.
    ``engine_thread``: a thread Python's ``threading`` did not start, as the autograd engine's own threads are (CUDA's
    device threads, which run the node of a CUDA loss)."""

    def __init__(self, recipe: GradScalerRecipe, net: nn.Module, engine_thread: bool = False) -> None:
        self.errors: list = []
        self.in_flight, self._go_on, self._done = threading.Event(), threading.Event(), threading.Event()
        self._recipe, self._net = recipe, net
        self._thread: Optional[threading.Thread] = None
        if engine_thread:
            _thread.start_new_thread(self._run, ())
        else:
            self._thread = threading.Thread(target=self._run)
            self._thread.start()
        assert self.in_flight.wait(30)

    def _pause(self, grad: torch.Tensor) -> torch.Tensor:
        self.in_flight.set()
        if not self._go_on.wait(30):
            self.errors.append("not resumed")
        return grad

    def _run(self) -> None:
        try:
            with self._recipe.backward():
                loss = self._recipe.scale(_loss(self._net))
                loss.register_hook(self._pause)
                loss.backward()
        except Exception as error:  # surfaced in the test's thread
            self.errors.append(error)
        finally:
            self.in_flight.set()
            self._done.set()

    def finish(self) -> None:
        self._go_on.set()
        assert self._done.wait(30)
        if self._thread is not None:
            self._thread.join(30)
        assert not self.errors


def _in_a_thread(fn, engine_thread: bool = False) -> None:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    if engine_thread:
        _thread.start_new_thread(run, ())
        assert done.wait(30)
    else:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(30)
        assert done.is_set()


def test_watch_belongs_to_its_run_a_scaled_backward_in_another_thread_hides_nothing():
    """Two runs (two plugins, e.g. two Trainers in two threads of a hyper-parameter search): while the scaled backward
    of one is in flight in its thread, a backward without the scale onto the other's parameters, in another thread, is
    still seen. The count of scaled backwards in flight belongs to a run, not to the process."""
    net_a, opt_a, twin_a, twin_opt_a = _twins()
    net_b, opt_b, _, _ = _twins()
    recipe_a, recipe_b, scaler = GradScalerRecipe(_scaler()), GradScalerRecipe(_scaler()), _scaler()
    recipe_a.watch_unscaled_backward([opt_a])
    recipe_b.watch_unscaled_backward([opt_b])
    paused = _PausedScaledBackward(recipe_a, net_a)
    _loss(net_b).backward()  # this thread, during A's scaled backward: B's misuse
    paused.finish()
    with pytest.raises(RuntimeError, match="without the loss scale"):
        recipe_b.step(opt_b)
    recipe_a.step(opt_a)  # A's gradients carry the scale: A trains as torch's recipe
    scaler.scale(_loss(twin_a)).backward()
    scaler.step(twin_opt_a)
    assert _same(net_a, twin_a)
    recipe_a.unwatch()
    recipe_b.unwatch()


def test_watch_sees_a_backward_without_the_scale_in_another_thread_of_the_same_run():
    """One run, two threads: while a scaled backward is in flight in one, a backward without the scale in the other is
    still seen (the watch counts scaled backwards by the thread that runs them), and the scaled one trains as torch's
    recipe."""
    net_a, opt_a, twin_a, twin_opt_a = _twins()
    net_b, opt_b, _, _ = _twins()
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    recipe.watch_unscaled_backward([opt_a, opt_b])
    paused = _PausedScaledBackward(recipe, net_a)
    _loss(net_b).backward()  # this thread, during the scaled backward in the other
    paused.finish()
    with pytest.raises(RuntimeError, match="without the loss scale"):
        recipe.step(opt_b)
    recipe.step(opt_a)
    scaler.scale(_loss(twin_a)).backward()
    scaler.step(twin_opt_a)
    assert _same(net_a, twin_a)
    recipe.unwatch()


@pytest.mark.parametrize("scaled_on_engine_thread", [True, False], ids=["scaled-on-engine", "plain-on-engine"])
def test_watch_goes_by_the_runs_count_on_the_engines_threads(scaled_on_engine_thread):
    """The autograd engine's own threads (CUDA's device threads) run the nodes of every thread's backward, and the CPU
    parameters of a CUDA loss's backward run their hooks on the caller's thread, while its loss's node ran on a device
    thread. So a hook on an engine thread, or any hook while a scaled backward runs on one, counts as scaled while the
    run has a scaled backward in flight: never a false error (a concurrent misuse there goes unseen, as documented).
    Emulated with threads that Python's ``threading`` did not start."""
    net_a, opt_a, _, _ = _twins()
    net_b, opt_b, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.watch_unscaled_backward([opt_a, opt_b])
    paused = _PausedScaledBackward(recipe, net_a, engine_thread=scaled_on_engine_thread)
    _in_a_thread(lambda: _loss(net_b).backward(), engine_thread=not scaled_on_engine_thread)
    paused.finish()
    recipe.step(opt_a)
    recipe.step(opt_b)  # not refused
    recipe.unwatch()


@pytest.mark.parametrize("engine_thread", [False, True], ids=["python-thread", "engine-thread"])
def test_watch_refuses_a_backward_without_the_scale_in_any_thread_when_none_is_scaled(engine_thread):
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.watch_unscaled_backward([opt])
    _in_a_thread(lambda: _loss(net).backward(), engine_thread=engine_thread)
    with pytest.raises(RuntimeError, match="without the loss scale"):
        recipe.step(opt)
    recipe.unwatch()


def test_watch_takes_a_reentrant_checkpoint_for_the_scaled_backward_it_is_part_of():
    """``checkpoint(..., use_reentrant=True)`` backpropagates its segment in a nested backward (a graph task of its
    own) on the outer one's thread: its accumulations carry the scale, bitwise as torch's recipe."""
    from torch.utils.checkpoint import checkpoint

    def loss_of(net: nn.Module) -> torch.Tensor:
        hidden = net[0](torch.ones(2, 4))  # requires grad: the checkpointed segment's input
        return checkpoint(lambda h: net[1:](h), hidden, use_reentrant=True).float().pow(2).mean()

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    twin = copy.deepcopy(net)
    opt, twin_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    recipe.watch_unscaled_backward([opt])
    for _ in range(3):
        with recipe.backward():
            recipe.scale(loss_of(net)).backward()
        recipe.step(opt)
        recipe.iteration_end()
        opt.zero_grad()
        scaler.scale(loss_of(twin)).backward()
        scaler.step(twin_opt)
        scaler.update()
        twin_opt.zero_grad()
    assert _same(net, twin)
    assert recipe.scaler.get_scale() == scaler.get_scale()
    recipe.unwatch()


def test_watch_flags_a_plain_backward_before_a_scaled_one():
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.watch_unscaled_backward([opt])
    _loss(net).backward()
    with pytest.raises(RuntimeError, match="without the loss scale"), recipe.backward():
        recipe.scale(_loss(net)).backward()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_watch_forgets_a_plain_backward_whose_gradients_were_cleared(set_to_none):
    net, opt, twin, twin_opt = _twins()
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    recipe.watch_unscaled_backward([opt])
    _loss(net).backward()  # e.g. to log gradient norms in fp32
    opt.zero_grad(set_to_none=set_to_none)
    with recipe.backward():
        recipe.scale(_loss(net)).backward()
    recipe.step(opt)
    scaler.scale(_loss(twin)).backward()
    scaler.step(twin_opt)
    assert _same(net, twin)


def test_watch_does_not_flag_assigned_gradients():
    """Gradient surgery: ``autograd.grad`` of the scaled loss, assigned to ``.grad``; not an accumulation."""
    net, opt, twin, twin_opt = _twins()
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    recipe.watch_unscaled_backward([opt])
    grads = torch.autograd.grad(recipe.scaler.scale(_loss(net)), list(net.parameters()))
    for p, g in zip(net.parameters(), grads):
        p.grad = g
    recipe.step(opt)
    scaler.scale(_loss(twin)).backward()
    scaler.step(twin_opt)
    assert _same(net, twin)


def test_watch_refuses_a_raw_step_on_scaled_gradients_and_allows_the_users_scaler_step():
    net, opt, twin, twin_opt = _twins()
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    recipe.watch_unscaled_backward([opt])
    with recipe.backward():
        recipe.scale(_loss(net)).backward()
    before = copy.deepcopy(net)
    with pytest.raises(RuntimeError, match="raw optimizer"):
        opt.step()
    assert _same(net, before)
    recipe.scaler.step(opt)  # the user drives the scaler: allowed
    scaler.scale(_loss(twin)).backward()
    scaler.step(twin_opt)
    assert _same(net, twin)
    recipe.unwatch()
    assert not opt._optimizer_step_pre_hooks


def test_disabled_scaler_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"enabled=False.*bf16-mixed"):
        _check_scaler_is_enabled(cpu_grad_scaler(enabled=False), "`MixedPrecision`")
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            cuda_scaler = cuda_grad_scaler()
        with pytest.raises(ValueError, match=r"CUDA is not available.*GradScaler\('cpu'\)"):
            _check_scaler_is_enabled(cuda_scaler, "`MixedPrecision`")
    _check_scaler_is_enabled(_scaler(), "`MixedPrecision`")
    _check_scaler_is_enabled(None, "`MixedPrecision`")


def test_a_refused_backward_changes_nothing():
    """A scaled backward refused (a plain ``loss.backward()`` left gradients without the scale) is refused before any
    transition: the optimizer that had stepped is still stepped, so a later unscale does not divide its gradients by
    the scale a second time."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.watch_unscaled_backward([opt])
    recipe.iteration_start()
    loss = recipe.scale(_loss(net))
    with recipe.backward():
        loss.backward()
    recipe.step(opt)
    _loss(net).backward()  # the misuse: a backward without the scale
    grads = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(RuntimeError, match="without the loss scale"):
        recipe.scale(_loss(net), optimizers=lambda: [opt])
    assert recipe.stage(opt) is OptState.STEPPED
    assert recipe.scaler._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), grads))


def test_the_watch_ends_after_its_first_updates():
    """The watch for backwards without the scale looks at the first iterations only: then its hooks are gone and it
    costs nothing per step; arming it again (the next fit, the next ``fabric.setup``) opens a new window."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    recipe.watch_unscaled_backward([opt])
    watched = recipe.watched
    assert watched == 1 + len(list(net.parameters()))
    for i in range(WATCHED_UPDATES):
        assert recipe.watched == watched, i
        recipe.iteration_start()
        loss = recipe.scale(_loss(net))
        with recipe.backward():
            loss.backward()
        recipe.step(opt)
        recipe.iteration_end()
        opt.zero_grad()
    assert recipe.watched == 0
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    recipe.watch_unscaled_backward([opt])
    assert recipe.watched == watched


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=requires_cpu_fused("Adam"))])
def test_the_skip_signal_survives_the_update(fused):
    """torch's ``update()`` sums the inf checks of all optimizers into the first one, in place: an optimizer whose step
    was not skipped must not read as skipped after the update because another one's was (found by the random event
    sequences below). A fused optimizer's answer is always its inf check."""
    torch.manual_seed(0)
    nets = [nn.Linear(4, 2), nn.Linear(4, 2)]
    opts = [torch.optim.Adam(net.parameters(), lr=0.1, fused=fused) for net in nets]
    recipe = GradScalerRecipe(_scaler(), optimizers=lambda: opts)
    recipe.iteration_start()
    with recipe.backward():
        recipe.scale(_loss(nets[0]) + _loss(nets[1], inf=True), optimizers=lambda: opts).backward()
    for opt in opts:
        recipe.step(opt)  # the last one's step is followed by the update
    assert recipe.updates == 1
    assert [recipe.step_was_skipped(opt) for opt in opts] == [False, True]
    recipe.iteration_end()
    assert int(recipe.skipped_steps) == 1


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=requires_cpu_fused("Adam"))])
def test_the_skip_signal_reads_the_device_only_where_torch_did_not_decide_on_the_host(fused, monkeypatch):
    """torch's scaler runs ``optimizer.step()`` only without an inf/NaN, so whether ``step()`` ran tells the skip:
    telling so reads nothing from the device (a step-interval scheduler asks after every step). A fused optimizer, which
    checks inf/NaN in its own kernel, reads its inf check when asked, and not at all with ``sync=False``."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters(), lr=0.1, fused=fused)
    recipe = GradScalerRecipe(_scaler(), optimizers=lambda: [opt])
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(t) or item(t))
    for inf in (False, True, False):
        opt.zero_grad()
        with recipe.backward():
            recipe.scale(_loss(net, inf=inf), optimizers=lambda: [opt]).backward()
        recipe.step(opt)
        before = len(reads)
        assert recipe.step_was_skipped(opt, sync=False) is (inf and not fused)
        assert len(reads) == before
        assert recipe.step_was_skipped(opt) is inf
        assert len(reads) - before == (1 if fused else 0)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=requires_cpu_fused("Adam"))])
def test_the_skip_count_keeps_no_tensor_per_step(fused):
    """The count of skipped steps keeps the inf checks it cannot decide on the host, and only up to a bound: a long run
    that nobody asks for its count holds no tensor per step."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, fused=fused)
    recipe = GradScalerRecipe(_scaler(), optimizers=lambda: [opt])
    for i in range(100):
        opt.zero_grad()
        with recipe.backward():
            recipe.scale(_loss(net, inf=i % 10 == 0), optimizers=lambda: [opt]).backward()
        recipe.step(opt)
    assert len(recipe._skips._pending) < (64 if fused else 11)
    assert int(recipe.skipped_steps) == 10


def test_the_step_hook_of_the_skip_signal_goes_when_training_ends():
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler(), optimizers=lambda: [opt])
    with recipe.backward():
        recipe.scale(_loss(net)).backward()
    recipe.step(opt)
    assert len(opt._optimizer_step_post_hooks) == 1
    recipe.finish()
    assert len(opt._optimizer_step_post_hooks) == 0
    assert not recipe.step_was_skipped(opt)  # still answered


def test_a_load_consumes_the_owed_update():
    """A step outside an iteration leaves its update owed; a load replaces the scale that update would change, so the
    owed inf check must not reach the loaded scale at the next update."""
    net, opt, _, _ = _twins()
    recipe = GradScalerRecipe(_scaler())
    with recipe.backward():
        recipe.scale(_loss(net, inf=True)).backward()
    recipe.step(opt)  # skipped; the update is owed
    state = recipe.state_dict(include_owed_update=False)
    state["scale"], state["_growth_tracker"] = 2.0**5, 0
    recipe.load_state_dict(state)
    opt.zero_grad()
    recipe.iteration_start()
    with recipe.backward():
        recipe.scale(_loss(net)).backward()
    recipe.step(opt)
    recipe.iteration_end()
    assert recipe.scaler.get_scale() == 2.0**6  # grown from the loaded scale (growth_interval=1), not backed off


def test_an_unscale_without_gradients_leaves_no_state_behind():
    """Clipping on an iteration without backward and without a step unscales nothing and records no inf check: torch
    keeps an entry that no update clears, and would take the next iteration's gradients for unscaled. The recipe drops
    it at the iteration's end, so gradients assigned next (gradient surgery) are unscaled as in torch's recipe."""
    net, opt, twin, twin_opt = _twins()
    recipe, scaler = GradScalerRecipe(_scaler()), _scaler()
    for iteration in ("backward", "clip only", "surgery"):
        recipe.iteration_start()
        opt.zero_grad()
        twin_opt.zero_grad()
        if iteration == "backward":
            with recipe.backward():
                recipe.scale(_loss(net)).backward()
            scaler.scale(_loss(twin)).backward()
        elif iteration == "surgery":
            # as the docs say: `torch.autograd.grad` of the loss scaled by the plugin's scaler itself
            for params, scaled in ((net, recipe.scaler.scale(_loss(net))), (twin, scaler.scale(_loss(twin)))):
                for p, g in zip(params.parameters(), torch.autograd.grad(scaled, list(params.parameters()))):
                    p.grad = g
        if iteration == "clip only":
            recipe.scale(torch.ones(()))  # another network's loss: a backward since the step, so clipping unscales
        recipe.unscale(opt)  # clipping
        if iteration != "clip only":
            recipe.step(opt)
            scaler.unscale_(twin_opt)
            scaler.step(twin_opt)
            scaler.update()
        recipe.iteration_end()
        assert _same(net, twin), iteration
    assert recipe.scaler.state_dict() == scaler.state_dict()


def test_cleared_unscaled_gradients_keep_their_inf_check_until_a_backward_reaches_them():
    """Clipped with an inf, zeroed, then a backward that reaches only another network, then stepped: torch skips the
    step on the inf check its unscale recorded, and so does the recipe (a backward that reaches the cleared gradients
    starts a fresh step cycle instead)."""
    torch.manual_seed(0)
    nets = [nn.Linear(4, 2), nn.Linear(4, 2)]
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in nets]
    recipe = GradScalerRecipe(_scaler(), optimizers=lambda: opts)
    recipe.iteration_start()
    recipe.scale(_loss(nets[0], inf=True), optimizers=lambda: opts).backward()
    recipe.unscale(opts[0])
    opts[0].zero_grad()
    with recipe.backward():
        recipe.scale(_loss(nets[1]), optimizers=lambda: opts).backward()
    recipe.step(opts[0])
    assert recipe.step_was_skipped(opts[0])
    with recipe.backward():
        recipe.scale(_loss(nets[0]) + _loss(nets[1]), optimizers=lambda: opts).backward()
    recipe.step(opts[0])  # reached: a fresh cycle, on the new gradients' own inf check
    assert not recipe.step_was_skipped(opts[0])


def _sharded_rank(rank: int, port: int, out: str) -> None:
    """One rank of :func:`test_a_rank_whose_shard_has_no_gradients_unscales_with_the_others`."""
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=url, timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    net, other = nn.Linear(4, 2), nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**4, growth_interval=1)
    recipe = GradScalerRecipe(scaler, optimizers=lambda: [opt])
    scales = []
    for i in range(3):
        recipe.iteration_start()
        # the shard of rank 1 holds no parameter of `opt`: its loss reaches only `other`
        loss = _loss(net, inf=i == 1) if rank == 0 else _loss(other)
        with recipe.backward():
            recipe.scale(loss).backward()
        recipe.step(opt)
        recipe.iteration_end()
        opt.zero_grad()
        other.zero_grad()
        scales.append(recipe.scaler.get_scale())
    Path(out).write_text(json.dumps(scales))
    dist.destroy_process_group()


def test_a_rank_whose_shard_has_no_gradients_unscales_with_the_others(tmp_path):
    """``ShardedGradScaler.unscale_`` all-reduces the inf check, so every rank must unscale every optimizer, in the same
    order, even a rank whose shard has no gradients for it: then the inf on one rank skips the step and backs the
    scale off on both, and no all-reduce is left unpaired (a hang, then gloo's timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tests = str(Path(__file__).parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH"))))}
    outs = [tmp_path / f"rank{rank}.json" for rank in range(2)]
    ranks = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(out)], env=env)
        for rank, out in enumerate(outs)
    ]
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    assert [json.loads(out.read_text()) for out in outs] == [[32.0, 16.0, 32.0]] * 2


# --------------------------------------------------------------------------------------------------------------------
# random event sequences, the recipe and torch's scaler side by side
# --------------------------------------------------------------------------------------------------------------------


class _Twins:
    """1-3 tiny networks with their own SGD(momentum) optimizers, twice: one side driven through the recipe, the
    other through torch's ``GradScaler`` by hand, with torch's rules (one ``unscale_`` and one ``step`` per optimizer
    between updates, the update at the iteration's end when an inf check was recorded)."""

    def __init__(self, n: int) -> None:
        torch.manual_seed(n)
        self.nets = [nn.Linear(4, 2) for _ in range(n)]
        self.twins = copy.deepcopy(self.nets)
        self.opts = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in self.nets]
        self.twin_opts = [torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) for net in self.twins]
        self.recipe = GradScalerRecipe(_scaler(), optimizers=lambda: self.opts)
        self.scaler = _scaler()
        self.unscaled: set = set()  # twins' optimizers unscaled since the last update
        self.stepped: set = set()  # ... and stepped
        # unscaled in an earlier iteration and not stepped: torch would unscale them again, the recipe refuses the step
        self.stale: set = set()
        # stepped, and no scaled backward since: their gradients are the true ones they stepped on (or zeros)
        self.unreached: set = set()

    def _has_grads(self, i: int) -> bool:
        return any(p.grad is not None for p in self.twins[i].parameters())

    def _has_live_grads(self, i: int) -> bool:  # zeros (``zero_grad(set_to_none=False)``) are not
        return any(p.grad is not None and bool(p.grad.ne(0).any()) for p in self.twins[i].parameters())

    def zero_grad(self, i: int, set_to_none: bool) -> None:
        self.opts[i].zero_grad(set_to_none=set_to_none)
        self.twin_opts[i].zero_grad(set_to_none=set_to_none)
        self.stale.discard(i)

    def can_backward(self, reached: list) -> bool:
        # torch unscales an optimizer once between updates, so a backward after its unscale or its step in the
        # iteration is not a recipe of torch's (the recipe refuses unscaled gradients that a backward reaches, and
        # updates right after the last step); nor is one onto gradients left unscaled by an earlier iteration
        return not any(i in self.stepped | self.unscaled or i in self.stale and self._has_grads(i) for i in reached)

    def backward(self, reached: list, inf: bool) -> None:
        self.unreached.clear()
        for nets, scale in ((self.nets, None), (self.twins, self.scaler.scale)):
            loss = sum(_loss(nets[i]) for i in reached)
            loss = loss * float("inf") if inf else loss
            if scale is None:
                with self.recipe.backward():
                    self.recipe.scale(loss, optimizers=lambda: self.opts).backward()
            else:
                scale(loss).backward()

    def clip(self, i: int) -> None:
        if not self._has_grads(i):
            return  # torch: without gradients unscale_ leaves a state no update clears
        self.recipe.unscale(self.opts[i])  # idempotent: a second clip in a cycle does not unscale again
        if i in self.unreached:  # clipping after the step: true gradients, nothing to unscale
            for nets in (self.nets, self.twins):
                torch.nn.utils.clip_grad_norm_(nets[i].parameters(), 0.05)
            return
        torch.nn.utils.clip_grad_norm_(self.nets[i].parameters(), 0.05)
        if i not in self.unscaled | self.stale:
            self.scaler.unscale_(self.twin_opts[i])
            self.unscaled.add(i)
        torch.nn.utils.clip_grad_norm_(self.twins[i].parameters(), 0.05)

    def step(self, i: int) -> Optional[bool]:
        if i in self.stepped:
            return None  # torch: one step per optimizer between updates
        if i in self.stale and self._has_live_grads(i):
            with pytest.raises(RuntimeError, match="unscaled in an earlier iteration"):
                self.recipe.step(self.opts[i])
            return None
        self.recipe.step(self.opts[i])
        state = self.scaler._per_optimizer_states[id(self.twin_opts[i])]
        if i not in self.unscaled and not self._has_grads(i):
            self.twin_opts[i].step()  # nothing to unscale: torch's scaler would refuse, the recipe steps plainly
            skipped = False
        else:
            self.scaler.step(self.twin_opts[i])
            skipped = sum(v.item() for v in state["found_inf_per_device"].values()) > 0
        self.stepped.add(i)
        self.unreached.add(i)
        assert self.recipe.step_was_skipped(self.opts[i]) is skipped
        return skipped

    def end_iteration(self) -> None:
        projected = self.recipe.state_dict(include_owed_update=True)
        self.recipe.iteration_end()
        assert self.recipe.scaler.state_dict() == projected
        if any(s["found_inf_per_device"] for s in self.scaler._per_optimizer_states.values()):
            self.scaler.update()
        self.stale |= {i for i in self.unscaled - self.stepped if self._has_live_grads(i)}
        self.unscaled.clear()
        self.stepped.clear()

    def assert_same(self, where: str, scaler: bool = False) -> None:
        # the scaler's state only between iterations: the recipe updates right after the last optimizer's step
        assert not scaler or self.recipe.scaler.state_dict() == self.scaler.state_dict(), where
        for net, twin in zip(self.nets, self.twins):
            assert _same(net, twin), where
            for p, q in zip(net.parameters(), twin.parameters()):
                assert (p.grad is None) == (q.grad is None), where
                if p.grad is not None:  # bitwise, NaN in the same places (an injected inf)
                    torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True, msg=where)


@pytest.mark.parametrize("seed", range(100))
def test_random_event_sequences_follow_torchs_scaler(seed):
    """A seeded generator of event sequences: ``zero_grad`` either way, scaled backwards reaching random subsets of
    1-3 networks, injected infs, clipping, steps, saves and loads of the scaler's state, iteration ends. After every
    event the recipe's side must hold what torch's scaler, driven by hand, holds: weights, gradients, the skip of
    each step, and at each iteration's end the scaler's state."""
    rng = random.Random(seed)
    twins = _Twins(rng.randint(1, 3))
    n = len(twins.opts)
    for iteration in range(6):
        twins.recipe.iteration_start()
        for _ in range(rng.randint(1, 6)):
            i, where = rng.randrange(n), f"seed {seed}, iteration {iteration}"
            event = rng.choice(["zero_grad", "backward", "backward", "clip", "step", "save"])
            print(iteration, event, i, flush=True)  # shown with a failure
            if event == "zero_grad":
                twins.zero_grad(i, set_to_none=rng.random() < 0.5)
            elif event == "backward":
                reached = sorted(rng.sample(range(n), rng.randint(1, n)))
                if twins.can_backward(reached):
                    twins.backward(reached, inf=rng.random() < 0.25)
            elif event == "clip":
                twins.clip(i)
            elif event == "step":
                twins.step(i)
            else:  # a save changes nothing
                twins.recipe.state_dict(include_owed_update=rng.random() < 0.5)
            twins.assert_same(f"{where}, after {event}")
        twins.end_iteration()
        twins.assert_same(f"seed {seed}, end of iteration {iteration}", scaler=True)
        if rng.random() < 0.2:  # a resume: both load the state the run continues with
            state = twins.recipe.state_dict()
            twins.recipe.load_state_dict(state)
            twins.scaler.load_state_dict(state)
            twins.stale.clear()  # a load starts every optimizer afresh, on both sides


if __name__ == "__main__":  # a rank of the sharded test, started by it
    _sharded_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
