"""Pins of the torch behaviour the fork's AMP recipe relies on: pure torch, no Lightning.

The fork drives ``GradScaler`` through PyTorch's AMP recipe by its public calls only and, to know what a user already
did through the scaler, reads (never writes) its private per-optimizer state, in one adapter
(``amp_torch_scaler._TorchScaler``); it tells which optimizers hold gradients written since the last update from
metadata (presence, tensor identity, version counters), never from values; it turns autocast's weight cache on where
that is safe and clears it where a cast could be stale; it relies on the ``grad_scale``/``found_inf`` protocol of fused
optimizers. None of that is public API. Each test here states one fact the fork depends on, and its docstring names
the mechanism that depends on it, so that a torch release that changes the fact fails here, loudly, instead of
training wrong. Facts that exist only from some torch on skip with a reason elsewhere (see ``torch_features``); the
facts about which torch has what are pinned too, since the fork's version gates and the tests' skip reasons state them.

Run on every torch of the matrix: ``make test-matrix`` (2.1.2 and 2.14.1) and ``make test`` (2.13.0).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import warnings
from collections import defaultdict
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from amp_oracle.torch_features import (
    AUTOCAST_CACHE_IS_SAFE,
    AUTOCAST_ENABLED_TAKES_DEVICE,
    CPU_FUSED,
    HAS_AMP_GRAD_SCALER,
    TORCH,
    GradScaler,
    OptState,
    requires_cpu_fused,
    requires_cpu_grad_scaler,
)
from amp_oracle.world import INIT_SCALE, new_scaler
from torch import nn

from lightning.fabric.plugins.precision.amp_torch_scaler import _autocast_off

#: devices a working (enabled) gradient scaler can run on with this torch
SCALER_DEVICES = [
    pytest.param("cpu", marks=requires_cpu_grad_scaler),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


def param_and_sgd(device: str, value: float = 1.0) -> tuple[nn.Parameter, torch.optim.SGD]:
    param = nn.Parameter(torch.full((3,), value, device=device))
    return param, torch.optim.SGD([param], lr=0.1)


def scaled_backward(scaler, param: nn.Parameter, inf: bool = False) -> None:
    loss = (param * (float("inf") if inf else 2.0)).sum()
    scaler.scale(loss).backward()


# ----------------------------------------------------------------------------------------------------------------------
# Which torch has what: the fork's version gates and the tests' skip reasons
# ----------------------------------------------------------------------------------------------------------------------


def test_grad_scaler_module_paths():
    """``OptState`` lives in ``torch.amp.grad_scaler`` from torch 2.3, before in ``torch.cuda.amp.grad_scaler`` (also
    kept later, as the same enum).

    The fork imports ``OptState`` from the first and falls back to the second, so ``import lightning`` works on torch
    2.1; the states it compares (``READY``/``UNSCALED``/``STEPPED``) are these three.
    """
    assert (TORCH >= (2, 3)) == HAS_AMP_GRAD_SCALER
    from torch.cuda.amp.grad_scaler import OptState as CudaOptState

    assert CudaOptState is OptState
    assert [(s.name, s.value) for s in OptState] == [("READY", 0), ("UNSCALED", 1), ("STEPPED", 2)]
    if HAS_AMP_GRAD_SCALER:
        assert issubclass(torch.cuda.amp.GradScaler, torch.amp.GradScaler)


def test_is_autocast_enabled_takes_a_device_from_torch_2_4():
    """``torch.is_autocast_enabled(device_type)`` exists exactly where ``torch.get_autocast_dtype`` does (torch 2.4);
    before, ``torch.is_autocast_enabled()`` answers for CUDA only and ``torch.is_autocast_cpu_enabled()`` for CPU.

    The tests' ``torch_features.autocast_enabled(device_type)`` takes ``hasattr(torch, "get_autocast_dtype")`` as the
    sign of the new API, and falls back to the per-device functions.
    """
    assert (TORCH >= (2, 4)) == AUTOCAST_ENABLED_TAKES_DEVICE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # is_autocast_cpu_enabled is deprecated from 2.4
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.is_autocast_cpu_enabled()
            assert not torch.is_autocast_enabled()  # no argument: CUDA's autocast, on every torch
            if AUTOCAST_ENABLED_TAKES_DEVICE:
                assert torch.is_autocast_enabled("cpu")
                assert torch.get_autocast_dtype("cpu") is torch.bfloat16
            else:
                with pytest.raises(TypeError):
                    torch.is_autocast_enabled("cpu")
        assert not torch.is_autocast_cpu_enabled()



def test_autocast_off_is_torchs_guard_nested_and_undone_by_an_inner_autocast():
    """``_autocast_off`` (``torch._C._DisableAutocast``, the guard torch's AOT autograd runs a backward under) exists on
    every torch the fork supports: off inside for the device, nested too, back on after (an exception included), the
    dtype untouched; a ``torch.autocast`` inside turns it back on until it exits (a closure's forward); where autocast
    is off it stays off. The fork's manual optimization leaves autocast through it around backward, clipping and the
    step (promise 1)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # is_autocast_cpu_enabled is deprecated from 2.4
        with torch.autocast("cpu", dtype=torch.bfloat16):  # torch < 2.2 autocasts a CPU to bfloat16 only
            with _autocast_off():
                assert not torch.is_autocast_cpu_enabled()
                assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32
                with _autocast_off():
                    assert not torch.is_autocast_cpu_enabled()
                assert not torch.is_autocast_cpu_enabled()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
                assert not torch.is_autocast_cpu_enabled()
            assert torch.is_autocast_cpu_enabled()
            assert torch.get_autocast_cpu_dtype() is torch.bfloat16
            with pytest.raises(ValueError), _autocast_off():
                raise ValueError
            assert torch.is_autocast_cpu_enabled()
        with _autocast_off():
            assert not torch.is_autocast_cpu_enabled()
        assert not torch.is_autocast_cpu_enabled()


def test_autocast_weight_cache_was_stale_under_no_grad_before_torch_2_11():
    """pytorch#165068, fixed in torch 2.11: before, a cast cached under ``torch.no_grad`` (an EMA teacher's forward) is
    reused by a later forward with grad enabled, whose output then has no ``grad_fn``.

    The fork turns autocast's weight cache on by default only from torch 2.11 (``_AUTOCAST_CACHE_IS_SAFE``) and
    refuses ``cache_enabled=True`` before; this test fails the day that gate and torch disagree.
    """
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        with torch.no_grad():
            layer(x)
        out = layer(x)
    assert (out.grad_fn is not None) == AUTOCAST_CACHE_IS_SAFE


# ----------------------------------------------------------------------------------------------------------------------
# GradScaler's private per-optimizer state
# ----------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _constructible_scaler():
    """An enabled scaler to inspect (not to run) on this machine, whatever torch: on torch < 2.3 without CUDA, only
    ``torch.cuda.amp.GradScaler`` exists and it disables itself where CUDA is not available."""
    if HAS_AMP_GRAD_SCALER:
        yield torch.amp.GradScaler("cpu")
        return
    with mock.patch("torch.cuda.is_available", return_value=True):
        yield torch.cuda.amp.GradScaler()


def test_per_optimizer_states_is_a_defaultdict_of_ready_states():
    """``GradScaler._per_optimizer_states`` is a ``defaultdict`` keyed by ``id(optimizer)`` whose default is
    ``{"stage": OptState.READY, "found_inf_per_device": {}}``, empty when nothing was unscaled or stepped.

    The fork's scaler adapter reads a stage with ``.get(id(optimizer))`` (``None`` = READY, nothing inserted; a read
    with ``[]`` would insert an entry, a write), and takes an empty dict as "nothing unscaled since the last update".
    Checked on every torch (on torch < 2.3 without CUDA, on a scaler built as if CUDA were there).
    """
    with _constructible_scaler() as scaler:
        states = scaler._per_optimizer_states
    assert isinstance(states, defaultdict)
    assert not states
    assert states.default_factory() == {"stage": OptState.READY, "found_inf_per_device": {}}
    assert states.get(12345) is None
    assert not states
    assert states[12345]["stage"] is OptState.READY
    assert list(states) == [12345]


def test_disabled_scaler_has_no_per_optimizer_states():
    """A disabled scaler (``enabled=False``, or ``GradScaler("cuda")``/``torch.cuda.amp.GradScaler()`` on a machine
    without CUDA, which disables itself with a warning) has no ``_per_optimizer_states``, returns the loss unchanged
    from ``scale`` and just steps.

    The fork's recipe checks ``scaler.is_enabled()`` before touching the private state (a clear error
    for a disabled scaler under 16-mixed); the 32-true/bf16-mixed reference loops use a disabled scaler on every torch.
    Stock 2.6.6 on torch < 2.4 builds ``torch.cuda.amp.GradScaler()`` for ``MixedPrecision("16-mixed", "cpu")``: on a
    CPU machine that scaler is disabled.
    """
    scaler = GradScaler(enabled=False)
    assert not scaler.is_enabled()
    assert not hasattr(scaler, "_per_optimizer_states")
    param, opt = param_and_sgd("cpu")
    loss = (param * 2.0).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), torch.full((3,), 1.0 - 0.1 * 2.0))
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            cuda_scaler = torch.amp.GradScaler("cuda") if HAS_AMP_GRAD_SCALER else torch.cuda.amp.GradScaler()
        assert not cuda_scaler.is_enabled()
        assert not hasattr(cuda_scaler, "_per_optimizer_states")


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_unscale_records_a_0dim_inf_check_per_device(device):
    """``unscale_`` moves the optimizer's entry to ``UNSCALED`` and records ``found_inf_per_device``: a dict device ->
    0-dim float32 tensor, 1.0 when a gradient holds inf/NaN; the gradients are divided by the scale.

    The fork's adapter sums a copy of them (``_TorchScaler.found_inf``) for ``step_was_skipped`` and
    ``skipped_steps``, read from the device only when asked; fused kernels read them as 0-dim.
    """
    scaler = new_scaler(device)
    alive = []  # torch keys its per-optimizer state by id(): a collected optimizer's id may come back
    for inf, expected in ((False, 0.0), (True, 1.0)):
        param, opt = param_and_sgd(device)
        alive.append(opt)
        scaled_backward(scaler, param, inf=inf)
        scaler.unscale_(opt)
        state = scaler._per_optimizer_states[id(opt)]
        assert set(state) == {"stage", "found_inf_per_device"}
        assert state["stage"] is OptState.UNSCALED
        (found_inf,) = state["found_inf_per_device"].values()
        assert found_inf.shape == ()
        assert found_inf.dtype is torch.float32
        assert found_inf.device.type == device
        assert found_inf.item() == expected
    param, opt = param_and_sgd(device)
    alive.append(opt)
    scaled_backward(scaler, param)
    scaler.unscale_(opt)
    assert torch.equal(param.grad, torch.full_like(param, 2.0))


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_unscale_twice_and_step_twice_raise(device):
    """A second ``unscale_`` of an optimizer before ``update()`` raises; so does a second ``step``.

    Why the fork's unscaling is idempotent (it unscales only from READY, whoever asks first: clipping, the step, or the
    user's own ``scaler.unscale_``), why the update a step owes comes before the same optimizer's next backward (rule
    (b): a critic stepped n times), and why the recipe refuses a second step where that update cannot come.
    """
    scaler = new_scaler(device)
    param, opt = param_and_sgd(device)
    scaled_backward(scaler, param)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this optimizer since the last"):
        scaler.unscale_(opt)
    scaler.step(opt)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last update\(\)"):
        scaler.step(opt)


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_step_from_ready_unscales_and_records_the_inf_check(device):
    """``step`` of an optimizer nobody unscaled unscales it first, records its inf check and skips the step on inf.

    The fork lets the scaler unscale at the step when nothing read the gradients before, and reads the recorded check
    after the step.
    """
    scaler = new_scaler(device)
    param, opt = param_and_sgd(device)
    scaled_backward(scaler, param, inf=True)
    scaler.step(opt)
    state = scaler._per_optimizer_states[id(opt)]
    assert state["stage"] is OptState.STEPPED
    assert [f.item() for f in state["found_inf_per_device"].values()] == [1.0]
    assert torch.equal(param.detach(), torch.ones(3, device=device))  # skipped


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_update_reads_every_entry_sums_into_the_first_and_resets_the_state(device):
    """``update()`` counts the inf checks of every entry of ``_per_optimizer_states``, adding the others into the first
    one in place, then replaces the dict with a fresh empty ``defaultdict`` (the old one is left as it was).

    The fork's adapter reads ``scaler._per_optimizer_states`` anew at every call (never keeps the dict) and copies an
    inf check before keeping it for the skip signal (``_TorchScaler.found_inf``): an optimizer that did not skip must
    not read as skipped after the update because another one did.
    """
    scaler = new_scaler(device)
    (param, opt), (other, other_opt) = param_and_sgd(device), param_and_sgd(device)
    scaled_backward(scaler, param)
    scaled_backward(scaler, other, inf=True)
    scaler.step(opt)
    scaler.step(other_opt)  # skipped: inf
    states = scaler._per_optimizer_states
    (first,) = states[id(opt)]["found_inf_per_device"].values()
    assert first.item() == 0.0
    scaler.update()
    assert scaler.get_scale() == INIT_SCALE / 2  # the second optimizer's inf check counted: backed off
    assert first.item() == 1.0  # summed into, in place
    assert isinstance(scaler._per_optimizer_states, defaultdict)
    assert not scaler._per_optimizer_states
    assert scaler._per_optimizer_states is not states
    assert set(states) == {id(opt), id(other_opt)}


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_the_state_is_keyed_by_the_object_handed_to_the_scaler(device):
    """``unscale_(wrapper)`` of an object that only forwards ``param_groups`` (a ``LightningOptimizer``) records the
    entry under ``id(wrapper)``; the wrapped optimizer stays ``READY``, and ``update()`` counts the entry.

    The fork's adapter reads the stage of the wrappers :meth:`GradScalerRecipe.track` knows when the optimizer's own is
    ``READY``, and steps on the inf check recorded for the wrapper instead of unscaling again.
    """
    scaler = new_scaler(device)
    param, opt = param_and_sgd(device)

    class Wrapper:
        param_groups = opt.param_groups

    wrapper = Wrapper()
    scaled_backward(scaler, param, inf=True)
    scaler.unscale_(wrapper)
    assert scaler._per_optimizer_states.get(id(opt)) is None
    assert scaler._per_optimizer_states[id(wrapper)]["stage"] is OptState.UNSCALED
    scaler.update()
    assert scaler.get_scale() == INIT_SCALE / 2


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_unscale_without_gradients_records_an_empty_inf_check(device):
    """``unscale_`` of an optimizer none of whose parameters has a gradient moves it to ``UNSCALED`` with an empty
    ``found_inf_per_device``; ``update()`` then finds no inf check and raises.

    The fork's adapter takes an empty dict as "no inf check recorded" (``_TorchScaler.recorded``), and the recipe does
    not call ``unscale_`` for an optimizer without gradients on a ``GradScaler`` (FSDP's all-reduces: see below).
    """
    scaler = new_scaler(device)
    param, opt = param_and_sgd(device)
    scaler.scale((param * 2.0).sum())
    scaler.unscale_(opt)
    assert scaler._per_optimizer_states[id(opt)] == {"stage": OptState.UNSCALED, "found_inf_per_device": {}}
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_scale_is_none_until_the_first_scaled_loss(device):
    """``_scale`` is ``None`` until the first ``scale()``; ``unscale_`` before it fails with an ``AssertionError``.

    The fork's adapter reads ``_scale is None`` (``_TorchScaler.has_scaled``) to turn that into an error that names the
    plugin's backward (``loss.backward()`` instead of ``fabric.backward(loss)``).
    """
    scaler = new_scaler(device)
    param, opt = param_and_sgd(device)
    (param * 2.0).sum().backward()
    assert scaler._scale is None
    with pytest.raises(AssertionError):
        scaler.unscale_(opt)
    scaler.scale((param * 2.0).sum())
    assert scaler._scale is not None


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_amp_update_scale_on_copies_is_what_update_leaves(device):
    """``torch._amp_update_scale_(scale, growth_tracker, found_inf, growth, backoff, interval)`` on copies of the state
    gives the scale and growth tracker that ``update()`` leaves (growth, back-off, the tracker).

    The fork's ``state_dict(include_owed_update=True)`` projects the owed update that way, without touching the scaler.
    """
    for inf in (False, True, False, False):
        scaler = new_scaler(device, growth_interval=2)
        param, opt = param_and_sgd(device)
        for step_inf in (False, inf):
            opt.zero_grad()
            scaled_backward(scaler, param, inf=step_inf)
            scaler.step(opt)
            state = scaler.state_dict()
            (found_inf,) = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
            scale = torch.full((), state["scale"], dtype=torch.float32, device=device)
            tracker = torch.full((), state["_growth_tracker"], dtype=torch.int32, device=device)
            torch._amp_update_scale_(scale, tracker, found_inf.clone(), 2.0, 0.5, 2)
            scaler.update()
            assert (scale.item(), tracker.item()) == (scaler.get_scale(), scaler.state_dict()["_growth_tracker"])


def test_gradient_metadata_changes_with_every_write():
    """A backward into an existing gradient, ``zero_grad(set_to_none=False)``, ``unscale_``-like in-place writes and
    ``clip_grad_norm_`` bump the gradient's version counter; the first backward creates the tensor, ``zero_grad()``
    sets it to ``None``; an SGD step reads the gradient without writing it. A sparse gradient accumulates in place too.

    The fork tells which optimizers hold gradients written since the last update (rule (b)), and which unscaled ones a
    later backward reached, from exactly these: presence, identity and version counter, never from values.
    """
    param, opt = param_and_sgd("cpu")
    assert param.grad is None
    (param * 2.0).sum().backward()
    grad, writes = param.grad, [lambda: (param * 2.0).sum().backward(), lambda: opt.zero_grad(set_to_none=False)]
    writes += [lambda: param.grad.mul_(0.5), lambda: torch.nn.utils.clip_grad_norm_([param], 1e9)]
    for write in writes:
        version = grad._version
        write()
        assert param.grad is grad and grad._version > version
    version = grad._version
    opt.step()
    assert param.grad is grad and grad._version == version
    opt.zero_grad()
    assert param.grad is None
    embedding = nn.Embedding(4, 2, sparse=True)
    embedding(torch.tensor([1])).sum().backward()
    grad, version = embedding.weight.grad, embedding.weight.grad._version
    embedding(torch.tensor([2])).sum().backward()
    assert embedding.weight.grad is not grad or embedding.weight.grad._version > version


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_no_inf_checks_assertions(device):
    """``step`` of an optimizer none of whose parameters has a gradient raises ``AssertionError: No inf checks were
    recorded for this optimizer``; ``update()`` without any recorded inf check raises ``AssertionError: No inf checks
    were recorded prior to update``.

    The fork steps an optimizer without gradients plainly (nothing to unscale or skip on), and calls ``update()``
    only when an inf check was recorded since the last one.
    """
    scaler = new_scaler(device)
    param, opt = param_and_sgd(device)
    scaler.scale((param * 2.0).sum())  # no backward: no gradients
    with pytest.raises(AssertionError, match="No inf checks were recorded for this optimizer"):
        scaler.step(opt)
    scaler = new_scaler(device)
    scaler.scale((param * 2.0).sum())
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update()


@pytest.mark.parametrize("device", SCALER_DEVICES)
def test_scaler_state_dict_format(device):
    """``GradScaler.state_dict()`` holds ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
    ``_growth_tracker``, and ``load_state_dict`` restores the scale.

    The fork saves and loads the scaler in stock 2.6.6's checkpoint format (checkpoints load both ways), with the owed
    update projected into the saved state (on copies) where the run continues with it.
    """
    scaler = new_scaler(device)
    param, opt = param_and_sgd(device)
    scaled_backward(scaler, param)
    scaler.step(opt)
    scaler.update()
    state = scaler.state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    assert state["scale"] == INIT_SCALE * 2
    assert state["_growth_tracker"] == 0
    other = new_scaler(device)
    other.load_state_dict(copy.deepcopy(state))
    assert other.get_scale() == INIT_SCALE * 2


# ----------------------------------------------------------------------------------------------------------------------
# Fused optimizers: the grad_scale / found_inf protocol
# ----------------------------------------------------------------------------------------------------------------------


def _fused_names():
    return [pytest.param(name, marks=requires_cpu_fused(name)) for name in ("Adam", "AdamW", "SGD", "Adagrad")]


@pytest.mark.parametrize("name", _fused_names())
def test_fused_optimizers_follow_the_grad_scale_protocol(name):
    """Built-in ``fused=True`` optimizers set ``_step_supports_amp_scaling`` and their ``step`` takes no ``grad_scaler``
    argument; ``fused=False`` ones do not set it.

    The fork's ``_takes_grad_scaler`` is False for their ``step``: they are unscaled through the scaler like any other
    optimizer (promise 6); only an optimizer whose ``step`` takes ``grad_scaler`` unscales by itself.
    """
    param = nn.Parameter(torch.ones(3))
    fused = getattr(torch.optim, name)([param], lr=0.1, fused=True)
    assert fused._step_supports_amp_scaling is True
    assert "grad_scaler" not in inspect.signature(type(fused).step).parameters
    assert not getattr(getattr(torch.optim, name)([param], lr=0.1), "_step_supports_amp_scaling", False)


@requires_cpu_grad_scaler
@requires_cpu_fused("AdamW")
@pytest.mark.parametrize("unscaled", [True, False], ids=["after-unscale", "ready"])
def test_scaler_step_passes_grad_scale_none_after_unscale(unscaled):
    """``GradScaler.step`` of a fused optimizer sets ``optimizer.grad_scale`` (``None`` after ``unscale_``, else the
    scale) and ``optimizer.found_inf`` (0-dim) for the duration of ``step()``, and removes both afterwards.

    The fork unscales fused optimizers before clipping and relies on the kernel not unscaling again.
    """
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=0.1, fused=True)
    seen = {}

    def pre_hook(optimizer, args, kwargs):
        seen.update(grad_scale=optimizer.grad_scale, found_inf=optimizer.found_inf.clone())

    opt.register_step_pre_hook(pre_hook)
    scaler = new_scaler("cpu")
    scaled_backward(scaler, param)
    if unscaled:
        scaler.unscale_(opt)
        assert seen == {}
    scaler.step(opt)
    if unscaled:
        assert seen["grad_scale"] is None
    else:
        assert seen["grad_scale"].item() == INIT_SCALE
    assert seen["found_inf"].shape == ()
    assert seen["found_inf"].item() == 0.0
    assert not hasattr(opt, "grad_scale")
    assert not hasattr(opt, "found_inf")


@requires_cpu_grad_scaler
@requires_cpu_fused("AdamW")
def test_fused_adamw_unscaled_and_clipped_equals_forloop_adamw():
    """Fused AdamW, unscaled by the scaler, clipped and stepped through it, trains like for-loop AdamW (to ~1e-7),
    an inf step skipped by both.

    Promise 6: the fork unscales fused optimizers through the scaler so that clipping and hooks see true gradients.
    """
    torch.manual_seed(0)
    w0, data = torch.randn(8, 4), torch.randn(6, 4)
    results = []
    for fused in (True, False):
        param = nn.Parameter(w0.clone())
        opt = torch.optim.AdamW([param], lr=1e-2, fused=fused, foreach=None if fused else False)
        scaler = new_scaler("cpu")
        for i, x in enumerate(data):
            opt.zero_grad()
            loss = (param @ x).pow(2).sum() * (float("inf") if i == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_([param], 1.0)
            scaler.step(opt)
            scaler.update()
        results.append((param.detach(), opt.state[param]["step"].item(), scaler.get_scale()))
    (fused_w, fused_steps, fused_scale), (loop_w, loop_steps, loop_scale) = results
    torch.testing.assert_close(fused_w, loop_w, rtol=1e-6, atol=1e-7)
    assert fused_steps == loop_steps == len(data) - 1
    assert fused_scale == loop_scale


@requires_cpu_grad_scaler
@requires_cpu_fused("SGD")
def test_fused_sgd_momentum_buffers_after_a_skipped_first_step():
    """A skipped first step (inf) leaves fused SGD with allocated but never written momentum buffers, which the next
    step uses as they are; pre-created zero buffers give exactly for-loop SGD's first step (``dampening=0``).

    The fork creates zero momentum buffers before a fused SGD step the scaler may skip (``_protect_fused_sgd_momentum``)
    and refuses ``dampening != 0`` with a scaler.
    """
    param = nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, fused=True)
    scaler = new_scaler("cpu")
    scaled_backward(scaler, param, inf=True)
    scaler.step(opt)
    scaler.update()
    assert torch.equal(param.detach(), torch.ones(4))  # skipped
    assert "momentum_buffer" in opt.state[param]  # allocated, its content undefined (torch.empty)
    opt.state[param]["momentum_buffer"].fill_(7.0)  # whatever it holds is what the next step uses
    opt.zero_grad()
    scaled_backward(scaler, param)
    scaler.step(opt)
    torch.testing.assert_close(param.detach(), torch.full((4,), 1.0 - 0.1 * (0.9 * 7.0 + 2.0)))

    results = []
    for fused in (True, False):
        param = nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, fused=fused, foreach=None if fused else False)
        if fused:
            opt.state[param]["momentum_buffer"] = torch.zeros_like(param)
        for _ in range(3):
            opt.zero_grad()
            (param * 2.0).sum().backward()
            opt.step()
        results.append(param.detach())
    assert torch.equal(*results)


@requires_cpu_grad_scaler
@pytest.mark.skipif(
    TORCH < (2, 2), reason=f"ShardedGradScaler takes a device from torch 2.2 (this is {torch.__version__})"
)
def test_sharded_grad_scaler_records_1_element_inf_checks():
    """``ShardedGradScaler.unscale_`` records ``found_inf_per_device`` with shape ``[1]`` (``GradScaler``: 0-dim), also
    for an optimizer without gradients (the rank's inf check all-reduced with the others'); fused Adam/AdamW stepped
    after it fail inside torch ("output with shape [] doesn't match the broadcast shape [1]", torch 2.13 and 2.14 on
    CPU).

    The fork reads the sharded scaler's inf checks through ``reshape``, unscales every optimizer on every rank with
    FSDP's scaler (gradients or not), and steps fused optimizers under it on the inf check it reads.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        scaler = ShardedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1)
        param, opt = param_and_sgd("cpu")
        scaled_backward(scaler, param, inf=True)
        scaler.unscale_(opt)
        (found_inf,) = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()
        assert found_inf.shape == (1,)
        assert found_inf.dtype is torch.float32
        assert found_inf.item() == 1.0
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == INIT_SCALE / 2
        _, empty = param_and_sgd("cpu")
        scaler.scale(torch.ones(()))
        scaler.unscale_(empty)  # no gradients: still an inf check, on the scaler's device
        (found_inf,) = scaler._per_optimizer_states[id(empty)]["found_inf_per_device"].values()
        assert (found_inf.shape, found_inf.item()) == ((1,), 0.0)
    finally:
        if created:
            dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------------
# Autocast's weight cache
# ----------------------------------------------------------------------------------------------------------------------


def _fresh(layer: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``out`` was computed from the current weights (cast now), not from a cached cast."""
    expected = nn.functional.linear(x.bfloat16(), layer.weight.detach().bfloat16(), layer.bias.detach().bfloat16())
    return torch.equal(out.detach(), expected)


def test_autocast_cache_caches_fp32_leaves_that_require_grad_and_goes_stale():
    """Under ``torch.autocast(cache_enabled=True)`` the cast of an fp32 leaf that requires grad is cached until the
    outermost autocast region exits or ``torch.clear_autocast_cache()``; an in-place edit of the weight in between
    (an optimizer step, clamping) is not noticed: the next forward uses the stale cast. A weight that does not require
    grad is cast anew every time.

    The reason the fork clears the cache after every backward and optimizer step, and wherever weights can change in
    place inside a ``training_step`` (promise 2).
    """
    x = torch.randn(2, 4)
    for requires_grad in (True, False):
        layer = nn.Linear(4, 4).requires_grad_(requires_grad)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            assert torch.is_autocast_cache_enabled()
            layer(x)
            with torch.no_grad():
                layer.weight.add_(1.0)
            assert _fresh(layer, x, layer(x)) is not requires_grad  # stale exactly when cached
            torch.clear_autocast_cache()
            assert _fresh(layer, x, layer(x))


def test_autocast_cache_is_cleared_by_the_outermost_exit_only():
    """Leaving a nested autocast region keeps the cache; leaving the outermost clears it. ``cache_enabled=False`` casts
    every time.

    The fork's forward context is nested inside a user's own ``torch.autocast`` regions (and the other way round), so
    it clears the cache itself rather than relying on a region's exit.
    """
    x = torch.randn(2, 4)
    layer = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            layer(x)
        with torch.no_grad():
            layer.weight.add_(1.0)
        assert not _fresh(layer, x, layer(x))
    with torch.no_grad():
        layer.weight.add_(1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
        assert _fresh(layer, x, layer(x))
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        assert not torch.is_autocast_cache_enabled()
        layer(x)
        with torch.no_grad():
            layer.weight.add_(1.0)
        assert _fresh(layer, x, layer(x))
    assert torch.is_autocast_cache_enabled()  # restored on exit


# ----------------------------------------------------------------------------------------------------------------------
# Hooks
# ----------------------------------------------------------------------------------------------------------------------


@requires_cpu_grad_scaler
def test_step_hooks_see_scaler_steps_but_not_skipped_ones():
    """``Optimizer.register_step_pre_hook``/``register_step_post_hook`` (torch 2.0) fire for every ``optimizer.step()``
    call, also the one ``GradScaler.step`` makes; the scaler does not call ``step()`` of a for-loop optimizer whose step
    it skips (inf), while a fused optimizer is always called (its kernel skips on ``found_inf``).

    The recipe's skip signal: whether its post hook ran tells a skipped for-loop step without reading the device; the
    opt-in watch's pre hook sees a raw optimizer stepped outside the recipe.
    """
    for fused in (False, True) if "AdamW" in CPU_FUSED else (False,):
        param = nn.Parameter(torch.ones(3))
        opt = torch.optim.AdamW([param], lr=0.1, fused=fused)
        calls = []
        opt.register_step_pre_hook(lambda optimizer, args, kwargs: calls.append(optimizer))
        opt.register_step_post_hook(lambda optimizer, args, kwargs: calls.append("post"))
        scaler = new_scaler("cpu")
        scaled_backward(scaler, param)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scaled_backward(scaler, param, inf=True)
        scaler.step(opt)
        scaler.update()
        assert calls == ([opt, "post", opt, "post"] if fused else [opt, "post"])


def test_post_accumulate_grad_hook_fires_after_each_backward():
    """``Tensor.register_post_accumulate_grad_hook`` (torch 2.1) fires once per backward for each leaf, after its
    ``.grad`` holds the accumulated gradient.

    Available to the fork on every torch of the matrix for tracking which backward wrote a parameter's gradients.
    """
    param = nn.Parameter(torch.ones(3))
    seen = []
    param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    (param * 2.0).sum().backward()
    (param * 3.0).sum().backward()
    assert [g.tolist() for g in seen] == [[2.0] * 3, [5.0] * 3]


def test_weak_id_key_dictionary_keys_tensors_by_identity_and_drops_collected_ones():
    """``torch.utils.weak.WeakIdKeyDictionary`` (torch 2.0) looks tensors up by identity (a ``WeakKeyDictionary``
    cannot: ``Tensor.__eq__`` is elementwise) and forgets a key once it is collected.

    The fork's misuse watch records the optimizers and parameters it hooked in one, so that a collected one's ``id()``,
    which CPython hands to the next object, does not make a new parameter look watched already.
    """
    import gc

    from torch.utils.weak import WeakIdKeyDictionary

    watched = WeakIdKeyDictionary()
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    watched[a] = True
    assert a in watched  # equal values, different tensors
    assert b not in watched
    del a
    gc.collect()
    assert len(watched) == 0
