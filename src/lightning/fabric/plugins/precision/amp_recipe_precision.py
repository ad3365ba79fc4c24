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
"""The gradient scaler's part of the precision plugins that may scale the loss, in Fabric and in the Trainer: one
implementation of PyTorch's AMP recipe, through :class:`~lightning.fabric.plugins.precision.amp_recipe.
GradScalerRecipe`."""

from typing import Any, Optional

from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning.fabric.plugins.precision.amp_recipe import _FABRIC_API, GradScalerRecipe, _RunAPI
from lightning.fabric.plugins.precision.amp_torch_scaler import _check_scaler_is_enabled
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.utilities.types import Optimizable


_LBFGS_MESSAGE = (
    "Use `precision='bf16-mixed'` or `'32-true'` with LBFGS: AMP with a gradient scaler and the LBFGS optimizer are not"
    " compatible, since LBFGS evaluates its closure several times per step and reads the gradients in between, which"
    " the scaler cannot unscale."
)


class _ScalerRecipeHolder:
    """What every precision plugin that may drive a gradient scaler holds, in the Trainer as in Fabric: the
    :class:`GradScalerRecipe` of its ``scaler``, which knows the fit's optimizers and their wrappers
    (``LightningOptimizer``, Fabric's optimizer wrapper) from :meth:`track_optimizer_wrapper`.

    Subclasses set ``scaler`` and call :meth:`_init_amp_recipe` in ``__init__``.

    """

    scaler: Optional[Any]
    #: what a step of LBFGS under the scaler raises: the type each package raised before
    _lbfgs_error: type[Exception] = TypeError
    #: what the user calls, for the errors
    _run_api: _RunAPI = _FABRIC_API

    def _init_amp_recipe(self) -> None:
        self._scaler_recipe: Optional[GradScalerRecipe] = None
        # between the Trainer's `training_iteration_start` and `_end`: a checkpoint saved then keeps the scale the
        # iteration's steps used (the Trainer re-runs the iteration on resume)
        self._in_iteration = False
        #: whether the opt-in misuse watch (`amp_misuse_watch`) runs: off by default, it puts a hook on every parameter
        self.watch_misuse = False

    def _check_scaler(self) -> None:
        """Before training: refuse a scaler torch disabled (constructing the plugin on a machine without the scaler's
        device is fine, training with it is not)."""
        _check_scaler_is_enabled(self.scaler, f"`{type(self).__name__}`")

    @property
    def _recipe(self) -> GradScalerRecipe:
        """The recipe of the current ``scaler``, made again if the scaler was replaced. The per-step paths read
        ``self._scaler_recipe or self._recipe`` (a property is a call per use); a replaced scaler's recipe is dropped at
        each training iteration's start and by Fabric's backward, and made again here at a fit's setup."""
        recipe = self._scaler_recipe
        if recipe is None or recipe.scaler is not self.scaler:
            if self.watch_misuse:  # the opt-in watch wraps the recipe
                from lightning.fabric.plugins.precision.amp_misuse_watch import _WatchedRecipe

                recipe = _WatchedRecipe(self.scaler, self._run_api)
            else:
                recipe = GradScalerRecipe(self.scaler, self._run_api)
            self._scaler_recipe = recipe
        return recipe

    def teardown(self) -> None:
        """Training ends: the owed update is applied, the watch goes, and this fit's optimizers are forgotten (a second
        fit with this plugin has its own)."""
        self._in_iteration = False
        if self._scaler_recipe is not None:
            self._scaler_recipe.end_fit()
        super().teardown()  # type: ignore[misc]

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        # the state the run continues with, the owed update included (a save changes nothing); inside a Trainer's
        # iteration (a checkpoint from `training_step` or a step hook) the scale its steps used: the Trainer runs that
        # iteration again on resume
        return self._recipe.state_dict(include_owed_update=not self._in_iteration)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self._recipe.load_state_dict(state_dict)

    def training_iteration_start(self) -> None:
        """A loop opens a training iteration (the precision plugins' hook of both packages)."""
        self._in_iteration = True
        recipe = self._scaler_recipe
        if recipe is not None:
            if recipe.scaler is not self.scaler:  # replaced (a callback's `on_train_start`): its recipe comes next
                self._scaler_recipe = None
            else:
                # a backward the recipe cannot see (the user's own `scaler.scale(loss)`) may run in this iteration: a
                # clip or a step in it is no longer "right after the last step"
                recipe.backwards += 1

    def training_iteration_end(self) -> None:
        """A loop closes a training iteration, also when it raised: the owed update is applied."""
        self._in_iteration = False
        recipe = self._scaler_recipe
        if recipe is not None and recipe.scaler is self.scaler:  # no recipe for this scaler yet: nothing is owed
            recipe.settle()

    def track_optimizer_wrapper(self, wrapper: Any) -> None:
        if self.scaler is not None:
            self._recipe.track(wrapper.optimizer, wrapper)


class _AMPRecipePrecision(_ScalerRecipeHolder, Precision):
    """The gradient scaler's part of a Fabric precision plugin that may scale the loss (``MixedPrecision``,
    ``FSDPPrecision``), through :class:`~lightning.fabric.plugins.precision.amp_recipe.GradScalerRecipe`.

    Fabric's loop belongs to the user: where the ``scaler.update()`` a step owes comes is the recipe's rule table.
    ``state_dict`` (what ``fabric.save`` stores) holds the state the run continues with, the owed update included, and
    changes nothing. A step or clipping before any loss was scaled (``loss.backward()`` instead of
    ``fabric.backward(loss)``) raises; ``watch_misuse=True`` watches for more
    (:mod:`~lightning.fabric.plugins.precision.amp_misuse_watch`).

    """

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self.scaler is None:
            return super().backward(tensor, model, *args, **kwargs)
        recipe = self._scaler_recipe
        if recipe is None or recipe.scaler is not self.scaler:  # the first backward (of this scaler): nothing changed
            self._check_scaler()
            recipe = self._recipe
        tensor = recipe.scale(tensor)
        if recipe.watch is None:
            super().backward(tensor, model, *args, **kwargs)
        else:
            with recipe.watch.scaled_backward():
                super().backward(tensor, model, *args, **kwargs)
        if recipe.reach_marks:
            recipe.after_backward()
        return None

    @override
    def track_optimizer_wrapper(self, wrapper: Any) -> None:
        super().track_optimizer_wrapper(wrapper)
        if self.scaler is not None and self.scaler.is_enabled() and self.watch_misuse:
            # opt-in: `loss.backward()` next to `fabric.backward(loss)`, or a step of the raw optimizer, would leave
            # gradients the scaler did not scale, or step on scaled ones: both raise instead of training silently wrong
            self._recipe.watch_unscaled_backward([wrapper.optimizer])

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise self._lbfgs_error(_LBFGS_MESSAGE)
        recipe = self._scaler_recipe or self._recipe
        # the scaler skips the step if the gradients hold inf/NaN
        return recipe.step(optimizer, **kwargs)  # type: ignore[arg-type]

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is None:
            return
        recipe = self._scaler_recipe or self._recipe
        recipe.unscale(optimizer)

    @override
    def optimizer_step_was_skipped(self, optimizer: Optimizable) -> bool:
        if self.scaler is None:
            return False
        return self._recipe.step_was_skipped(optimizer)  # type: ignore[arg-type]
