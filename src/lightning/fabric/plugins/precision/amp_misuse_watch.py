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
"""The opt-in misuse watch of a gradient scaler's recipe (``MixedPrecision(..., watch_misuse=True)``).

Off by default, like ``torch.autograd.detect_anomaly``: it puts a hook on every parameter of the run. Switched on, it
refuses gradients that a backward *without* the loss scale accumulated next to scaled ones (``loss.backward()`` for one
loss, ``self.manual_backward(loss)`` / ``fabric.backward(loss)`` for another), and a ``step()`` of the raw optimizer on
gradients still multiplied by the scale, for the first :data:`WATCHED_UPDATES` scaler updates of a fit.

Without it, only the checks that cost nothing per step run (in the recipe): a step with gradients while the scaler has
scaled nothing yet, a disabled scaler, LBFGS. PyTorch's recipe written by hand with the plugin's scaler
(``scaler.scale(loss).backward()``) is a backward the watch cannot see: with the watch on, use the plugin's backward.

Example::

    plugin = MixedPrecision("16-mixed", "cuda", watch_misuse=True)
    trainer = Trainer(plugins=[plugin])  # `loss.backward()` next to `self.manual_backward(...)` now raises

"""

import functools
import threading
import weakref
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from lightning.fabric.plugins.precision.amp_recipe import GradScalerRecipe
from lightning.fabric.plugins.precision.amp_torch_scaler import OptState

#: how many scaler updates the watch stays on once armed (each fit, each `fabric.setup`): a loop's misuse shows in its
#: first iterations, and afterwards the watch costs nothing per step
WATCHED_UPDATES = 8


class _WatchedRecipe(GradScalerRecipe):
    """The recipe with the misuse watch around it, which the plugins make for ``watch_misuse=True``: a parameter
    accumulated outside :meth:`scaled_backward` (``loss.backward()``) is recorded, and its optimizer's next unscale or
    step, and the next scaled backward, refuse while its gradients are live; a ``step()`` of the raw optimizer on
    gradients still multiplied by the scale refuses too. Gradients assigned to ``.grad`` are not accumulations. The
    hooks stay for :data:`WATCHED_UPDATES` updates after :meth:`watch_unscaled_backward`, held weakly with what they
    watch. :attr:`watch` is this object while armed, ``None`` otherwise.

    Example::

        recipe = _WatchedRecipe(torch.amp.GradScaler("cpu"), _FABRIC_API)
        recipe.watch_unscaled_backward([optimizer])
        with recipe.watch.scaled_backward():
            recipe.scale(loss).backward()

    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watched: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.accumulations: dict[int, Tensor] = {}
        # this run's scaled backwards in flight (another run's hide nothing): while one is, every accumulation of the
        # run carries the scale, in any thread, since the autograd engine runs a CUDA loss's nodes on threads of its
        # own. A backward without the scale concurrent with a scaled one goes unseen: a missed misuse, never a false
        # error
        self._lock = threading.Lock()
        self._in_flight = 0
        self._recipe_steps: set[int] = set()
        self.ends_at_update = 0

    def watch_unscaled_backward(self, optimizers: Any) -> None:
        """Arm the watch on ``optimizers`` for the next :data:`WATCHED_UPDATES` scaler updates. Costs one Python call
        per parameter per backward while on."""
        if not self.scaler.is_enabled():
            return
        self.watch, self.ends_at_update, this = self, self.updates + WATCHED_UPDATES, weakref.ref(self)
        for optimizer in optimizers:
            if optimizer not in self._watched:
                self._watched[optimizer] = optimizer.register_step_pre_hook(functools.partial(_raw_step_pre_hook, this))
            for p in (p for group in optimizer.param_groups for p in group["params"] if p.requires_grad):
                if p not in self._watched:
                    self._watched[p] = p.register_post_accumulate_grad_hook(functools.partial(_accumulated, this))

    @property
    def watched(self) -> int:
        """How many optimizers and parameters the watch holds a hook on (0 when it is off)."""
        return len(self._watched)

    def unwatch(self) -> None:
        for handle in list(self._watched.values()):
            handle.remove()
        self._watched.clear()
        self.accumulations.clear()
        self.watch = None

    @contextmanager
    def scaled_backward(self) -> Generator[None, None, None]:
        """A backward of a loss the scaler scaled: what it accumulates carries the scale."""
        self.refuse("a scaled backward")
        with self._lock:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def refuse(self, where: str, optimizer: Optional[Any] = None) -> None:
        """Raise if parameters (of ``optimizer``, or any) hold live gradients a backward without the scale
        accumulated; forget those that were cleared since."""
        if not self.accumulations:
            return
        params = None if optimizer is None else {id(p) for group in optimizer.param_groups for p in group["params"]}
        live = []
        for key, p in list(self.accumulations.items()):
            if params is None or key in params:
                if _holds_live_gradients([p.grad]):
                    live.append(p)
                else:  # cleared since: nothing unscaled remains
                    del self.accumulations[key]
        if live:
            raise RuntimeError(
                f"Call `{self._api.backward}` instead of `loss.backward()` (or `torch.autograd.backward`) for every"
                " loss of the step: with a gradient scaler every backward must go through it. The misuse watch found"
                f" gradients that a backward without the loss scale accumulated ({len(live)} parameter tensor(s)) at"
                f" {where}; the step would divide them by the scale. Nothing was changed."
            )

    def unscale(self, optimizer: Optimizer, before_step: bool = False) -> None:
        self.refuse(f"`{type(optimizer).__name__}`'s unscale or step", optimizer)
        super().unscale(optimizer, before_step)

    def step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        self.refuse(f"`{type(optimizer).__name__}`'s unscale or step", optimizer)
        return super().step(optimizer, **kwargs)

    def _own_step(self, optimizer: Any, kwargs: dict) -> Any:
        self._recipe_steps.add(id(optimizer))  # the recipe's own step: not a raw one
        try:
            return super()._own_step(optimizer, kwargs)
        finally:
            self._recipe_steps.discard(id(optimizer))

    def _update(self) -> None:
        super()._update()
        if self.watch is not None and self.updates >= self.ends_at_update and not self.accumulations:
            self.unwatch()

    def end_fit(self) -> None:
        super().end_fit()
        self.unwatch()

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "watch": None, "_watched": None, "_lock": None, "accumulations": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _watched=WeakIdKeyDictionary(), _lock=threading.Lock())

    def _check_raw_step(self, optimizer: Any) -> None:
        if id(optimizer) in self._recipe_steps or hasattr(optimizer, "found_inf"):
            return  # our step, or inside the user's own `scaler.step` of a fused optimizer
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        if self._torch.stage(optimizer)[0] is OptState.READY and _holds_live_gradients(grads):
            raise RuntimeError(
                f"Step the optimizer {self._api.optimizer} returns (or drive the scaler yourself:"
                f" `scaler.unscale_(opt)` or `scaler.step(opt)`): `{type(optimizer).__name__}.step()` was called on the"
                " raw optimizer, whose gradients are still multiplied by the loss scale, so the scaler neither unscaled"
                " them nor checked them for inf/NaN. The step was not taken."
            )


def _holds_live_gradients(grads: list) -> bool:
    """Whether any of ``grads`` holds a non-zero (``zero_grad(set_to_none=False)`` leaves zeros, which are not live),
    read in one device synchronisation: the watch is opt-in, as ``detect_anomaly`` is."""
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads if g is not None]
    return bool(grads) and bool(torch.stack([g.ne(0).any().to(grads[0].device) for g in grads]).any())


def _accumulated(watch_ref: "weakref.ref[_WatchedRecipe]", param: Tensor) -> None:
    watch = watch_ref()
    if watch is not None and not watch._in_flight:
        watch.accumulations[id(param)] = param


def _raw_step_pre_hook(watch_ref: "weakref.ref[_WatchedRecipe]", optimizer: Optimizer, *_: Any) -> None:
    watch = watch_ref()
    if watch is not None:
        watch._check_raw_step(optimizer)
