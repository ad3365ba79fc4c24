# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""What the AMP recipe knows of torch: the one adapter that reads a gradient scaler's private state, and torch's
protocols and quirks around it (fused optimizers, a disabled scaler, autocast's API across versions).

Every fact used here is pinned by ``tests/tests_fabric/plugins/precision/test_torch_behaviour_pins.py`` on each torch
the fork supports. Nothing here writes to a scaler.
"""

import functools
import inspect
from collections.abc import Iterable
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

try:  # torch >= 2.3
    from torch.amp.grad_scaler import OptState
except ImportError:  # torch 2.1, 2.2: the scaler lived with CUDA's AMP
    from torch.cuda.amp.grad_scaler import OptState

__all__ = ["OptState"]

# `GradScaler("cpu")` scales on the CPU from torch 2.3; before, a scaler is CUDA's and disables itself on a CPU run.
_CPU_GRAD_SCALER_AVAILABLE = hasattr(torch.amp, "GradScaler")


class _TorchScaler:
    """Reads of a scaler's private per-optimizer state (``GradScaler._per_optimizer_states``), and nothing else.

    torch keeps, per ``id(optimizer)`` since the last ``update()``, a ``"stage"`` (``OptState``: ``READY``,
    ``UNSCALED``, ``STEPPED``) and ``"found_inf_per_device"`` (device -> inf check; empty for an ``unscale_`` that found
    no gradient), and ``update()`` starts a fresh dict. The public API has no way to ask for either.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        # FSDP's `ShardedGradScaler` all-reduces its inf checks in `unscale_`: every rank must unscale every optimizer
        self.sharded = hasattr(scaler, "process_group")

    def stage(self, optimizer: Any, wrappers: Iterable = ()) -> tuple[OptState, Any]:
        """torch's stage of ``optimizer``, and the object torch keyed it by: the optimizer, or one of its ``wrappers``
        (weak references) that the user handed to ``scaler.unscale_`` themselves."""
        states = self.scaler._per_optimizer_states
        state = states.get(id(optimizer))
        if state is None and states:
            for ref in wrappers:
                wrapper = ref()
                if wrapper is not None and (state := states.get(id(wrapper))) is not None:
                    return state["stage"], wrapper
        return (OptState.READY, optimizer) if state is None else (state["stage"], optimizer)

    def recorded(self) -> bool:
        """Whether an unscale (the recipe's or the user's) recorded an inf check since the last update."""
        for state in getattr(self.scaler, "_per_optimizer_states", {}).values():  # a disabled scaler has none
            if state["found_inf_per_device"]:
                return True
        return False

    def found_inf(self, optimizer: Any) -> Optional[Tensor]:
        """The inf check recorded for ``optimizer``, summed over devices, as a copy (``update()`` sums into the first
        one in place); ``None`` if none was recorded."""
        state = self.scaler._per_optimizer_states.get(id(optimizer))
        found_infs = [] if state is None else list(state["found_inf_per_device"].values())
        if not found_infs:
            return None
        found_inf = found_infs[0].clone()
        for other in found_infs[1:]:
            found_inf += other.to(found_inf.device)
        return found_inf.reshape(())

    def scale(self) -> Tensor:
        """The scale as the scaler holds it, on its device (``update()`` writes it in place)."""
        return self.scaler._scale

    def has_scaled(self) -> bool:
        """Whether the scaler scaled a loss yet (before, it has no scale to unscale with)."""
        return self.scaler._scale is not None

    def project_owed_update(self, state: dict[str, Any]) -> None:
        """Put into ``state`` (the scaler's ``state_dict()``) the scale and growth tracker that the owed ``update()``
        will leave, computed by torch's own kernel on copies: the live scaler is not touched."""
        found_infs = [f for s in self.scaler._per_optimizer_states.values() for f in s["found_inf_per_device"].values()]
        if not found_infs or not state:
            return
        device = found_infs[0].device
        found_inf = sum(f.to(device).reshape(()) for f in found_infs[1:]) + found_infs[0].reshape(())
        scale = torch.full((), state["scale"], dtype=torch.float32, device=device)
        growth_tracker = torch.full((), state["_growth_tracker"], dtype=torch.int32, device=device)
        torch._amp_update_scale_(
            scale,
            growth_tracker,
            found_inf.to(torch.float32),
            state["growth_factor"],
            state["backoff_factor"],
            state["growth_interval"],
        )
        state["scale"], state["_growth_tracker"] = scale.item(), int(growth_tracker.item())


#: ``with _autocast_off():`` runs a region with autocast off for every device and restores it on exit, nested or on an
#: exception: torch's own guard (``torch._C._DisableAutocast``, what its AOT autograd uses), entered and left in C++, so
#: the five regions of a manual optimization step (backward, clipping, the step) cost no Python call. A
#: ``torch.autocast`` inside it (a closure's forward) turns the device's autocast back on until it exits.
_autocast_off = torch._C._DisableAutocast


def _has_gradients(optimizer: Any) -> bool:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return True
    return False


@functools.cache
def _takes_grad_scaler(step: Any) -> bool:
    """Whether an optimizer class's ``step`` unscales by itself, whatever ``GradScaler.unscale_`` did: the deprecated
    protocol of a ``grad_scaler`` keyword. Built-in fused optimizers (``fused=True``) follow the scaler's state since
    torch 2.1 (``GradScaler.step`` passes them ``grad_scale=None`` after ``unscale_``), so they can be unscaled like any
    other. Once per class: ``inspect.signature`` is too slow for every step."""
    return "grad_scaler" in inspect.signature(step).parameters


def _check_scaler_is_enabled(scaler: Any, owner: str) -> None:
    """Refuse a scaler that torch disabled: float16 gradients would then underflow silently, unscaled."""
    if scaler is None or scaler.is_enabled():
        return
    device = getattr(scaler, "_device", "cuda")
    if not torch.cuda.is_available() and device == "cuda":
        why = (
            "it is a CUDA scaler (`GradScaler()` or `GradScaler('cuda')`) and CUDA is not available, so torch"
            " disabled it"
        )
        if _CPU_GRAD_SCALER_AVAILABLE:
            fix = "pass `scaler=torch.amp.GradScaler('cpu')` for a CPU run, or use `precision='bf16-mixed'`"
        else:
            fix = (
                f"torch {torch.__version__} cannot scale gradients on a CPU (`torch.amp.GradScaler('cpu')` needs torch"
                " >= 2.3): use `precision='bf16-mixed'` on a CPU, or upgrade torch"
            )
    else:
        why = "it was created with `enabled=False`"
        fix = "pass an enabled `GradScaler`, or use `precision='bf16-mixed'`, which needs no scaler"
    raise ValueError(
        f"{owner} got a disabled gradient scaler: {why}. With precision='16-mixed' and no loss scaling, float16"
        f" gradients underflow to zero silently. To fix it, {fix}."
    )


def _protect_fused_sgd_momentum(optimizer: Optimizer) -> None:
    """Give fused SGD's momentum buffers a defined value before a step the scaler may skip.

    ``SGD(fused=True)`` allocates its momentum buffers uninitialised on its first step and lets the kernel fill them;
    when the scaler skips that step (inf/NaN, the usual start of fp16 training) they stay garbage and the weights blow
    up on the next step. Zero buffers give exactly for-loop SGD's first step when ``dampening == 0``
    (``0 * momentum + grad == grad``), so they are created here; with dampening they would not, so that raises.
    """
    if len(optimizer.state) >= sum(len(group["params"]) for group in optimizer.param_groups):
        return  # every parameter has stepped (or was given its buffer here): nothing to scan
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        missing = [p for p in group["params"] if p.grad is not None and "momentum_buffer" not in optimizer.state[p]]
        if not missing:
            continue
        if group["dampening"] != 0:
            raise ValueError(
                f"`SGD(fused=True, momentum={group['momentum']}, dampening={group['dampening']})` cannot be used with"
                " a gradient scaler: when the scaler skips its first step (inf/NaN gradients, normal at the start of"
                " fp16 training) torch leaves its momentum buffers uninitialised and the weights blow up. Use"
                " `fused=False`, `dampening=0`, or `precision='bf16-mixed'`."
            )
        for p in missing:
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ---- torch's refusals, worded for the user: what to do first, then why ----------------------------------------------


def _unscales_itself_error(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"Use an optimizer that follows torch's `grad_scale`/`found_inf` protocol (any built-in `fused=True`"
        f" optimizer), or do not clip gradients with {type(optimizer).__qualname__}: it unscales gradients inside its"
        " own `step()` (it takes a `grad_scaler` argument), so its gradients stay multiplied by the loss scale until"
        " then and cannot be clipped or inspected before the step without being unscaled twice."
    )


def _closure_error(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"Run the closure yourself (`loss = closure()`), then call `{type(optimizer).__name__}.step()` without it:"
        " torch's GradScaler does not support closures (\"Closure use is not currently supported if GradScaler is"
        ' enabled"), since the gradients the closure computes must be unscaled and checked for inf/NaN before the'
        " step. The step was not taken."
    )


def _nothing_scaled_error(optimizer: Any, backward: str) -> RuntimeError:
    return RuntimeError(
        f"Call `{backward}` instead of `loss.backward()`: with a gradient scaler (precision='16-mixed') every"
        f" backward must go through it. The gradients of {type(optimizer).__name__} come from a backward without the"
        " loss scale (the scaler has not scaled any loss yet), so the scaler can neither unscale them nor check them"
        " for inf/NaN. Nothing was changed."
    )
