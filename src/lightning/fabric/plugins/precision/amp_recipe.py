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
"""PyTorch's AMP recipe for a gradient scaler, driven by one update rule.

The recipe (torch's "Automatic Mixed Precision examples"): ``scaler.scale(loss).backward()``; ``scaler.unscale_(opt)``
before anything reads gradients; ``scaler.step(opt)``; ``scaler.update()`` after the steps. :class:`GradScalerRecipe`
drives a scaler through it for the Trainer's and Fabric's precision plugins. Where each optimizer's gradients are is
torch's own ``OptState``, read from the scaler (:class:`~lightning.fabric.plugins.precision.amp_torch_scaler.
_TorchScaler`, which only reads); the scaler is only ever driven through its public calls.

The invariant: every optimizer's gradients are unscaled with the scale that scaled them, and the calls torch receives
form a loop torch accepts. An update is owed once an unscale recorded an inf check since the last update; it is applied
at the first of these events:

================================  ======================================================================================
event                             the owed ``scaler.update()`` is applied
================================  ======================================================================================
(a) a step                        when every optimizer of the fit has stepped since the last update (one optimizer:
                                  after each of its steps; several fed by one backward: once, after the last)
(b) :meth:`scale` (a backward)    unless an optimizer of the fit that has not stepped since the last update holds
                                  gradients produced since then (they wait for their step, in the same scale)
(c) an iteration's end, the end   always (an exception leaving the iteration included)
    of the fit, a load
================================  ======================================================================================

The fit's optimizers are :meth:`track`-ed by the plugin (the Trainer's, those ``fabric.setup`` wrapped) and dropped by
:meth:`end_fit`. Whether an optimizer holds gradients produced since the last update is read from metadata (presence,
tensor identity, version counters), never from values, and never from hooks. Per optimizer:

- :meth:`unscale`: ``READY`` -> ``UNSCALED`` through ``scaler.unscale_``; ``UNSCALED`` stays; ``STEPPED``, or ``READY``
  with no backward since its last step (clipping after ``opt.step()``): nothing, its gradients are the true ones;
- :meth:`step`: ``READY``/``UNSCALED`` -> ``STEPPED`` through ``scaler.step``; without gradients, the optimizer's own
  step (there is nothing to unscale or skip on);
- refused with a clear error, nothing changed: gradients a scaled backward reached after their unscale (two scales
  mixed), a step on gradients unscaled before the last update, a second step before the update owed by the first
  while another optimizer's gradients wait for theirs, a closure, a step before any loss was scaled.
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


def _gradient_marks(optimizer: Any) -> list:
    """Identity and version counter of each gradient: equal marks mean nothing replaced or wrote the gradients."""
    return [
        None if p.grad is None else (weakref.ref(p.grad), p.grad._version)
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def _same_gradients(optimizer: Any, marks: list) -> bool:
    """Whether ``optimizer``'s gradients are still the ones ``marks`` (:func:`_gradient_marks`) describe."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    return len(grads) == len(marks) and all([
        (g is None and m is None) if g is None or m is None else (m[0]() is g and m[1] == g._version)
        for g, m in zip(grads, marks)
    ])


class GradScalerRecipe:
    """Drives a gradient scaler (``torch.amp.GradScaler``, FSDP's ``ShardedGradScaler``) through PyTorch's AMP recipe
    with one update rule (the module's table).

    Example::

        recipe = GradScalerRecipe(torch.amp.GradScaler("cpu"))
        recipe.track(optimizer)
        for batch in batches:
            recipe.scale(loss_fn(model(batch))).backward()
            recipe.after_backward()
            recipe.unscale(optimizer)  # before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            recipe.step(optimizer)  # the fit's last optimizer stepped: `scaler.update()` follows
        recipe.end_fit()

    A user's own ``scaler.unscale_(opt)`` (with the optimizer or a tracked wrapper of it) is torch's stage, read as it
    is: PyTorch's recipe followed to the letter gives the recipe's result.
    """

    def __init__(self, scaler: Any, api: _RunAPI = _FABRIC_API) -> None:
        self.scaler = scaler
        self._torch = _TorchScaler(scaler)
        self._api = api
        # the fit's optimizers by id: a weak reference, and the wrappers a user may hand to `scaler.unscale_` instead
        self._fit: dict[int, tuple[weakref.ref, list]] = {}
        # since the last update: whether an inf check was recorded, the fit's optimizers that stepped, and the
        # optimizers unscaled and not stepped (weakly)
        self._owed = False
        self._stepped: set[int] = set()
        self._unscaled: dict[int, weakref.ref] = {}
        self._updates = 0
        self._scaled_losses = 0
        # per optimizer id: (scaled losses, weak first gradient, its version) at its last step, which tell a clip or a
        # step after the step with no backward since
        self._step_marks: dict[int, tuple] = {}
        # per optimizer id, gradient marks (`_gradient_marks`): of the fit's optimizers at the last update (several);
        # `_stale`: gradients that carry another scale than the current one, (optimizer, unscaled?, marks at the
        # update); `reach_marks`: before a scaled backward, (optimizer, error, marks) of gradients it must not reach;
        # `_refused`: (optimizer, error, marks) of gradients a backward reached anyway, refused until written
        self._update_marks: dict[int, list] = {}
        self._stale: dict[int, tuple] = {}
        self.reach_marks: dict[int, tuple] = {}
        self._refused: dict[int, tuple] = {}
        # the skip signal: per optimizer id, whether its last step was skipped (a fused one's inf check, read on ask)
        self._last_skip: dict[int, Union[bool, Tensor]] = {}
        self._skipped = 0
        self._fused_found_infs: list[Tensor] = []
        self._fused_skipped: Optional[Tensor] = None
        self._step_ran = False
        self._step_hooks: dict[int, Any] = {}
        # the opt-in misuse watch (`watch_unscaled_backward`); `None`: off, nothing on the parameters
        self.watch: Optional[Any] = None

    # ---- the fit ------------------------------------------------------------------------------------------------

    def track(self, optimizer: Any, wrapper: Optional[Any] = None) -> None:
        """``optimizer`` (and ``wrapper``, which a user may hand to ``scaler.unscale_``) belongs to this fit."""
        key = id(optimizer)
        if key not in self._fit:
            self._fit[key] = (weakref.ref(optimizer, functools.partial(_forget, weakref.ref(self), key)), [])
        if wrapper is not None:
            self._fit[key][1].append(weakref.ref(wrapper))

    def end_fit(self) -> None:
        """Training ends: the owed update is applied, and this fit's optimizers are forgotten."""
        self.settle()
        self._fit.clear()
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks.clear()
        self._step_marks.clear()
        self._update_marks.clear()
        self._stale.clear()
        self.unwatch()

    # ---- events -------------------------------------------------------------------------------------------------

    def scale(self, loss: Tensor) -> Tensor:
        """A loss is about to be backpropagated: apply the owed update unless gradients wait for it, then scale.

        The caller runs the backward, then :meth:`after_backward` if :attr:`reach_marks` holds anything.
        """
        if self._owed and not self._gradients_wait():
            self.settle()
        elif not self._owed:
            self._stepped.clear()  # steps without gradients owe nothing: this backward's gradients start the cycle
        self._scaled_losses += 1
        if self._unscaled or self._stale or self._stepped or self._refused:
            self._mark_before_backward()
        return self.scaler.scale(loss)

    def _gradients_wait(self) -> bool:
        """Rule (b): whether an optimizer of the fit that has not stepped since the last update holds gradients
        produced since then."""
        for key, (ref, wrappers) in self._fit.items():
            optimizer = ref()
            if optimizer is None or key in self._stepped:
                continue
            if self._torch.stage(optimizer, wrappers)[0] is OptState.STEPPED:
                continue
            marks = self._update_marks.get(key)
            if _has_gradients(optimizer) and (marks is None or not _same_gradients(optimizer, marks)):
                return True
        return False

    def _mark_before_backward(self) -> None:
        """Before a scaled backward (:meth:`after_backward` compares): gradients of another scale (unscaled, or left
        from before the update), of optimizers that stepped while the update waits, and refused ones must not be
        reached; an optimizer that stepped without gradients and is reached has not stepped on them."""
        for key, (ref, _, marks) in list(self._stale.items()):
            optimizer = ref()
            if optimizer is not None and _same_gradients(optimizer, marks):
                self.reach_marks[key] = (ref, _mixed_scales_error, marks)
            else:  # written since the update (cleared): a fresh cycle, as torch reads it
                del self._stale[key]
        for key, (ref, error, marks) in list(self._refused.items()):
            optimizer = ref()
            if optimizer is not None and _same_gradients(optimizer, marks):
                self.reach_marks[key] = (ref, error, marks)
            else:  # written since (cleared): nothing mixed remains
                del self._refused[key]
        for key, ref in self._unscaled.items():
            if (optimizer := ref()) is not None:
                self.reach_marks[key] = (ref, _mixed_scales_error, _gradient_marks(optimizer))
        for key in self._stepped:
            if key in self._fit and (optimizer := self._fit[key][0]()) is not None:
                error = None if self._step_marks[key][1] is _NO_GRADIENT else _stepped_again_error  # a plain step: none
                self.reach_marks[key] = (weakref.ref(optimizer), error, _gradient_marks(optimizer))

    def after_backward(self) -> None:
        """The backward of a scaled loss ended: gradients it reached that it must not have are refused until written."""
        for key, (ref, error, marks) in self.reach_marks.items():
            optimizer = ref()
            if optimizer is not None and not _same_gradients(optimizer, marks):
                self._stepped.discard(key)
                if error is not None:
                    self._refused[key] = (ref, error, _gradient_marks(optimizer))
                    self._stale.pop(key, None)
        self.reach_marks.clear()

    def unscale(self, optimizer: Optimizer, required: bool = True) -> None:
        """Unscale ``optimizer``'s gradients unless they are true ones already (see the module's table).

        Args:
            optimizer: the ``torch.optim`` optimizer whose gradients to unscale.
            required: whether the caller needs true gradients (clipping): an optimizer that unscales inside its own
                ``step()`` then raises, since its gradients cannot be unscaled before the step without being unscaled
                twice.

        """
        if getattr(optimizer, "_step_supports_amp_scaling", False) and _takes_grad_scaler(type(optimizer).step):
            if required:
                raise _unscales_itself_error(optimizer)
            return
        key = id(optimizer)
        if self.watch is not None or key in self._refused or key in self._stale:
            self._refuse(optimizer)
            stale = self._stale.get(key)
            if stale is not None and not stale[1]:
                raise _stale_error(optimizer, unscaled=False)
        if key in self._unscaled or key in self._stale:
            return  # unscaled already (in this cycle, or before the last update and not written since)
        stage = self._torch.stage(optimizer, self._fit[key][1] if key in self._fit else ())[0]
        mark, grad = self._step_marks.get(key), optimizer.param_groups[0]["params"][0].grad
        if stage is not OptState.READY or (
            mark is not None
            and mark[1]() is grad
            and (grad is None or mark[0] == self._scaled_losses or mark[2] == grad._version)
        ):
            return  # the user's own unscale, a step since the update, or no backward reached it since its step (a clip
            # after `opt.step()`): the gradients are true ones already
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
        self._owed = True
        self._unscaled[id(optimizer)] = weakref.ref(optimizer)

    def _refuse(self, optimizer: Any) -> None:
        """The refusals before an unscale or a step, which change nothing; gradients written since are forgiven."""
        key = id(optimizer)
        if self.watch is not None:
            self.watch.refuse(f"`{type(optimizer).__name__}`'s unscale or step", optimizer)
        refused = self._refused.get(key)
        if refused is not None:
            if _same_gradients(optimizer, refused[2]):
                raise refused[1](optimizer)
            del self._refused[key]  # written since (cleared): nothing mixed remains
        stale = self._stale.get(key)
        if stale is not None and not _same_gradients(optimizer, stale[2]):
            del self._stale[key]  # written since the update (cleared, computed again): a fresh cycle

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step ``optimizer`` through the scaler, which unscales first if nobody did and skips the step on inf/NaN.

        Raises:
            RuntimeError: for a closure (as torch's scaler), gradients that mix two scales, gradients unscaled before
                the last update, or a second step while other gradients wait for the update. Nothing is changed then.

        """
        if kwargs.get("closure") is not None:
            raise _closure_error(optimizer)
        key = id(optimizer)
        if self.watch is not None or key in self._refused or key in self._stale:
            self._refuse(optimizer)
            if key in self._stale:
                raise _stale_error(optimizer, unscaled=self._stale[key][1])
        if key in self._unscaled:
            stage, holder = OptState.UNSCALED, optimizer
        else:
            stage, holder = self._torch.stage(optimizer, self._fit[key][1] if key in self._fit else ())
            stepped_at = self._step_marks.get(key, (self._scaled_losses,))[0]
            if stage is OptState.STEPPED and stepped_at != self._scaled_losses:
                raise _stepped_again_error(optimizer)
        in_kernel = getattr(optimizer, "_step_supports_amp_scaling", False)
        unscales_itself = in_kernel and _takes_grad_scaler(type(optimizer).step)
        if stage is OptState.READY and not unscales_itself:
            mark, grad = self._step_marks.get(key), optimizer.param_groups[0]["params"][0].grad
            if mark is not None and grad is not None and mark[1]() is grad and mark[2] == grad._version:
                # untouched since its last step: the true gradients it stepped on, skipped as that step was
                skipped = self.step_was_skipped(optimizer)
                return self._after_step(optimizer, None if skipped else self._own_step(optimizer, kwargs), skipped)
            if not (self._torch.sharded or _has_gradients(optimizer)):  # nothing to unscale or skip on
                return self._after_step(optimizer, self._own_step(optimizer, kwargs), skipped=False)
            self._unscale(optimizer)
        if in_kernel and isinstance(optimizer, SGD):
            _protect_fused_sgd_momentum(optimizer)
        if not in_kernel and key not in self._step_hooks:
            self._step_hooks[key] = optimizer.register_step_post_hook(functools.partial(_step_ran, weakref.ref(self)))
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
        self._owed = True
        # the skip signal: torch decided on the host whether `step()` ran; a fused kernel decides on the device, whose
        # inf check is read only when asked
        return self._after_step(optimizer, output, self._torch.found_inf(holder) if in_kernel else not self._step_ran)

    def _own_step(self, optimizer: Any, kwargs: dict) -> Any:
        """The optimizer's own step, where the scaler's cannot take it (the opt-in watch knows it is the recipe's)."""
        if self.watch is None:
            return optimizer.step(**kwargs)
        with self.watch.recipe_step(optimizer):
            return optimizer.step(**kwargs)

    def _after_step(self, optimizer: Any, output: Any, skipped: Union[bool, Optional[Tensor]]) -> Any:
        key = id(optimizer)
        if skipped is None or isinstance(skipped, bool):
            self._last_skip[key] = bool(skipped)
            self._skipped += bool(skipped)
        else:
            self._last_skip[key] = skipped
            self._fused_found_infs.append(skipped)
            if len(self._fused_found_infs) >= 64:  # bounded: fold on the device
                folded = torch.stack(self._fused_found_infs).gt(0).sum()
                self._fused_skipped = folded if self._fused_skipped is None else self._fused_skipped + folded
                self._fused_found_infs = []
        self._unscaled.pop(key, None)
        # the first parameter's gradient, weakly, and its version: replaced or written means new gradients
        grad = optimizer.param_groups[0]["params"][0].grad
        n = self._scaled_losses
        self._step_marks[key] = (n, _NO_GRADIENT, -1) if grad is None else (n, weakref.ref(grad), grad._version)
        if key in self._fit:
            self._stepped.add(key)
            if self._fit.keys() <= self._stepped:
                self.settle()
        elif not self._fit:  # nobody declared the fit's optimizers: each step is its own, as in stock Lightning
            self.settle()
        return output

    def settle(self) -> None:
        """Apply the owed update, if any: rule (c), at a training iteration's end (also when it raised)."""
        if not (self._owed or self._torch.recorded()):
            self._stepped.clear()
            return
        # gradients that keep another scale than the one the update leaves: unscaled and not stepped (true ones), or
        # produced since the last update by optimizers of the fit that did not step (an iteration's end)
        for key, ref in self._unscaled.items():
            if (optimizer := ref()) is not None and _has_gradients(optimizer):
                self._stale[key] = (ref, True, _gradient_marks(optimizer))
        for key, (ref, wrappers) in self._fit.items():
            optimizer = ref()
            if optimizer is None or key in self._stepped or key in self._unscaled or not _has_gradients(optimizer):
                continue
            marks = self._update_marks.get(key)
            if marks is None or not _same_gradients(optimizer, marks):
                if self._torch.stage(optimizer, wrappers)[0] is OptState.READY:
                    self._stale[key] = (ref, False, _gradient_marks(optimizer))
        if len(self._fit) > 1:
            self._update_marks = {key: _gradient_marks(o) for key, (ref, _) in self._fit.items() if (o := ref())}
        self.scaler.update()
        self._owed = False
        self._stepped.clear()
        self._unscaled.clear()
        self._updates += 1
        if self.watch is not None and self._updates >= self.watch.ends_at_update and not self.watch.accumulations:
            self.unwatch()

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
        """Continue from ``state_dict``: the owed update is consumed, and every optimizer starts a fresh cycle."""
        self.settle()
        self.scaler.load_state_dict(state_dict)
        self._update_marks.clear()
        self._stale.clear()

    # ---- the opt-in misuse watch ----------------------------------------------------------------------------------

    def watch_unscaled_backward(self, optimizers: Any) -> None:
        """Switch the misuse watch on (:mod:`~lightning.fabric.plugins.precision.amp_misuse_watch`) for
        ``optimizers`` for the next ``WATCHED_UPDATES`` scaler updates. Costs one Python call per parameter per
        backward while on."""
        from lightning.fabric.plugins.precision.amp_misuse_watch import WATCHED_UPDATES, _UnscaledBackwardWatch

        if not self.scaler.is_enabled():
            return
        if self.watch is None:
            self.watch = _UnscaledBackwardWatch(lambda o: self._torch.stage(o)[0] is OptState.READY, self._api)
        self.watch.watch(optimizers, ends_at_update=self._updates + WATCHED_UPDATES)

    @property
    def watched(self) -> int:
        """How many optimizers and parameters the misuse watch holds a hook on (0 when it is off)."""
        return 0 if self.watch is None else self.watch.watching

    def unwatch(self) -> None:
        if self.watch is not None:
            self.watch.unwatch()
            self.watch = None

    # ---- signals ------------------------------------------------------------------------------------------------

    def step_was_skipped(self, optimizer: Optimizer, sync: bool = True) -> bool:
        """Whether the last :meth:`step` of ``optimizer`` was skipped because its gradients held inf/NaN.

        ``False`` before its first step and for a step without gradients. A fused optimizer (whose kernel checks for
        inf/NaN) is answered by reading its inf check from the device; with ``sync=False`` it reads as not skipped
        instead (a step-interval scheduler's check, which must not synchronise every step).

        """
        last = self._last_skip.get(id(optimizer), False)
        if isinstance(last, bool):
            return last
        return sync and bool(last.item() > 0)

    def forget_last_step(self, optimizer: Optimizer) -> None:
        """``optimizer`` did not step in this iteration (nothing to step on): no step of it was skipped."""
        self._last_skip.pop(id(optimizer), None)

    @property
    def update_owed(self) -> bool:
        """Whether inf checks were recorded since the last ``scaler.update()``."""
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
        # launchers pickle plugins (`ddp_spawn`): the fit, hooks and weak references stay in this process
        state = self.__dict__.copy()
        state.update(
            _fit={}, _unscaled={}, _step_hooks={}, _step_marks={}, _update_marks={}, _stale={}, reach_marks={},
            _refused={}, watch=None,
        )
        return state


def _NO_GRADIENT() -> None:
    return None


def _forget(recipe_ref: "weakref.ref[GradScalerRecipe]", key: int, _: Any) -> None:
    # a fit's optimizer was collected: its id is free for the next object
    recipe = recipe_ref()
    if recipe is not None:
        recipe._fit.pop(key, None)
        recipe._stepped.discard(key)


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
        f"Step {type(optimizer).__name__} before the next backward, or zero its gradients"
        " (`zero_grad()`) before it: its gradients were unscaled (by gradient clipping or `scaler.unscale_`) but it"
        " did not step before a later backward added new gradients multiplied by the loss scale, so they now mix two"
        " scales. With a"
        " gradient scaler, clip or unscale only in iterations that step the optimizer. Nothing was changed."
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


def _stale_error(optimizer: Any, unscaled: bool) -> RuntimeError:
    if unscaled:
        where, why = "clips or unscales", (
            "they were unscaled before the loss scale was updated, and the optimizer steps on them only now"
        )
    else:
        where, why = "whose backward produced", (
            "they were multiplied by a loss scale that the scaler has updated since (at the end of an iteration), so no"
            " unscale can give the true gradients"
        )
    return RuntimeError(
        f"Step {type(optimizer).__name__} in the iteration that {where} its gradients, or zero them and compute them"
        f" again: {why}. The step was not taken."
    )


def _stepped_again_error(optimizer: Any) -> RuntimeError:
    return RuntimeError(
        f"Zero the gradients of the optimizers that have not stepped yet before this backward, or step them first:"
        f" {type(optimizer).__name__} stepped, and a backward for its next step ran while another optimizer of the fit"
        " held gradients produced since the last scaler update. The update its first step owes could not be applied"
        " without unscaling those gradients with a scale that did not scale them, and torch's scaler refuses a second"
        " step before the update. The step was not taken."
    )
