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
"""PyTorch's AMP recipe for a :class:`torch.amp.GradScaler`, one training iteration at a time.

The recipe (torch's "Automatic Mixed Precision examples"): ``scaler.scale(loss).backward()``; ``scaler.unscale_(opt)``
before anything reads gradients; ``scaler.step(opt)`` for every optimizer; ``scaler.update()`` once per iteration, after
the last step. :class:`GradScalerRecipe` is the one place in Lightning that drives a scaler through it, so the Trainer's
and Fabric's precision plugins cannot drift apart; :class:`_AMPRecipePrecision` is Fabric's plugins' use of it.
"""

import functools
import inspect
import operator
import weakref
from collections.abc import Iterable
from typing import Any, Callable, Optional

import torch
from lightning_utilities.core.imports import compare_version
from torch import Tensor
from torch.amp.grad_scaler import OptState
from torch.nn import Module
from torch.optim import LBFGS, SGD, Optimizer
from typing_extensions import override

from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.utilities.types import Optimizable

# Autocast's weight cache went stale under ``torch.no_grad`` before pytorch#165068 (fixed in torch 2.11).
_AUTOCAST_CACHE_IS_SAFE = compare_version("torch", operator.ge, "2.11.0", use_base_version=True)


def _autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` in the current thread."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4: one API for every device type
        return torch.is_autocast_enabled(device_type)
    return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _handles_unscaling_itself(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` unscales by itself, ignoring whether ``GradScaler.unscale_`` already ran.

    Built-in fused optimizers (``fused=True``) honour the scaler's state since torch 2.1: ``GradScaler.step`` passes
    them ``grad_scale=None`` after ``unscale_``, so they can be unscaled like any other. Only the deprecated protocol of
    a ``grad_scaler`` keyword in ``step()`` leaves the unscaling to the optimizer.
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    step = getattr(type(optimizer), "step", None)
    if step is None:  # `step` set on the instance
        return "grad_scaler" in inspect.signature(optimizer.step).parameters
    return _takes_grad_scaler(step)


@functools.lru_cache(maxsize=None)
def _takes_grad_scaler(step: Any) -> bool:
    # once per class's `step`: `inspect.signature` is too slow for every optimizer step
    return "grad_scaler" in inspect.signature(step).parameters


class GradScalerRecipe:
    """Drives a :class:`torch.amp.GradScaler` through PyTorch's AMP recipe for one training iteration at a time.

    - :meth:`unscale` is idempotent: it unscales an optimizer's gradients once per step, whoever asks first (clipping,
      the optimizer step, or the user calling ``scaler.unscale_`` themselves, also through a wrapper of the optimizer).
    - :meth:`step` steps through the scaler. An optimizer stepped a second time in the same iteration keeps the
      iteration's scale, and the inf check of its first step still counts for the update.
    - :meth:`update` applies the iteration's single ``scaler.update()``; it does nothing when no step happened since
      the last update (gradient accumulation, a skipped ``training_step``).
    - :meth:`step_was_skipped` tells whether an optimizer's last step was skipped for inf/NaN gradients, fused
      optimizers included; :attr:`skipped_steps` counts the skipped steps on the scaler's device. Neither costs a device
      synchronisation until somebody reads it.

    Example::

        recipe = GradScalerRecipe(torch.amp.GradScaler("cpu"))
        recipe.scale(loss).backward()
        recipe.unscale(optimizer)  # before clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        recipe.step(optimizer)
        recipe.update()  # once per iteration, after the last step

    .. warning::
        It reads the scaler's per-optimizer state (``GradScaler._per_optimizer_states``), which has kept its shape
        since torch 1.6; it is the only way to know what the user already did through the scaler.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self._update_pending = False
        self._spent_states = 0
        self._found_inf: dict[int, torch.Tensor] = {}
        self._iteration_found_infs: list[torch.Tensor] = []
        # optimizers unscaled (by clipping) that have not stepped since
        self._unscaled: dict[int, Any] = {}
        self._skipped_steps: Optional[torch.Tensor] = None

    @property
    def update_pending(self) -> bool:
        """Whether an optimizer stepped since the last :meth:`update`."""
        return self._update_pending

    def scale(self, tensor: torch.Tensor, optimizers: Callable[[], Iterable[Any]] = tuple) -> torch.Tensor:
        """Multiply ``tensor`` (the loss) by the scale, once no optimizer holds unscaled gradients it did not step on.

        Args:
            tensor: the loss about to be backpropagated.
            optimizers: returns every optimizer (and wrapper) the caller knows of, to catch gradients the user
                unscaled with ``scaler.unscale_`` and then did not step on; called only when something was unscaled
                since the last update.

        Raises:
            RuntimeError: if an optimizer's gradients were unscaled but it did not step and they were not cleared: the
                backward would add scaled gradients to unscaled ones.

        """
        if self.scaler._per_optimizer_states:  # nothing was unscaled since the last update otherwise
            self._release_unscaled_without_step(optimizers)
        return self.scaler.scale(tensor)

    def _release_unscaled_without_step(self, optimizers: Callable[[], Iterable[Any]]) -> None:
        states = self.scaler._per_optimizer_states
        candidates = {id(o): o for o in (*self._unscaled.values(), *optimizers())}
        self._unscaled.clear()
        for key, optimizer in candidates.items():
            if self._stage(optimizer) is not OptState.UNSCALED:
                continue
            if any(p.grad is not None for group in optimizer.param_groups for p in group["params"]):
                raise RuntimeError(
                    f"The gradients of {type(optimizer).__name__} were unscaled (by gradient clipping or"
                    " `scaler.unscale_`) but the optimizer did not step before this backward, which would add new"
                    " gradients multiplied by the loss scale to the unscaled ones. With a gradient scaler, clip or"
                    " unscale only in iterations that step the optimizer (inside your gradient-accumulation condition,"
                    " for example), or zero its gradients before the next backward."
                )
            del states[key]  # no gradients: nothing was really unscaled, start over


    def _stage(self, optimizer: Any) -> Optional[OptState]:
        state = self.scaler._per_optimizer_states.get(id(optimizer))
        return None if state is None else state["stage"]

    def unscale(self, optimizer: Optimizer, aliases: tuple[Any, ...] = (), required: bool = True) -> None:
        """Unscale ``optimizer``'s gradients unless that already happened since its last step.

        Args:
            optimizer: the ``torch.optim`` optimizer whose gradients to unscale.
            aliases: wrappers of ``optimizer`` (such as a ``LightningOptimizer``) that the user may have passed to
                ``scaler.unscale_`` themselves; the scaler keeps its state by object identity.
            required: whether the caller needs true gradients (clipping). An optimizer that unscales inside its own
                ``step()`` then raises, since its gradients cannot be unscaled before the step without being unscaled
                twice.

        """
        if not self.scaler.is_enabled():
            return
        if _handles_unscaling_itself(optimizer):
            if required:
                raise RuntimeError(
                    f"The optimizer {type(optimizer).__qualname__} unscales gradients inside its own `step()` (it takes"
                    " a `grad_scaler` argument), so its gradients stay multiplied by the loss scale until then and"
                    " cannot be clipped or inspected before the step without being unscaled twice. Use an optimizer"
                    " that follows torch's `grad_scale`/`found_inf` protocol (any built-in `fused=True` optimizer),"
                    " or do not clip gradients with this one."
                )
            return
        self._adopt_state(optimizer, aliases)
        if self._stage(optimizer) in (None, OptState.READY):
            self.scaler.unscale_(optimizer)
            self._unscaled[id(optimizer)] = optimizer

    def step(self, optimizer: Optimizer, aliases: tuple[Any, ...] = (), **kwargs: Any) -> Any:
        """Step ``optimizer`` through the scaler, which unscales first if nobody did and skips the step on inf/NaN."""
        if not self.scaler.is_enabled():
            return optimizer.step(**kwargs)
        self._adopt_state(optimizer, aliases)
        _protect_fused_sgd_momentum(optimizer)
        self._check_fused_can_read_inf_checks(optimizer)
        output = self.scaler.step(optimizer, **kwargs)
        self._update_pending = True
        self._unscaled.pop(id(optimizer), None)
        found_infs = list(self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        if found_infs:  # empty only for an optimizer that unscales inside its own `step()`: it keeps its own record
            found_inf = found_infs[0] if len(found_infs) == 1 else sum(f.to(found_infs[0].device) for f in found_infs)
            self._found_inf[id(optimizer)] = found_inf
            self._iteration_found_infs.append(found_inf)
        return output

    def _check_fused_can_read_inf_checks(self, optimizer: Optimizer) -> None:
        """Refuse what torch cannot do: a fused optimizer fed the 1-element inf checks of a ``ShardedGradScaler``.

        Fused kernels subtract the scaler's ``found_inf`` from their 0-dim step counters; ``ShardedGradScaler`` (FSDP)
        records it with shape ``[1]``, and torch fails inside the step ("output with shape [] doesn't match the
        broadcast shape [1]") after some state may already have changed.
        """
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            return
        state = self.scaler._per_optimizer_states.get(id(optimizer))
        found_infs = [] if state is None else state["found_inf_per_device"].values()
        if any(found_inf.dim() != 0 for found_inf in found_infs):
            raise RuntimeError(
                f"The fused optimizer {type(optimizer).__qualname__} cannot step with {type(self.scaler).__name__}:"
                " torch's sharded scaler records its inf check with shape [1], which fused kernels cannot read. Use"
                " `fused=False` (the foreach implementation) with FSDP under 16-mixed, or bf16-mixed."
            )

    def record_no_step(self, optimizer: Optimizer) -> None:
        """Note that ``optimizer`` did not step this iteration (nothing to step on): no step of it was skipped, and an
        unscale without gradients (clipping on a batch without backward) leaves no state behind."""
        self._found_inf.pop(id(optimizer), None)
        if self._unscaled.pop(id(optimizer), None) is not None and self._stage(optimizer) is OptState.UNSCALED:
            del self.scaler._per_optimizer_states[id(optimizer)]

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last :meth:`step` of ``optimizer`` was skipped because its gradients held inf/NaN.

        ``False`` before its first step. Reading it synchronises with the device.

        """
        found_inf = self._found_inf.get(id(optimizer))
        return found_inf is not None and bool(found_inf.item() > 0)

    @property
    def skipped_steps(self) -> torch.Tensor:
        """How many steps (of all optimizers) the scaler skipped so far, as a tensor on the scaler's device."""
        self._count_skipped_steps()
        if self._skipped_steps is None:
            return torch.zeros((), dtype=torch.int64)
        return self._skipped_steps

    def _count_skipped_steps(self) -> None:
        if not self._iteration_found_infs:
            return
        skipped = (torch.cat([f.reshape(1) for f in self._iteration_found_infs]) > 0).sum()
        self._skipped_steps = skipped if self._skipped_steps is None else self._skipped_steps + skipped
        self._iteration_found_infs.clear()

    def _adopt_state(self, optimizer: Optimizer, aliases: tuple[Any, ...]) -> None:
        """Make the scaler's state for ``optimizer`` reflect this step, whatever the user did through ``aliases``."""
        states = self.scaler._per_optimizer_states
        for alias in aliases:
            alias_state = states.get(id(alias))
            if alias_state is None or alias_state["stage"] is OptState.READY:
                continue
            if self._stage(optimizer) in (None, OptState.READY):
                # the user unscaled through the wrapper: that state belongs to the optimizer it wraps
                states[id(optimizer)] = states.pop(id(alias))
            else:
                del states[id(alias)]
        if self._stage(optimizer) is OptState.STEPPED:
            # a second step of this optimizer in one iteration: keep the first step's inf check for the update
            self._spent_states += 1
            states[-self._spent_states] = states.pop(id(optimizer))

    def update(self) -> None:
        """The iteration's one ``scaler.update()``, if an optimizer stepped since the last one.

        A user who follows PyTorch's recipe to the letter and calls ``scaler.update()`` themselves has already applied
        it (the scaler then holds no stepped optimizer); it is not applied twice.
        """
        if self._update_pending and any(
            state["stage"] is OptState.STEPPED for state in self.scaler._per_optimizer_states.values()
        ):
            self.scaler.update()
        self._update_pending = False
        self._spent_states = 0
        self._count_skipped_steps()  # once per iteration, asynchronously, so the record stays small


def _protect_fused_sgd_momentum(optimizer: Optimizer) -> None:
    """Give fused SGD's momentum buffers a defined value before a step the scaler may skip.

    ``SGD(fused=True)`` allocates its momentum buffers uninitialised on its first step and lets the kernel fill them;
    when the scaler skips that step (inf/NaN, the usual start of fp16 training) they stay garbage and the weights blow
    up on the next step. Zero buffers give exactly for-loop SGD's first step when ``dampening == 0``
    (``0 * momentum + grad == grad``), so they are created here; with dampening they would not, so that raises.
    """
    if not isinstance(optimizer, SGD) or not optimizer.defaults.get("fused"):
        return
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


class _ScalerRecipeHolder:
    """What every precision plugin that may drive a gradient scaler holds, in the Trainer as in Fabric: the
    :class:`GradScalerRecipe` of its ``scaler``, and the wrappers put around the user's optimizers
    (``LightningOptimizer``, Fabric's optimizer wrapper), which a user may hand to ``scaler.unscale_``.

    Subclasses set ``scaler`` and call :meth:`_init_amp_recipe` in ``__init__``.

    """

    scaler: Optional[torch.amp.GradScaler]

    def _init_amp_recipe(self) -> None:
        self._scaler_recipe: Optional[GradScalerRecipe] = None
        self._optimizer_wrappers: weakref.WeakSet = weakref.WeakSet()

    @property
    def _recipe(self) -> GradScalerRecipe:
        assert self.scaler is not None
        if self._scaler_recipe is None or self._scaler_recipe.scaler is not self.scaler:
            self._scaler_recipe = GradScalerRecipe(self.scaler)
        return self._scaler_recipe

    def track_optimizer_wrapper(self, wrapper: Any) -> None:
        self._optimizer_wrappers.add(wrapper)

    def _aliases(self, optimizer: Any) -> tuple[Any, ...]:
        """The tracked wrappers of ``optimizer``."""
        return tuple(w for w in self._optimizer_wrappers if w.optimizer is optimizer)

    def _known_optimizers(self) -> list[Any]:
        """Every tracked wrapper and the optimizer it wraps."""
        wrappers = list(self._optimizer_wrappers)
        return [*wrappers, *(w.optimizer for w in wrappers)]

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle the plugin (e.g. `ddp_spawn`): the weak references to wrappers stay in this process
        state = self.__dict__.copy()
        state["_optimizer_wrappers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._optimizer_wrappers = weakref.WeakSet()


class _AMPRecipePrecision(_ScalerRecipeHolder, Precision):
    """The gradient scaler's part of a Fabric precision plugin that may scale the loss (``MixedPrecision``,
    ``FSDPPrecision``): one implementation of PyTorch's AMP recipe through :class:`GradScalerRecipe`.

    Fabric's loop belongs to the user, so Fabric ends an iteration (:meth:`training_iteration_end`, the single
    ``scaler.update()``) right before the next ``fabric.backward()`` scales a loss, and before ``fabric.save`` or the
    plugin's ``state_dict``: several optimizers fed by one backward are all unscaled with the scale that scaled their
    gradients.

    """

    @override
    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            # the last iteration's single update comes before this one's scaling
            self.training_iteration_end()
            tensor = self._recipe.scale(tensor, self._known_optimizers)
        super().backward(tensor, model, *args, **kwargs)

    @override
    def training_iteration_end(self) -> None:
        if self.scaler is not None:
            self._recipe.update()

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise TypeError(
                "AMP with a gradient scaler and the LBFGS optimizer are not compatible: LBFGS evaluates its closure"
                " several times per step and reads the gradients in between, which the scaler cannot unscale."
                " Use `precision='bf16-mixed'` or `'32-true'` with LBFGS."
            )
        # the scaler skips the step if the gradients hold inf/NaN
        return self._recipe.step(optimizer, self._aliases(optimizer), **kwargs)  # type: ignore[arg-type]

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self._recipe.unscale(optimizer, self._aliases(optimizer))

    @override
    def optimizer_step_was_skipped(self, optimizer: Optimizable) -> bool:
        if self.scaler is None:
            return False
        return self._recipe.step_was_skipped(optimizer)  # type: ignore[arg-type]

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.scaler is not None:
            # a pending update belongs to the iteration being saved: a resumed run must not miss it
            self.training_iteration_end()
            return self.scaler.state_dict()
        return {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)
