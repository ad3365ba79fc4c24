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
"""The Trainer's side of PyTorch's AMP recipe, shared by the precision plugins that autocast and scale.

:class:`~lightning.pytorch.plugins.precision.MixedPrecision` and
:class:`~lightning.pytorch.plugins.precision.FSDPPrecision` both run forward code under autocast and may hold a
gradient scaler. :class:`_AMPRecipePrecision` is their one implementation of everything around the forward code:
backward, clipping and the optimizer step with autocast off, a closure's forward under autocast again, autocast's weight
cache cleared after each step, and the scaler driven through
:class:`~lightning.fabric.plugins.precision.amp_recipe.GradScalerRecipe` (unscale once before gradients are read, one
update rule, the skip signal).
"""

from functools import partial
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning.fabric.plugins.precision.amp_recipe import _TRAINER_API
from lightning.fabric.plugins.precision.amp_recipe_precision import _LBFGS_MESSAGE, _ScalerRecipeHolder
from lightning.fabric.plugins.precision.amp_torch_scaler import _autocast_off
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.core.optimizer import LightningOptimizer, do_nothing_closure
from lightning.pytorch.plugins.precision.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException


class _AMPRecipePrecision(_ScalerRecipeHolder, Precision):
    """Backward, clipping and optimizer steps of a precision plugin that autocasts forward code and may scale the loss:
    each runs with autocast off (``_autocast_off``), which a closure's forward turns back on.

    Subclasses set ``scaler`` (a ``GradScaler`` or ``None``), ``precision`` and ``cache_enabled`` (whether their
    autocast caches casts, which must then be cleared after each step), and call :meth:`_init_amp_recipe` in
    ``__init__``.

    """

    scaler: Optional[Any]
    _lbfgs_error = MisconfigurationException
    _run_api = _TRAINER_API
    # whether the subclass's autocast caches casts; off unless it says so
    cache_enabled: bool = False

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        self._check_scaler()
        module = next((m for m in model.modules() if isinstance(m, pl.LightningModule)), None)
        manual = module is not None and not module.automatic_optimization
        self._on_optimization_mode(manual)
        if manual and self.scaler is not None and self.watch_misuse:
            # opt-in: `loss.backward()` next to `self.manual_backward(loss)`, or a step of the raw optimizer, would
            # leave gradients the scaler did not scale, or step on scaled ones: both raise instead of training wrong
            self._recipe.watch_unscaled_backward(optimizers)
        return super().connect(model, optimizers, lr_schedulers)

    def _on_optimization_mode(self, manual: bool) -> None:
        """At ``connect``: whether the LightningModule optimizes manually, for a subclass that adapts to it."""

    def _in_forward_context(self, closure: Callable[[], Any]) -> Any:
        with self.forward_context():
            return closure()

    @override
    def pre_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        with _autocast_off():
            if self.scaler is not None:
                recipe = self._scaler_recipe or self._recipe
                tensor = recipe.scale(tensor)
            return super().pre_backward(tensor, module)

    @override
    def backward(  # type: ignore[override]
        self,
        tensor: Tensor,
        model: "pl.LightningModule",
        optimizer: Optional[Optimizable],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        recipe = None if self.scaler is None else self._scaler_recipe  # `pre_backward` made it, for this scaler
        watch = None if recipe is None else recipe.watch
        with _autocast_off():
            if watch is None:
                super().backward(tensor, model, optimizer, *args, **kwargs)
            else:
                with watch.scaled_backward():
                    super().backward(tensor, model, optimizer, *args, **kwargs)
        if recipe is not None and recipe.reach_marks:
            recipe.after_backward()
        if self.cache_enabled:
            # the graph that needed the cached casts is gone: free them now, as a run without the cache would
            torch.clear_autocast_cache()

    @override
    def post_backward(self, tensor: Tensor, module: "pl.LightningModule") -> Tensor:  # type: ignore[override]
        with _autocast_off():
            return super().post_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        automatic = model.automatic_optimization
        if not automatic and closure is not do_nothing_closure:
            # the user's closure holds forward code: it runs under autocast as the `training_step` body does
            closure = partial(self._in_forward_context, closure)
        with _autocast_off():
            if self.scaler is None:
                output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            else:
                output = self._scaled_optimizer_step(optimizer, model, closure, automatic, **kwargs)
        if self.cache_enabled:
            # the step changed the weights in place: casts cached before it are stale
            torch.clear_autocast_cache()
        return output

    def _scaled_optimizer_step(
        self,
        optimizer: Optimizable,
        model: "pl.LightningModule",
        closure: Callable[[], Any],
        automatic: bool,
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, LBFGS):
            raise self._lbfgs_error(_LBFGS_MESSAGE)
        loss = closure()  # in manual optimization the closure usually returns nothing
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        # a `training_step` that returned None in automatic optimization ran no backward: there is nothing to step on;
        # an `optimizer_step` override that ran the closure itself and calls `optimizer.step()` without it does step
        steps = not (automatic and loss is None and closure is not do_nothing_closure)
        recipe = self._scaler_recipe or self._recipe
        if steps:
            # true gradients for `on_before_optimizer_step` and clipping; fused optimizers too, since torch 2.1 then
            # steps them with `grad_scale=None`. Only optimizers that unscale inside `step()` themselves stay scaled.
            recipe.unscale(optimizer, before_step=True)
        self._after_closure(model, optimizer)
        if not steps:
            recipe.forget_last_step(optimizer)
            return loss
        # the scaler skips the step on inf/NaN gradients; the update it owes follows by the recipe's rule
        return recipe.step(optimizer, **kwargs)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> Optional[Tensor]:
        with _autocast_off():
            if clip_val > 0 and self.scaler is not None:
                # clip true gradients: in manual optimization the user clips before `opt.step()` unscales
                recipe = self._scaler_recipe or self._recipe
                recipe.unscale(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer)
            return super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients once per update, whoever asks first (idempotent)."""
        if self.scaler is not None:
            self._recipe.unscale(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer)

    @override
    def optimizer_step_was_skipped(self, optimizer: Optimizable) -> bool:
        if self.scaler is None:
            return False
        recipe = self._scaler_recipe or self._recipe  # asked after every step by a step-interval scheduler
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return recipe.step_was_skipped(optimizer)
