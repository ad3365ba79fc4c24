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
"""The gradient scaler's part of Fabric's precision plugins that may scale the loss (``MixedPrecision``,
``FSDPPrecision``): one implementation of PyTorch's AMP recipe, through
:class:`~lightning.fabric.plugins.precision.amp_recipe.GradScalerRecipe`."""

from typing import Any, Optional

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.plugins.precision.amp_recipe import _ScalerRecipeHolder
from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.utilities.types import Optimizable


class _AMPRecipePrecision(_ScalerRecipeHolder, Precision):
    """The gradient scaler's part of a Fabric precision plugin that may scale the loss (``MixedPrecision``,
    ``FSDPPrecision``): one implementation of PyTorch's AMP recipe through
    :class:`~lightning.fabric.plugins.precision.amp_recipe.GradScalerRecipe`.

    Fabric's loop belongs to the user. The single ``scaler.update()`` of an iteration follows the step of the last
    optimizer ``fabric.setup`` wrapped, so several optimizers fed by one backward are all unscaled with the scale that
    scaled their gradients. Unless the user marks an iteration (``with fabric.training_iteration():``), none is open
    (:attr:`IterationPhase.OUTSIDE`): an update still owed (an optimizer that did not step) is applied right before
    the next ``fabric.backward()`` scales a loss. Inside a marked iteration it waits for the iteration's end. The
    plugin's ``state_dict`` (what ``fabric.save`` stores) holds the state the run continues with, the owed update
    included, and changes nothing.

    A step or clipping before the scaler scaled any loss (``loss.backward()`` instead of ``fabric.backward(loss)``)
    raises. With ``watch_misuse=True`` the parameters of every optimizer ``fabric.setup`` wraps are watched too
    (:mod:`~lightning.fabric.plugins.precision.amp_misuse_watch`): gradients a backward the scaler did not scale
    accumulated next to scaled ones make the next step or clipping of their optimizer raise, and so does a ``step()``
    of the raw optimizer on gradients still multiplied by the scale.

    """

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self.scaler is None:
            return super().backward(tensor, model, *args, **kwargs)
        if self._scaler_recipe is None:  # the first backward: nothing has changed yet
            self._check_scaler()
        tensor = self._recipe.scale(tensor, self._known_optimizers)
        with self._recipe.backward():
            super().backward(tensor, model, *args, **kwargs)

    @override
    def track_optimizer_wrapper(self, wrapper: Any) -> None:
        super().track_optimizer_wrapper(wrapper)
        if self.scaler is not None and self.scaler.is_enabled() and self.watch_misuse:
            # opt-in: `loss.backward()` next to `fabric.backward(loss)`, or a step of the raw optimizer, would leave
            # gradients the scaler did not scale, or step on scaled ones: both raise instead of training silently wrong
            self._recipe.watch_unscaled_backward([wrapper.optimizer])

    @override
    def teardown(self) -> None:
        self._finish_amp_recipe()
        super().teardown()

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        self._refuse_lbfgs(optimizer)
        # the scaler skips the step if the gradients hold inf/NaN
        return self._recipe.step(optimizer, self._aliases(optimizer), **kwargs)  # type: ignore[arg-type]

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self._recipe.unscale(optimizer, self._aliases(optimizer))

    @override
    def optimizer_step_was_skipped(self, optimizer: Optimizable, sync: bool = True) -> bool:
        if self.scaler is None:
            return False
        return self._recipe.step_was_skipped(optimizer, sync)  # type: ignore[arg-type]

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        # what the run continues with: Fabric's loop may save anywhere in an iteration, and the save changes nothing
        return self._recipe.state_dict(include_owed_update=True)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self._recipe.load_state_dict(state_dict)
