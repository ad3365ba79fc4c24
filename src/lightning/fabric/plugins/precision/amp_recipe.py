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
drives a scaler through it by its public calls only; each optimizer's stage is torch's own ``OptState``, read through
``amp_torch_scaler._TorchScaler`` (a user's own ``scaler.unscale_`` is read as it is). Every optimizer's gradients are
unscaled with the scale that scaled them. An update is owed once an optimizer stepped since the last update (a clip
alone owes none), and applied at the first of:

=================================  =====================================================================================
(a) a step                         when every optimizer of the fit has stepped since the last update (one optimizer:
                                   after each step; several fed by one backward: once, after the last)
(b) :meth:`scale` (a backward)     always when owed; else when an optimizer unscaled and not stepped holds no gradients
                                   (cleared after a clip without a step: torch's loop updates before the next backward)
(c) :meth:`settle`: an iteration's whenever an inf check was recorded, a clip without a step included (torch's loop
    end, the fit's end, a load     updates once per iteration), also when the iteration raised
=================================  =====================================================================================

**The carry**: at an update, the gradients that wait (of the fit's optimizers that have not stepped since the last
update) move into the new scale on the device, times new/old where torch's stage is ``READY`` and times the new scale
where it is ``UNSCALED`` (their step unscales them again): exact for power-of-two factors, no host read. Waiting
gradients are then right whether they are stepped, discarded or zeroed later: no rule needs what the user does next.

From the order of events only (never gradient values or one tensor's identity): an unscale right after the optimizer's
step (no scaled backward since) changes nothing, and a step then steps again on the same true gradients. Refused:
torch's refusals (a closure, nothing scaled yet), and a scaled backward that wrote into gradients unscaled and not
stepped (two scales mixed), read from their version counters around it.
"""

import functools
import weakref
from typing import Any, NamedTuple, Optional, Union

import torch
from torch import Tensor
from torch.optim import SGD, Optimizer

from lightning.fabric.plugins.precision.amp_torch_scaler import (
    OptState,
    _closure_error,
    _has_gradients,
    _nothing_scaled_error,
    _protect_fused_sgd_momentum,
    _takes_grad_scaler,
    _TorchScaler,
    _unscales_itself_error,
)


class _RunAPI(NamedTuple):
    """What a user of the run calls, for the errors that tell them what to do."""

    backward: str
    optimizer: str


_TRAINER_API = _RunAPI("self.manual_backward(loss)", "`self.optimizers()` (the `LightningOptimizer`)")
_FABRIC_API = _RunAPI("fabric.backward(loss)", "`fabric.setup` (or `fabric.setup_optimizers`)")


class _Record:
    """What the recipe keeps of one optimizer, for as long as the optimizer lives."""

    __slots__ = ("optimizer", "wrappers", "in_fit", "stepped_in", "stepped_at", "unscaled_in", "last_skip", "step_hook")

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = weakref.ref(optimizer)
        self.wrappers: list[weakref.ref] = []  # that a user may hand to `scaler.unscale_`: torch then keys by them
        self.in_fit = False
        self.stepped_in = self.stepped_at = -1  # the update cycle, and the scaled backwards so far, at its last step
        self.unscaled_in = -1  # the update cycle of the recipe's last unscale of it
        self.last_skip: Union[bool, Tensor] = False  # the skip signal (a fused kernel's inf check, read when asked)
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

    """

    #: the opt-in misuse watch while it is armed (``amp_misuse_watch``), whose ``scaled_backward()`` brackets a backward
    watch: Optional[Any] = None

    def __init__(self, scaler: Any, api: _RunAPI = _FABRIC_API) -> None:
        self.scaler = scaler
        self._torch = _TorchScaler(scaler)
        self._api = api
        # optimizer (weakly: a reference whose callback drops the entry when the optimizer goes) -> its record
        self._records: dict[weakref.ref, _Record] = {}
        self._fit: list[_Record] = []
        # a step since the last update; the update cycle (+1 at each, and at a backward that starts one without it); the
        # scaled backwards (+1 each, and at a Trainer's iteration start: the user's own `scaler.scale(loss)` may follow)
        self._owed = False
        self._cycle = 0
        self.backwards = 0
        #: before a scaled backward: the optimizers unscaled and not stepped, and their gradients' versions
        self.reach_marks: list[tuple[weakref.ref, list]] = []
        #: how many ``scaler.update()`` calls this recipe applied
        self.updates = 0
        # skipped steps: decided on the host, and by fused kernels (a running count on the device, read when asked)
        self._skipped = 0
        self._fused_skipped: Union[int, Tensor] = 0
        self._step_ran = False

    def _record(self, optimizer: Any) -> _Record:
        record = self._records.get(weakref.ref(optimizer))
        if record is None:
            record = _Record(optimizer)
            self._records[weakref.ref(optimizer, functools.partial(_drop, self._records))] = record
        return record

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

    def scale(self, loss: Tensor) -> Tensor:
        """A loss is about to be backpropagated: rule (b), then scale it. The caller runs the backward, then
        :meth:`after_backward` if :attr:`reach_marks` holds anything."""
        self.backwards += 1
        if self._owed:
            self.settle()
        elif self._torch.recorded():  # a clip without a step: its gradients wait, unless cleared
            marks = []
            for record in list(self._records.values()):
                optimizer = record.optimizer()
                if optimizer is not None and self._torch.stage(optimizer, record.wrappers)[0] is OptState.UNSCALED:
                    if not _has_gradients(optimizer):
                        marks = []
                        break
                    marks.append((record.optimizer, _gradient_versions(optimizer)))
            if marks:
                self._cycle += 1
                self.reach_marks = marks
            else:
                self.settle()
        else:
            self._cycle += 1  # steps without gradients owe nothing: this backward's gradients start the cycle
        return self.scaler.scale(loss)

    def after_backward(self) -> None:
        """The backward of a scaled loss ended: refuse it if it wrote into gradients unscaled and not stepped."""
        marks, self.reach_marks = self.reach_marks, []
        for ref, versions in marks:
            optimizer = ref()
            if optimizer is not None and _written(optimizer, versions):
                raise _mixed_scales_error(optimizer)

    def unscale(self, optimizer: Optimizer, before_step: bool = False) -> None:
        """Unscale ``optimizer``'s gradients unless they are true ones already. ``before_step``: the caller steps it
        next (the Trainer, before ``on_before_optimizer_step``); else (clipping) an optimizer that unscales inside its
        own ``step()`` raises, as it would unscale twice."""
        if getattr(optimizer, "_step_supports_amp_scaling", False) and _takes_grad_scaler(type(optimizer).step):
            if not before_step:
                raise _unscales_itself_error(optimizer)
            return
        record = self._records.get(weakref.ref(optimizer)) or self._record(optimizer)
        if record.stepped_at == self.backwards or record.unscaled_in == self._cycle:
            return  # right after its step (no scaled backward since: the true gradients it stepped on), or unscaled
        if self._torch.stage(optimizer, record.wrappers)[0] is not OptState.READY:
            return  # unscaled already (by the user's own `scaler.unscale_`), or stepped
        if self._torch.sharded or _has_gradients(optimizer):
            self._unscale(optimizer)
            record.unscaled_in = self._cycle

    def _unscale(self, optimizer: Any) -> None:
        # FSDP's `ShardedGradScaler` all-reduces the inf checks: every rank unscales, whether its shard has gradients
        try:
            self.scaler.unscale_(optimizer)
        except AssertionError as error:
            if not self._torch.has_scaled():
                raise _nothing_scaled_error(optimizer, self._api.backward) from error
            raise

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` through the scaler, which unscales first if nobody did and skips the step on inf/NaN;
        refuses a closure (as torch's scaler does), and gradients while no loss was scaled yet, changing nothing."""
        if kwargs.get("closure") is not None:
            raise _closure_error(optimizer)
        record = self._records.get(weakref.ref(optimizer)) or self._record(optimizer)
        in_kernel, owes = getattr(optimizer, "_step_supports_amp_scaling", False), False
        if record.stepped_at == self.backwards:  # again, no backward since: the true gradients, skipped if the last was
            skipped = self.step_was_skipped(optimizer)
            output = None if skipped else self._own_step(optimizer, kwargs)
        else:
            # unscaled by the recipe in this cycle: torch's stage is `UNSCALED`, keyed by the optimizer
            stage, holder = (
                (OptState.UNSCALED, optimizer)
                if record.unscaled_in == self._cycle
                else self._torch.stage(optimizer, record.wrappers)
            )
            if stage is OptState.READY and not (in_kernel and _takes_grad_scaler(type(optimizer).step)):
                if self._torch.sharded:  # every rank unscales (an all-reduce); a fused kernel cannot take its checks
                    self._unscale(optimizer)
                elif not _has_gradients(optimizer):
                    holder = None  # nothing to unscale or skip on: the optimizer's own step
            if holder is None:
                output, skipped = self._own_step(optimizer, kwargs), False
            else:
                if in_kernel and isinstance(optimizer, SGD):
                    _protect_fused_sgd_momentum(optimizer)
                if not in_kernel and record.step_hook is None:  # says whether torch ran the step: no device read
                    hook = functools.partial(_step_ran, weakref.ref(self))
                    record.step_hook = optimizer.register_step_post_hook(hook)
                self._step_ran, owes = False, True
                if holder is optimizer and not (in_kernel and self._torch.sharded):
                    try:
                        output = self.scaler.step(optimizer, **kwargs)  # unscales first if nobody did
                    except AssertionError as error:
                        if not self._torch.has_scaled():
                            raise _nothing_scaled_error(optimizer, self._api.backward) from error
                        raise
                else:
                    # what `scaler.step` does, where it cannot: the user unscaled through a wrapper (torch keyed the
                    # entry by it), or a fused kernel cannot take `ShardedGradScaler`'s 1-element inf checks
                    found_inf, in_kernel = self._torch.found_inf(holder), False
                    self._step_ran = found_inf is None or not found_inf.item()
                    output = self._own_step(optimizer, kwargs) if self._step_ran else None
                # a fused kernel decides on the device: its inf check, read when asked
                skipped = self._torch.found_inf(holder) if in_kernel else not self._step_ran
        if isinstance(skipped, Tensor):
            self._fused_skipped = skipped.gt(0).int() + self._fused_skipped
        else:
            skipped = bool(skipped)
            self._skipped += skipped
        record.last_skip, record.stepped_at, record.stepped_in = skipped, self.backwards, self._cycle
        self._owed = self._owed or owes
        if record.in_fit:
            for other in self._fit:  # rule (a)
                if other.stepped_in != self._cycle and other.optimizer() is not None:
                    return output
        elif self._fit:
            return output
        # every optimizer of the fit stepped (or nobody declared the fit: each step is its own, as in stock Lightning)
        if self._owed:  # a scaler step since the last update recorded an inf check
            self._update()
        else:
            self.settle()
        return output

    def _own_step(self, optimizer: Any, kwargs: dict) -> Any:  # the opt-in watch marks it as the recipe's
        return optimizer.step(**kwargs)

    def settle(self) -> None:
        """Apply the update owed, or called for by a recorded inf check (rule (c)), carrying the gradients that wait."""
        if self._torch.recorded():
            self._update()
        else:
            self._owed, self.reach_marks, self._cycle = False, [], self._cycle + 1

    def _update(self) -> None:
        waiting = []
        for record in self._fit or list(self._records.values()):  # nobody declared the fit: every optimizer seen
            optimizer = record.optimizer()
            if optimizer is not None and record.stepped_in != self._cycle:
                stage = self._torch.stage(optimizer, record.wrappers)[0]
                grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                if grads and stage is not OptState.STEPPED:
                    waiting.append((grads, stage is OptState.UNSCALED))
        old_scale = self._torch.scale().clone() if waiting else None
        self.scaler.update()
        self._owed, self.reach_marks, self._cycle, self.updates = False, [], self._cycle + 1, self.updates + 1
        for grads, unscaled in waiting:
            _multiply(grads, self._torch.scale() if unscaled else self._torch.scale() / old_scale)

    def state_dict(self, include_owed_update: bool = True) -> dict[str, Any]:
        """The scaler's state, the live run unchanged: with the update owed so far, computed on copies (what the run
        continues with), or the scale the current steps used (a Trainer re-runs the iteration saved from inside)."""
        state = self.scaler.state_dict()
        if include_owed_update:
            self._torch.project_owed_update(state)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict``: the owed update is consumed first (gradients that wait are carried)."""
        self.settle()
        self.scaler.load_state_dict(state_dict)

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last :meth:`step` of ``optimizer`` was skipped because its gradients held inf/NaN (``False``
        before its first step and for a step without gradients); a fused optimizer's is one read from the device."""
        record = self._records.get(weakref.ref(optimizer))
        last = False if record is None else record.last_skip
        return last if isinstance(last, bool) else bool(last.item() > 0)

    def forget_last_step(self, optimizer: Optimizer) -> None:
        """``optimizer`` did not step in this iteration (nothing to step on): no step of it was skipped."""
        record = self._records.get(weakref.ref(optimizer))
        if record is not None:
            record.last_skip = False

    @property
    def update_owed(self) -> bool:
        """Whether an update is owed, or an inf check was recorded since the last ``scaler.update()``."""
        return self._owed or self._torch.recorded()

    @property
    def skipped_steps(self) -> Tensor:
        """How many steps (of all optimizers) the scaler skipped so far, as a tensor."""
        fused = self._fused_skipped
        return torch.tensor(self._skipped) + (fused.cpu() if isinstance(fused, Tensor) else fused)

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle plugins (`ddp_spawn`): the optimizers, hooks and weak references stay in this process
        return {**self.__dict__, "_records": {}, "_fit": [], "reach_marks": []}


def _gradient_versions(optimizer: Any) -> list:
    """Each gradient (weakly) and its version counter: a backward that writes a gradient changes its entry."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in params]


def _written(optimizer: Any, versions: list) -> bool:
    """Whether a gradient of ``optimizer`` was created, replaced or written since :func:`_gradient_versions` (by
    identity and version counter: comparing tensors would compare their values)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p, mark in zip(params, versions):
        if mark is None:
            if p.grad is not None:
                return True
        elif mark[0]() is not p.grad or mark[1] != p.grad._version:
            return True
    return len(params) != len(versions)


def _multiply(grads: list[Tensor], factor: Tensor) -> None:
    """``grads *= factor`` on their devices, without a host read."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for device, tensors in by_device.items():
        torch._foreach_mul_(tensors, factor.to(device))


def _drop(records: dict, ref: weakref.ref) -> None:
    records.pop(ref, None)  # the optimizer went: its record (the skip signal, its hook's handle) goes with it


def _step_ran(recipe_ref: "weakref.ref[GradScalerRecipe]", *_: Any) -> None:
    recipe = recipe_ref()
    if recipe is not None:
        recipe._step_ran = True


def _mixed_scales_error(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"Step {type(optimizer).__name__} before the next backward that reaches its parameters, or clear its gradients"
        " with `zero_grad()` (`set_to_none=True`) before that backward: its gradients were unscaled (by gradient"
        " clipping or `scaler.unscale_`) and it did not step, then this backward added gradients multiplied by the loss"
        " scale, so they now mix two scales and no unscale can give the true gradients. (Zeros written in place, by"
        " `zero_grad(set_to_none=False)`, cannot be told from unscaled gradients without reading them.)"
    )
