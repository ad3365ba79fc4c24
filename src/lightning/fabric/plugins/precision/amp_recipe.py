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
"""PyTorch's AMP recipe for a gradient scaler, with one lazy update that carries the gradients that wait.

The recipe (torch's "Automatic Mixed Precision examples"): ``scaler.scale(loss).backward()``; ``scaler.unscale_(opt)``
before anything reads gradients; ``scaler.step(opt)``; ``scaler.update()`` after the steps. :class:`GradScalerRecipe`
drives a scaler through it for the Trainer's and Fabric's precision plugins. Where each optimizer's gradients are is
torch's own ``OptState``, read through :class:`~lightning.fabric.plugins.precision.amp_torch_scaler._TorchScaler`,
which only reads; the scaler is driven through its public calls only.

The invariant: every optimizer's gradients are unscaled with the scale that scaled them, and torch receives a loop it
accepts. An update is owed once an optimizer stepped since the last update (a clip alone owes none); it is applied at
the first of these events:

==================================  ====================================================================================
event                               the update is applied
==================================  ====================================================================================
(a) a step                          when every optimizer of the fit has stepped since the last update (one optimizer:
                                    after each of its steps; several fed by one backward: once, after the last)
(b) :meth:`scale` (a backward)      always when owed; else when an optimizer unscaled since the last update holds no
                                    gradients any more (cleared after a clip without a step)
(c) :meth:`settle`: an iteration's  whenever an inf check was recorded, a clip without a step included (torch's loop
    end, the end of the fit, a      updates once per iteration); also when the iteration raised
    load
==================================  ====================================================================================

**The carry.** At an update, the gradients that wait (of the fit's optimizers that have not stepped since the last
update) move into the new scale on the device: times new/old scale where torch's stage is ``READY``, times the new scale
where it is ``UNSCALED`` (``update()`` makes them ``READY``; their step unscales them again). With the default
power-of-two factors the product is exact, and nothing is read to the host. So whether the user steps, discards or
zeroes waiting gradients later, they are right, and no rule needs to know which.

Per optimizer, decided from the order of events only (never from gradient values or one tensor's identity):

- :meth:`unscale`: ``READY`` -> ``UNSCALED`` through ``scaler.unscale_``; nothing when unscaled already (by the recipe or
  the user's own ``scaler.unscale_``), stepped, or when no scaled backward ran since its step (a clip after
  ``opt.step()``: its gradients are the true ones);
- :meth:`step`: ``READY``/``UNSCALED`` -> ``STEPPED`` through ``scaler.step``; without gradients the optimizer's own
  step (nothing to unscale or skip on); with no scaled backward since its last step, its own step on the true gradients
  that step used (skipped if it was);
- refused with a clear error: a closure, a step or clip with gradients before any loss was scaled, and a scaled
  backward that wrote into gradients unscaled and not stepped (two scales mixed), read from the version counters of
  that optimizer's gradients around the backward.
"""

import functools
import weakref
from typing import Any, NamedTuple, Optional, Union

import torch
from torch import Tensor
from torch.optim import SGD, Optimizer

from lightning.fabric.plugins.precision.amp_torch_scaler import (
    OptState,
    _has_gradients,
    _protect_fused_sgd_momentum,
    _takes_grad_scaler,
    _TorchScaler,
)


class _RunAPI(NamedTuple):
    """What a user of the run calls, for the errors that tell them what to do."""

    backward: str
    optimizer: str


_TRAINER_API = _RunAPI("self.manual_backward(loss)", "`self.optimizers()` (the `LightningOptimizer`)")
_FABRIC_API = _RunAPI("fabric.backward(loss)", "`fabric.setup` (or `fabric.setup_optimizers`)")


class _Record:
    """What the recipe keeps of one optimizer, for as long as the optimizer lives."""

    __slots__ = ("optimizer", "wrappers", "in_fit", "stepped_in", "stepped_at", "last_skip", "step_hook")

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = weakref.ref(optimizer)
        # wrappers of it (weakly) that a user may hand to `scaler.unscale_`, where torch then keys its stage
        self.wrappers: list[weakref.ref] = []
        self.in_fit = False
        # the recipe's update cycle and count of scaled backwards at its last step
        self.stepped_in = -1
        self.stepped_at = -1
        # the skip signal: whether its last step was skipped (a fused one's inf check, read when asked)
        self.last_skip: Union[bool, Tensor] = False
        self.step_hook: Optional[Any] = None


class GradScalerRecipe:
    """Drives a gradient scaler (``torch.amp.GradScaler``, FSDP's ``ShardedGradScaler``) through PyTorch's AMP recipe
    with one lazy update (the module's table).

    Example::

        recipe = GradScalerRecipe(torch.amp.GradScaler("cpu"))
        recipe.track(optimizer)
        for batch in batches:
            recipe.scale(loss_fn(model(batch))).backward()
            if recipe.reach_marks:
                recipe.after_backward()
            recipe.unscale(optimizer)  # before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            recipe.step(optimizer)  # the fit's last optimizer stepped: `scaler.update()` follows
        recipe.end_fit()

    A user's own ``scaler.unscale_(opt)`` (with the optimizer or a tracked wrapper of it) is torch's stage, read as it
    is: PyTorch's recipe followed to the letter gives the recipe's result.
    """

    #: the opt-in misuse watch, set by its subclass (:mod:`~lightning.fabric.plugins.precision.amp_misuse_watch`)
    watch: Optional[Any] = None

    def __init__(self, scaler: Any, api: _RunAPI = _FABRIC_API) -> None:
        self.scaler = scaler
        self._torch = _TorchScaler(scaler)
        self._api = api
        self._records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._fit: list[_Record] = []
        # whether an optimizer stepped since the last update; the update cycle (+1 at each update, and at a backward
        # that starts a cycle without one); the scaled backwards so far (+1 at each, and at a Trainer's iteration start,
        # the only place where a backward the recipe does not see, the user's own `scaler.scale(loss)`, may have run)
        self._owed = False
        self._cycle = 0
        self.backwards = 0
        # before a scaled backward: the optimizers unscaled and not stepped, with their gradients' versions
        self.reach_marks: list[tuple[weakref.ref, list]] = []
        self._updates = 0
        self._skipped = 0
        self._fused_found_infs: list[Tensor] = []
        self._fused_skipped: Optional[Tensor] = None
        self._step_ran = False

    def _record(self, optimizer: Any) -> _Record:
        record = self._records.get(optimizer)
        if record is None:
            record = self._records[optimizer] = _Record(optimizer)
        return record

    # ---- the fit ------------------------------------------------------------------------------------------------

    def track(self, optimizer: Any, wrapper: Optional[Any] = None) -> None:
        """``optimizer`` (and ``wrapper``, which a user may hand to ``scaler.unscale_``) belongs to this fit."""
        record = self._record(optimizer)
        if not record.in_fit:
            record.in_fit = True
            self._fit = [r for r in self._fit if r.optimizer() is not None] + [record]
        if wrapper is not None:
            record.wrappers.append(weakref.ref(wrapper))

    def end_fit(self) -> None:
        """Training ends: the owed update is applied, and this fit's optimizers are forgotten."""
        self.settle()
        for record in list(self._records.values()):
            if record.step_hook is not None:
                record.step_hook.remove()
            record.step_hook, record.in_fit, record.wrappers = None, False, []
        self._fit = []

    # ---- events -------------------------------------------------------------------------------------------------

    def scale(self, loss: Tensor) -> Tensor:
        """A loss is about to be backpropagated: apply the owed update (rule (b)), then scale it.

        The caller runs the backward, then :meth:`after_backward` if :attr:`reach_marks` holds anything.

        """
        self.backwards += 1
        if self._owed:
            self.settle()
        elif self._torch.recorded():
            self._before_backward_onto_unscaled()
        else:
            self._cycle += 1  # steps without gradients owe nothing: this backward's gradients start the cycle
        return self.scaler.scale(loss)

    def _before_backward_onto_unscaled(self) -> None:
        """An inf check was recorded and no step owes an update: gradients unscaled and not stepped wait for their step
        (torch's loop allows other backwards meanwhile), unless one was cleared since (then the update comes first)."""
        marks = []
        for optimizer, record in list(self._records.items()):
            if self._torch.stage(optimizer, record.wrappers)[0] is OptState.UNSCALED:
                if not _has_gradients(optimizer):
                    marks = []
                    break
                marks.append((record.optimizer, _gradient_versions(optimizer)))
        if not marks:  # nothing waits unscaled: torch's loop would update before this backward
            self.settle()
            return
        self._cycle += 1
        self.reach_marks = marks

    def after_backward(self) -> None:
        """The backward of a scaled loss ended: refuse it if it wrote into gradients unscaled and not stepped."""
        marks, self.reach_marks = self.reach_marks, []
        for ref, versions in marks:
            optimizer = ref()
            if optimizer is not None and _gradient_versions(optimizer) != versions:
                raise _mixed_scales_error(optimizer)

    def unscale(self, optimizer: Optimizer, before_step: bool = False) -> None:
        """Unscale ``optimizer``'s gradients unless they are true ones already (see the module's list).

        Args:
            optimizer: the ``torch.optim`` optimizer whose gradients to unscale.
            before_step: whether the caller steps it next (the Trainer, before ``on_before_optimizer_step``). Otherwise
                (clipping) an optimizer that unscales inside its own ``step()`` raises: its gradients cannot be unscaled
                before the step without being unscaled twice.

        """
        if getattr(optimizer, "_step_supports_amp_scaling", False) and _takes_grad_scaler(type(optimizer).step):
            if not before_step:
                raise _unscales_itself_error(optimizer)
            return
        record = self._records.get(optimizer)
        if record is not None and record.stepped_at == self.backwards:
            return  # no scaled backward since its step (a clip after `opt.step()`): the true gradients it stepped on
        if self._torch.stage(optimizer, () if record is None else record.wrappers)[0] is not OptState.READY:
            return  # unscaled already (by the recipe, or the user's own `scaler.unscale_`), or stepped
        if self._torch.sharded or _has_gradients(optimizer):
            self._unscale(optimizer)

    def _unscale(self, optimizer: Any) -> None:
        # FSDP's `ShardedGradScaler` all-reduces the inf checks: every rank unscales, whether its shard has gradients
        try:
            self.scaler.unscale_(optimizer)
        except AssertionError as error:
            if not self._torch.has_scaled():
                raise _nothing_scaled_error(optimizer, self._api) from error
            raise

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` through the scaler, which unscales first if nobody did and skips the step on inf/NaN.

        Raises:
            RuntimeError: for a closure (as torch's scaler), or gradients while no loss was scaled yet. Nothing is
                changed then.

        """
        if kwargs.get("closure") is not None:
            raise _closure_error(optimizer)
        record = self._record(optimizer)
        if record.stepped_at == self.backwards:
            # again with no scaled backward since: the true gradients its last step used, skipped if that one was
            skipped = self.step_was_skipped(optimizer)
            return self._after_step(record, None if skipped else self._own_step(optimizer, kwargs), skipped, owes=False)
        stage, holder = self._torch.stage(optimizer, record.wrappers)
        in_kernel = getattr(optimizer, "_step_supports_amp_scaling", False)
        if stage is OptState.READY and not (in_kernel and _takes_grad_scaler(type(optimizer).step)):
            if not (self._torch.sharded or _has_gradients(optimizer)):  # nothing to unscale or skip on
                return self._after_step(record, self._own_step(optimizer, kwargs), False, owes=False)
            self._unscale(optimizer)
        if in_kernel and isinstance(optimizer, SGD):
            _protect_fused_sgd_momentum(optimizer)
        if not in_kernel and record.step_hook is None:
            record.step_hook = optimizer.register_step_post_hook(functools.partial(_step_ran, weakref.ref(self)))
        self._step_ran = False
        if holder is optimizer and not (in_kernel and self._torch.sharded):
            output = self.scaler.step(optimizer, **kwargs)
        else:
            # what `scaler.step` does, where it cannot: the user unscaled through a wrapper (torch keyed the entry by
            # the wrapper), or a fused kernel cannot take `ShardedGradScaler`'s 1-element inf checks
            found_inf = self._torch.found_inf(holder)
            self._step_ran = found_inf is None or not found_inf.item()
            output = self._own_step(optimizer, kwargs) if self._step_ran else None
            in_kernel = False  # decided on the host
        # the skip signal: torch decided on the host whether `step()` ran; a fused kernel decides on the device, whose
        # inf check is read only when asked
        return self._after_step(record, output, self._torch.found_inf(holder) if in_kernel else not self._step_ran)

    def _own_step(self, optimizer: Any, kwargs: dict) -> Any:
        """The optimizer's own step, where the scaler's cannot take it."""
        return optimizer.step(**kwargs)

    def _after_step(self, record: _Record, output: Any, skipped: Union[bool, Tensor, None], owes: bool = True) -> Any:
        if skipped is None or isinstance(skipped, bool):
            record.last_skip = bool(skipped)
            self._skipped += bool(skipped)
        else:
            record.last_skip = skipped
            self._fused_found_infs.append(skipped)
            if len(self._fused_found_infs) >= 64:  # bounded: fold on the device
                folded = torch.stack(self._fused_found_infs).gt(0).sum()
                self._fused_skipped = folded if self._fused_skipped is None else self._fused_skipped + folded
                self._fused_found_infs = []
        record.stepped_at, record.stepped_in = self.backwards, self._cycle
        self._owed = self._owed or owes
        if record.in_fit:
            for other in self._fit:  # rule (a)
                if other.stepped_in != self._cycle and other.optimizer() is not None:
                    return output
            self.settle()
        elif not self._fit:  # nobody declared the fit's optimizers: each step is its own, as in stock Lightning
            self.settle()
        return output

    def settle(self) -> None:
        """Apply the owed update, or the one a recorded inf check calls for, carrying the gradients that wait."""
        self._owed = False
        self.reach_marks = []
        if not self._torch.recorded():
            self._cycle += 1
            return
        waiting = []
        for record in self._fit or list(self._records.values()):  # nobody declared the fit: every optimizer seen
            optimizer = record.optimizer()
            if optimizer is None or record.stepped_in == self._cycle:
                continue
            stage = self._torch.stage(optimizer, record.wrappers)[0]
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if grads and stage is not OptState.STEPPED:
                waiting.append((grads, stage is OptState.UNSCALED))
        old_scale = self._torch.scale().clone() if waiting else None
        self.scaler.update()
        self._cycle += 1
        self._updates += 1
        if waiting:
            new_scale = self._torch.scale()
            ratio = new_scale / old_scale
            for grads, unscaled in waiting:
                _multiply(grads, new_scale if unscaled else ratio)

    # ---- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self, include_owed_update: bool = True) -> dict[str, Any]:
        """The scaler's state, without changing the live run.

        Args:
            include_owed_update: whether the state holds the update owed so far, computed on copies (what the run
                continues with), or the scale the current steps used (a checkpoint saved from a Trainer's
                ``training_step`` re-runs the iteration with the scale it had).

        """
        state = self.scaler.state_dict()
        if include_owed_update:
            self._torch.project_owed_update(state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict``: the owed update is consumed first (gradients that wait are carried)."""
        self.settle()
        self.scaler.load_state_dict(state_dict)

    # ---- signals ------------------------------------------------------------------------------------------------

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last :meth:`step` of ``optimizer`` was skipped because its gradients held inf/NaN.

        ``False`` before its first step and for a step without gradients. A fused optimizer (whose kernel checks for
        inf/NaN) is answered by reading its inf check from the device: one read per question.

        """
        record = self._records.get(optimizer)
        last = False if record is None else record.last_skip
        if isinstance(last, bool):
            return last
        return bool(last.item() > 0)

    def forget_last_step(self, optimizer: Optimizer) -> None:
        """``optimizer`` did not step in this iteration (nothing to step on): no step of it was skipped."""
        record = self._records.get(optimizer)
        if record is not None:
            record.last_skip = False

    @property
    def update_owed(self) -> bool:
        """Whether an update is owed, or an inf check was recorded since the last ``scaler.update()``."""
        return self._owed or self._torch.recorded()

    @property
    def updates(self) -> int:
        """How many ``scaler.update()`` calls this recipe applied."""
        return self._updates

    @property
    def skipped_steps(self) -> Tensor:
        """How many steps (of all optimizers) the scaler skipped so far, as a tensor."""
        fused = torch.stack(self._fused_found_infs).gt(0).sum().cpu() if self._fused_found_infs else 0
        return torch.tensor(self._skipped) + fused + (0 if self._fused_skipped is None else self._fused_skipped.cpu())

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle plugins (`ddp_spawn`): the optimizers, hooks and weak references stay in this process
        state = self.__dict__.copy()
        state.update(_records=None, _fit=[], reach_marks=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _records=weakref.WeakKeyDictionary())


def _gradient_versions(optimizer: Any) -> list:
    """Each gradient (weakly) and its version counter: a backward that writes a gradient changes its entry."""
    return [
        None if p.grad is None else (weakref.ref(p.grad), p.grad._version)
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def _multiply(grads: list[Tensor], factor: Tensor) -> None:
    """``grads *= factor`` on their devices, without a host read."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for device, tensors in by_device.items():
        torch._foreach_mul_(tensors, factor.to(device))


def _step_ran(recipe_ref: "weakref.ref[GradScalerRecipe]", *_: Any) -> None:
    recipe = recipe_ref()
    if recipe is not None:
        recipe._step_ran = True


# ---- the recipe's refusals: what to do first, then why ---------------------------------------------------------------


def _unscales_itself_error(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"Use an optimizer that follows torch's `grad_scale`/`found_inf` protocol (any built-in `fused=True`"
        f" optimizer), or do not clip gradients with {type(optimizer).__qualname__}: it unscales gradients inside its"
        " own `step()` (it takes a `grad_scaler` argument), so its gradients stay multiplied by the loss scale until"
        " then and cannot be clipped or inspected before the step without being unscaled twice."
    )


def _mixed_scales_error(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"Step {type(optimizer).__name__} before the next backward that reaches its parameters, or clear its gradients"
        " with `zero_grad()` (`set_to_none=True`) before that backward: its gradients were unscaled (by gradient"
        " clipping or `scaler.unscale_`) and it did not step, then this backward added gradients multiplied by the loss"
        " scale, so they now mix two scales and no unscale can give the true gradients. (Zeros written in place, by"
        " `zero_grad(set_to_none=False)`, cannot be told from unscaled gradients without reading them.)"
    )


def _closure_error(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"Run the closure yourself (`loss = closure()`), then call `{type(optimizer).__name__}.step()` without it:"
        ' torch\'s GradScaler does not support closures ("Closure use is not currently supported if GradScaler is'
        ' enabled"), since the gradients the closure computes must be unscaled and checked for inf/NaN before the'
        " step. The step was not taken."
    )


def _nothing_scaled_error(optimizer: Any, api: _RunAPI) -> RuntimeError:
    return RuntimeError(
        f"Call `{api.backward}` instead of `loss.backward()`: with a gradient scaler (precision='16-mixed') every"
        f" backward must go through it. The gradients of {type(optimizer).__name__} come from a backward without the"
        " loss scale (the scaler has not scaled any loss yet), so the scaler can neither unscale them nor check them"
        " for inf/NaN. Nothing was changed."
    )
