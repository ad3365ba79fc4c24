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
"""PyTorch's AMP recipe for a gradient scaler, as one explicit state machine.

The recipe (torch's "Automatic Mixed Precision examples"): ``scaler.scale(loss).backward()``; ``scaler.unscale_(opt)``
before anything reads gradients; ``scaler.step(opt)`` for every optimizer; ``scaler.update()`` once per iteration, after
the last step. :class:`GradScalerRecipe` is the one place in Lightning that drives a scaler through it, so the Trainer's
and Fabric's precision plugins cannot drift apart.

The state it models:

- per optimizer, a :class:`GradientStage`: ``READY`` (its gradients, if any, are multiplied by the loss scale),
  ``UNSCALED`` (true gradients, inf check recorded, not stepped yet), ``STEPPED`` (stepped or skipped this iteration);
- per scaler, an :class:`IterationPhase`: ``INSIDE`` an iteration that a loop opened (the Trainer's training batch),
  or ``OUTSIDE`` (Fabric's loop, a step in ``on_train_epoch_end``), which decides when the single update is due;
- parameters whose gradients a backward *without* the scale accumulated (``loss.backward()`` in manual optimization),
  when the caller asks to watch for them.

:class:`_TorchScalerAdapter` is the only code that reads or edits torch's private per-optimizer scaler state.
"""

import enum
import functools
import inspect
import operator
import weakref
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from lightning_utilities.core.imports import compare_version
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, SGD, Optimizer
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from lightning.fabric.plugins.precision.precision import Precision
from lightning.fabric.utilities.types import Optimizable

try:  # torch >= 2.3
    from torch.amp.grad_scaler import OptState as _TorchOptState
except ImportError:  # torch 2.1, 2.2: the scaler lived with CUDA's AMP
    from torch.cuda.amp.grad_scaler import OptState as _TorchOptState

# Autocast's weight cache went stale under ``torch.no_grad`` before pytorch#165068 (fixed in torch 2.11).
_AUTOCAST_CACHE_IS_SAFE = compare_version("torch", operator.ge, "2.11.0", use_base_version=True)
#: how many scaler updates the watch for backwards without the scale stays on once armed (each fit, each
#: `fabric.setup`): a loop's misuse shows in its first iterations, and afterwards the watch costs nothing per step
WATCHED_UPDATES = 8
# `GradScaler("cpu")` scales on the CPU from torch 2.3; before, a scaler is CUDA's and disables itself on a CPU run.
_CPU_GRAD_SCALER_AVAILABLE = hasattr(torch.amp, "GradScaler")


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


@functools.cache
def _takes_grad_scaler(step: Any) -> bool:
    # once per class's `step`: `inspect.signature` is too slow for every optimizer step
    return "grad_scaler" in inspect.signature(step).parameters


def _refuse_lbfgs(optimizer: Any, error: type[Exception]) -> None:
    """LBFGS cannot run under a gradient scaler; ``error`` is the type each package raised before."""
    if isinstance(optimizer, LBFGS):
        raise error(
            "AMP with a gradient scaler and the LBFGS optimizer are not compatible: LBFGS evaluates its closure"
            " several times per step and reads the gradients in between, which the scaler cannot unscale."
            " Use `precision='bf16-mixed'` or `'32-true'` with LBFGS."
        )


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


class GradientStage(enum.Enum):
    """Where an optimizer's gradients are in the recipe, in the current iteration."""

    READY = "ready"
    """Gradients, if any, are multiplied by the loss scale (or are zero): the next event is a backward or an unscale."""
    UNSCALED = "unscaled"
    """True gradients; their inf check is recorded. The optimizer must step before another scaled backward."""
    STEPPED = "stepped"
    """Stepped, or skipped for inf/NaN gradients, in this iteration. A new backward starts another step cycle."""


class IterationPhase(enum.Enum):
    """Whether a loop declared the current training iteration open, which decides when the single update is due."""

    OUTSIDE = "outside"
    """No iteration is open (Fabric's loop; a step in ``on_train_epoch_end``): an update owed by earlier steps is
    applied before the next loss is scaled, before the next iteration opens, or before the scaler's state is saved."""
    INSIDE = "inside"
    """Inside a training iteration: the update waits for its end, and a checkpoint saved now holds the iteration's
    scale, so that re-running the iteration from it uses the scale that iteration had."""


@dataclass
class _OptimizerRecord:
    stage: GradientStage = GradientStage.READY
    # the inf check of the last step (None: no step yet, or a step with no gradients, which cannot be skipped)
    last_found_inf: Optional[Tensor] = None
    # which update the gradients were unscaled after: a later update changes the scale they were unscaled with
    unscaled_at_update: int = -1
    # a scaled backward reached its parameters after their unscale: the gradients mix two scales
    mixed_scales: bool = False


_STAGE_OF_TORCH = {
    _TorchOptState.READY: GradientStage.READY,
    _TorchOptState.UNSCALED: GradientStage.UNSCALED,
    _TorchOptState.STEPPED: GradientStage.STEPPED,
}


class _TorchScalerAdapter:
    """The only reader and editor of torch's private per-optimizer scaler state (``GradScaler._per_optimizer_states``).

    torch keeps, per ``id(optimizer)``, a ``"stage"`` (``OptState``) and ``"found_inf_per_device"`` (device -> tensor;
    0-dim for ``GradScaler``, shape ``[1]`` for FSDP's ``ShardedGradScaler``), resets all of it in ``update()``, and
    collects the update's inf checks from every entry. ``tests/tests_fabric/plugins/precision`` pins these behaviours on
    every torch the fork supports.
    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._retired = 0

    def _states(self) -> dict:
        return self.scaler._per_optimizer_states

    def stage(self, optimizer: Any) -> Optional[GradientStage]:
        """torch's stage of ``optimizer``, in our terms; ``None`` if torch holds nothing for it."""
        state = self._states().get(id(optimizer))
        return None if state is None else _STAGE_OF_TORCH[state["stage"]]

    def adopt(self, optimizer: Any, aliases: Iterable[Any]) -> None:
        """Move what the user did through a wrapper (``scaler.unscale_(lightning_optimizer)``) to the optimizer."""
        states = self._states()
        for alias in aliases:
            alias_state = states.get(id(alias))
            if alias_state is None:
                continue
            del states[id(alias)]
            if alias_state["stage"] is not _TorchOptState.READY and self.stage(optimizer) in (
                None,
                GradientStage.READY,
            ):
                states[id(optimizer)] = alias_state

    def retire(self, optimizer: Any) -> None:
        """Set a stepped (or unscaled) optimizer's state aside, so that it can run another step cycle in this
        iteration while its inf check still counts for the iteration's update."""
        self._retire_key(id(optimizer))

    def _retire_key(self, key: int) -> None:
        states = self._states()
        state = states.pop(key, None)
        if state is not None and state["found_inf_per_device"]:
            self._retired += 1
            states[-self._retired] = state  # negative keys are no object's id

    def release_when_collected(self, optimizer: Any) -> None:
        """torch keys the state by ``id()``, which a collected optimizer hands on to the next object (an inner-loop
        optimizer created per step): when ``optimizer`` is collected, its state is retired, so a new optimizer never
        inherits its stage, and its inf check still counts for the iteration's update."""
        release = weakref.finalize(optimizer, _retire_collected, weakref.ref(self), id(optimizer))
        release.atexit = False  # at interpreter exit there is no next optimizer to protect

    def forget(self, optimizer: Any) -> None:
        self._states().pop(id(optimizer), None)

    def found_inf(self, optimizer: Any) -> Optional[Tensor]:
        """A copy of the inf check recorded for ``optimizer``, summed over devices; ``None`` if none was recorded.

        A copy: ``update()`` sums the inf checks of all optimizers into the first one, in place.
        """
        state = self._states().get(id(optimizer))
        found_infs = [] if state is None else list(state["found_inf_per_device"].values())
        if not found_infs:
            return None
        return sum((f.to(found_infs[0].device) for f in found_infs[1:]), found_infs[0].clone())

    def zero_dim_inf_checks(self, optimizer: Any) -> None:
        """Give a fused optimizer 0-dim inf checks: its kernels subtract them from 0-dim step counters, and
        ``ShardedGradScaler`` records shape ``[1]`` (torch then fails with "output with shape [] doesn't match")."""
        state = self._states().get(id(optimizer))
        if state is not None:
            per_device = state["found_inf_per_device"]
            for device, found_inf in per_device.items():
                if found_inf.dim() != 0:
                    per_device[device] = found_inf.reshape(())

    def has_scaled(self) -> bool:
        """Whether the scaler scaled anything yet (before, it has no scale to unscale with)."""
        return self.scaler._scale is not None

    def project_owed_update(self, state: dict[str, Any]) -> None:
        """Put into ``state`` (the scaler's ``state_dict()``) the scale and growth tracker that the owed ``update()``
        will leave, computed by torch's own kernel on copies: the live scaler is not touched."""
        found_infs = [f for s in self._states().values() for f in s["found_inf_per_device"].values()]
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

    def has_inf_checks(self) -> bool:
        """Whether an unscale (ours or the user's) recorded an inf check since the last update."""
        return any(state["found_inf_per_device"] for state in self._states().values())

    def unscale_(self, optimizer: Any) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self.scaler.step(optimizer, **kwargs)

    def update(self) -> None:
        self.scaler.update()
        self._retired = 0

    def reset(self) -> None:
        """Forget every optimizer's state, as ``update()`` does, without updating (a checkpoint was loaded)."""
        self._states().clear()
        self._retired = 0


class GradScalerRecipe:
    """Drives a gradient scaler (``torch.amp.GradScaler``, FSDP's ``ShardedGradScaler``) through PyTorch's AMP recipe.

    Every event of a training iteration is a transition of :class:`GradientStage` (per optimizer) and
    :class:`IterationPhase` (per scaler):

    - :meth:`scale` (a loss about to be backpropagated): settles an owed update when ``OUTSIDE``; ``STEPPED`` ->
      ``READY`` (a new step cycle); ``UNSCALED`` -> ``READY`` if its gradients were cleared, otherwise an error.
    - :meth:`backward` (a context around that backward): marks it as scaled, for :meth:`watch_unscaled_backward`.
    - :meth:`unscale`: ``READY`` -> ``UNSCALED``; idempotent (``UNSCALED`` and ``STEPPED`` stay as they are).
    - :meth:`step`: ``READY``/``UNSCALED`` -> ``STEPPED`` through the scaler; ``STEPPED`` -> ``STEPPED`` again for a
      step cycle on gradients the caller assigned itself; a step without any gradient is a plain no-op step.
    - :meth:`iteration_start`: settles an owed update; ``OUTSIDE`` -> ``INSIDE``.
    - :meth:`iteration_end`: settles (``scaler.update()`` if any inf check was recorded); ``STEPPED`` -> ``READY``;
      ``INSIDE`` -> ``OUTSIDE``.
    - :meth:`state_dict`: settles first only when ``OUTSIDE``; mid-iteration the live run is left untouched.
    - :meth:`load_state_dict`: every optimizer ``READY``.

    A user's own ``scaler.unscale_(opt)``, ``scaler.step(opt)`` or ``scaler.update()`` (with the optimizer or a tracked
    wrapper of it) is read from the scaler at the next event, so following PyTorch's recipe to the letter gives the
    recipe's result: nothing is unscaled or updated twice.

    Example::

        recipe = GradScalerRecipe(torch.amp.GradScaler("cpu"))
        for batch in batches:
            recipe.iteration_start()
            with recipe.backward():
                recipe.scale(loss_fn(model(batch))).backward()
            recipe.unscale(optimizer)  # before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            recipe.step(optimizer)
            recipe.iteration_end()  # the single `scaler.update()`

    .. warning::
        Gradients unscaled in an iteration that does not step them (clipping inside a gradient-accumulation window)
        must be cleared before the next backward: the scale of new gradients cannot be told apart from the old ones
        afterwards, so :meth:`scale` raises instead.

    """

    def __init__(
        self,
        scaler: Any,
        aliases: Callable[[Any], Iterable[Any]] = lambda optimizer: (),
        optimizers: Callable[[], Iterable[Any]] = tuple,
    ) -> None:
        """
        Args:
            scaler: the gradient scaler.
            aliases: returns the wrappers of an optimizer (``LightningOptimizer``, Fabric's wrapper) that a user may
                hand to ``scaler.unscale_`` instead of the optimizer.
            optimizers: returns every optimizer of the run, where the caller knows them (the Trainer's, those
                ``fabric.setup`` wrapped). Once each of them has stepped, the update is applied right away: it is
                the iteration's single update, and ``scaler.get_scale()`` after a step shows whether it was skipped.

        """
        self.scaler = scaler
        self._aliases = aliases
        self._optimizers = optimizers
        self.phase = IterationPhase.OUTSIDE
        self._torch = _TorchScalerAdapter(scaler)
        self._records: weakref.WeakKeyDictionary[Any, _OptimizerRecord] = weakref.WeakKeyDictionary()
        self._updates = 0
        self._iteration_found_infs: list[Tensor] = []
        self._skipped_steps: Optional[Tensor] = None
        self._scaled_backward_depth = 0
        # hooks on the parameters of optimizers unscaled and not stepped, for the coming scaled backward
        self._unscaled_watch: list[Any] = []
        self._recipe_steps: set[int] = set()
        # parameters a backward without the scale accumulated into, by id
        self._unscaled_accumulations: dict[int, Tensor] = {}
        # the watched optimizers and parameters and their hook handles, held weakly by identity: a collected one's
        # id() may come back, and its hook goes with it
        self._watched: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._watch_ends_at_update = 0

    def _record(self, optimizer: Any) -> _OptimizerRecord:
        record = self._records.get(optimizer)
        if record is None:
            record = self._records[optimizer] = _OptimizerRecord()
            self._torch.release_when_collected(optimizer)
        return record

    def _reconcile(self, optimizer: Any, aliases: Iterable[Any] = ()) -> _OptimizerRecord:
        """Bring ``optimizer``'s record in line with what the user did through the scaler themselves."""
        self._torch.adopt(optimizer, aliases)
        record = self._record(optimizer)
        torch_stage = self._torch.stage(optimizer)
        if torch_stage is GradientStage.UNSCALED and record.stage is GradientStage.READY:
            record.stage, record.unscaled_at_update = GradientStage.UNSCALED, self._updates
        elif torch_stage is GradientStage.STEPPED and record.stage is not GradientStage.STEPPED:
            record.stage, record.last_found_inf = GradientStage.STEPPED, self._torch.found_inf(optimizer)
        return record

    # ---- events -------------------------------------------------------------------------------------------------

    def scale(self, loss: Tensor, optimizers: Callable[[], Iterable[Any]] = tuple) -> Tensor:
        """A loss is about to be backpropagated: multiply it by the scale.

        Args:
            loss: the loss.
            optimizers: returns every optimizer (and wrapper) the caller knows of, so that gradients the user unscaled
                through the scaler themselves are seen too.

        Raises:
            RuntimeError: if an optimizer holds gradients that were unscaled and not stepped on: the backward would add
                gradients multiplied by the loss scale to them.

        """
        if self._unscaled_accumulations:
            # before any transition: a refused backward leaves every optimizer as it was
            self._check_no_unscaled_accumulations(self._unscaled_accumulations.values(), "a scaled backward")
        if self.phase is IterationPhase.OUTSIDE:
            self._settle()
        self._stop_watching_unscaled()
        if self._records or self._torch.has_inf_checks():
            for optimizer in self._candidates(optimizers):
                self._begin_step_cycle(optimizer)
        return self.scaler.scale(loss)

    def _watch_unscaled(self, optimizer: Any, cleared: bool) -> None:
        """Until this backward ends: if it reaches ``optimizer``'s parameters, its unscaled gradients now mix two
        scales, or, when they were ``cleared`` (None or zeros), it starts a fresh step cycle; if it does not, the
        optimizer stays unscaled, and its step is skipped on the inf check its unscale recorded, as in torch."""
        hook = functools.partial(_unscaled_reached_hook, weakref.ref(self), optimizer, cleared)
        self._unscaled_watch.extend(
            p.register_post_accumulate_grad_hook(hook)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad
        )

    def _stop_watching_unscaled(self) -> None:
        for handle in self._unscaled_watch:
            handle.remove()
        self._unscaled_watch.clear()

    def _candidates(self, optimizers: Callable[[], Iterable[Any]]) -> list[Any]:
        return list({id(o): o for o in (*self._records.keys(), *optimizers())}.values())

    def _begin_step_cycle(self, optimizer: Any) -> None:
        record = self._reconcile(optimizer, self._aliases(optimizer))
        if record.stage is GradientStage.STEPPED:
            self._torch.retire(optimizer)
            record.stage = GradientStage.READY
        elif record.stage is GradientStage.UNSCALED:
            if _holds_live_gradients(optimizer):
                # legal as long as this backward does not reach its parameters (two networks, each clipped after
                # its own backward; a GAN's toggled optimizers): the backward watches them, the step decides
                self._watch_unscaled(optimizer, cleared=False)
                return
            # cleared (None or zeros): nothing unscaled remains until a backward reaches it
            self._watch_unscaled(optimizer, cleared=True)

    def _restart_step_cycle(self, optimizer: Any) -> None:
        # its inf check still counts for the update
        self._torch.retire(optimizer)
        record = self._records[optimizer]
        record.stage, record.mixed_scales = GradientStage.READY, False

    @contextmanager
    def backward(self) -> Generator[None, None, None]:
        """The backward of a loss returned by :meth:`scale`.

        Raises:
            RuntimeError: if a watched parameter holds gradients that a backward without the scale accumulated: this
                backward would add scaled gradients to them.

        """
        if self._unscaled_accumulations:
            self._check_no_unscaled_accumulations(self._unscaled_accumulations.values(), "a scaled backward")
        self._scaled_backward_depth += 1
        try:
            yield
        finally:
            self._scaled_backward_depth -= 1
            self._stop_watching_unscaled()

    def unscale(self, optimizer: Optimizer, aliases: Iterable[Any] = (), required: bool = True) -> None:
        """Unscale ``optimizer``'s gradients unless that already happened in this step cycle.

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
        self._refuse_unscaled_accumulations(optimizer, f"Unscaling the gradients of {type(optimizer).__name__}")
        record = self._reconcile(optimizer, aliases)
        self._refuse_mixed_scales(optimizer, record)
        self._start_afresh_if_zeroed_since_an_update(optimizer, record)
        self._unscale_if_ready(optimizer, record)

    def _unscale_if_ready(self, optimizer: Any, record: _OptimizerRecord) -> None:
        if record.stage is not GradientStage.READY:
            return
        if self._torch.stage(optimizer) is GradientStage.STEPPED:  # the user updated after a step: a fresh cycle
            self._torch.forget(optimizer)
        self._torch.unscale_(optimizer)
        record.stage, record.unscaled_at_update = GradientStage.UNSCALED, self._updates

    def step(self, optimizer: Optimizer, aliases: Iterable[Any] = (), **kwargs: Any) -> Any:
        """Step ``optimizer`` through the scaler, which unscales first if nobody did and skips the step on inf/NaN.

        Raises:
            RuntimeError: if watched parameters of ``optimizer`` hold gradients that a backward without the scale
                accumulated, or its gradients were unscaled before an earlier update. Nothing is changed then.

        """
        if not self.scaler.is_enabled():
            return optimizer.step(**kwargs)
        if kwargs.get("closure") is not None:
            raise RuntimeError(
                f"`{type(optimizer).__name__}.step(closure)` was called under a gradient scaler. torch's GradScaler"
                ' does not support closures ("Closure use is not currently supported if GradScaler is enabled"): the'
                " gradients the closure computes are multiplied by the loss scale and must be unscaled and checked for"
                " inf/NaN before the step. Run the closure yourself (`loss = closure()`), then call `step()` without"
                " it. The step was not taken."
            )
        self._refuse_unscaled_accumulations(optimizer, f"`{type(optimizer).__name__}.step()`")
        record = self._reconcile(optimizer, aliases)
        self._refuse_mixed_scales(optimizer, record)
        self._start_afresh_if_zeroed_since_an_update(optimizer, record)
        if record.stage is GradientStage.UNSCALED and record.unscaled_at_update != self._updates:
            raise RuntimeError(
                f"The gradients of {type(optimizer).__name__} were unscaled in an earlier iteration, before the loss"
                " scale was updated, and the optimizer steps on them only now. Step in the iteration that clips or"
                " unscales its gradients, or zero them and compute them again. The step was not taken."
            )
        if record.stage is GradientStage.STEPPED:
            # a second step cycle without a scaled backward in between: gradients the caller assigned itself
            # (gradient surgery with `torch.autograd.grad(scaler.scale(loss), ...)`)
            self._torch.retire(optimizer)
            record.stage = GradientStage.READY
        # always through the scaler, whatever the gradients hold: FSDP's `ShardedGradScaler.unscale_` all-reduces the
        # inf check, so every rank must unscale, in the same order, even one whose shard has no gradients
        if self._torch.has_scaled() and not _handles_unscaling_itself(optimizer):
            self._unscale_if_ready(optimizer, record)  # the checks of `unscale` ran above
        if self._torch.found_inf(optimizer) is None and not _handles_unscaling_itself(optimizer):
            # no gradient to step on (none reached this optimizer): torch's scaler would fail with "No inf checks were
            # recorded for this optimizer", so the optimizer's own step is taken without it; it cannot overflow
            output = optimizer.step(**kwargs)
            record.stage, record.last_found_inf = GradientStage.STEPPED, None
            self._update_once_every_optimizer_stepped(optimizer)
            return output
        _protect_fused_sgd_momentum(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False) and not _handles_unscaling_itself(optimizer):
            self._torch.zero_dim_inf_checks(optimizer)
        self._recipe_steps.add(id(optimizer))
        try:
            output = self._torch.step(optimizer, **kwargs)
        finally:
            self._recipe_steps.discard(id(optimizer))
        found_inf = self._torch.found_inf(optimizer)
        record.stage, record.last_found_inf = GradientStage.STEPPED, found_inf
        if found_inf is not None:  # None only for an optimizer that unscales inside its own `step()`
            self._iteration_found_infs.append(found_inf)
        self._update_once_every_optimizer_stepped(optimizer)
        return output

    def _update_once_every_optimizer_stepped(self, optimizer: Any) -> None:
        # the last step of the iteration: nothing is left for the scale to unscale, so the update is due now, exactly
        # where PyTorch's recipe puts it (a second step cycle of one optimizer then starts afresh, as in torch)
        optimizers = list(self._optimizers())
        if not any(o is optimizer for o in optimizers):
            return
        records = [self._records.get(o) for o in optimizers]
        if all(r is not None and r.stage is GradientStage.STEPPED for r in records):
            self._settle()

    def iteration_start(self) -> None:
        """A loop opens a training iteration: an update owed by steps outside the last one is applied first."""
        self._settle()
        self.phase = IterationPhase.INSIDE

    def iteration_end(self) -> None:
        """A loop closes a training iteration: the iteration's single ``scaler.update()``."""
        self._settle()
        self.phase = IterationPhase.OUTSIDE

    def _settle(self) -> None:
        """Apply the update owed by the inf checks recorded since the last one (steps, and unscales without a step
        whose inf check must still lower the scale); none when the user already called ``scaler.update()``."""
        if self._torch.has_inf_checks():
            self._torch.update()
            self._updates += 1
            if self._watched and self._updates >= self._watch_ends_at_update and not self._unscaled_accumulations:
                self.unwatch()
        for record in self._records.values():
            if record.stage is GradientStage.STEPPED:
                record.stage = GradientStage.READY
        self._count_skipped_steps()

    def state_dict(self, include_owed_update: Optional[bool] = None) -> dict[str, Any]:
        """The scaler's state, without changing the live run.

        Args:
            include_owed_update: whether the state holds the update owed by the inf checks recorded so far, computed
                on copies (what the run continues with after its steps), or the scale the current steps used. By
                default the owed update is included outside an iteration, and left out inside one (a checkpoint
                saved from a Trainer's ``training_step`` re-runs the iteration with the scale it had).

        """
        if include_owed_update is None:
            include_owed_update = self.phase is IterationPhase.OUTSIDE
        state = self.scaler.state_dict()
        if include_owed_update:
            self._torch.project_owed_update(state)
        return state

    def finish(self) -> None:
        """Training ends (the plugin's teardown): an update owed by steps outside an iteration (a step in
        ``on_train_epoch_end``) is applied, as the recipe applies it right after those steps."""
        if self.phase is IterationPhase.OUTSIDE:
            self._settle()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state_dict)
        for record in self._records.values():
            record.stage, record.mixed_scales = GradientStage.READY, False
        self._torch.reset()

    # ---- backward without the scale -----------------------------------------------------------------------------

    def watch_unscaled_backward(self, optimizers: Iterable[Optimizer]) -> None:
        """Watch ``optimizers``' parameters for gradients accumulated by a backward that :meth:`scale` did not scale
        (``loss.backward()`` instead of the plugin's backward), and their raw ``step()`` on scaled gradients.

        Gradients assigned to ``.grad`` (gradient surgery) and ``torch.autograd.grad`` are not accumulations and are
        not flagged. Costs one Python call per parameter per backward, for the next :data:`WATCHED_UPDATES` scaler
        updates (iterations that step); then, or with :meth:`unwatch`, the hooks are removed.
        """
        if not self.scaler.is_enabled():
            return
        self._watch_ends_at_update = self._updates + WATCHED_UPDATES
        this = weakref.ref(self)
        for optimizer in optimizers:
            if optimizer not in self._watched:
                self._watched[optimizer] = optimizer.register_step_pre_hook(functools.partial(_raw_step_pre_hook, this))
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p in self._watched or not p.requires_grad:
                        continue
                    self._watched[p] = p.register_post_accumulate_grad_hook(
                        functools.partial(_accumulate_grad_hook, this)
                    )

    @property
    def watched(self) -> int:
        """How many optimizers and parameters are watched: each one's hook goes away with it."""
        return len(self._watched)

    def unwatch(self) -> None:
        for handle in list(self._watched.values()):
            handle.remove()
        self._watched.clear()
        self._unscaled_accumulations.clear()

    def _start_afresh_if_zeroed_since_an_update(self, optimizer: Any, record: _OptimizerRecord) -> None:
        """Gradients unscaled before the last update and zeroed since (``zero_grad(set_to_none=False)``): nothing
        unscaled remains, so the optimizer starts a fresh step cycle, as torch's scaler does after its update."""
        unscaled_before_an_update = (
            record.stage is GradientStage.UNSCALED and record.unscaled_at_update != self._updates
        )
        if unscaled_before_an_update and not _holds_live_gradients(optimizer):
            self._restart_step_cycle(optimizer)  # torch's update already dropped its state

    def _refuse_mixed_scales(self, optimizer: Any, record: _OptimizerRecord) -> None:
        if not record.mixed_scales:
            return
        if not _holds_live_gradients(optimizer):  # zeroed since: nothing mixed remains, a fresh cycle
            self._restart_step_cycle(optimizer)
            return
        raise RuntimeError(
            f"The gradients of {type(optimizer).__name__} were unscaled (by gradient clipping or `scaler.unscale_`) but"
            " the optimizer did not step before a later backward added new gradients multiplied by the loss scale to"
            " them, so they now mix two scales. With a gradient scaler, clip or unscale only in iterations that step"
            " the optimizer (inside your gradient-accumulation condition, for example), or zero its gradients before"
            " the next backward. Nothing was changed: zero its gradients to go on."
        )

    def _refuse_unscaled_accumulations(self, optimizer: Any, where: str) -> None:
        if not self._unscaled_accumulations:
            return
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._check_no_unscaled_accumulations(
            [p for key, p in self._unscaled_accumulations.items() if key in params], where
        )

    def _check_no_unscaled_accumulations(self, params: Iterable[Tensor], where: str) -> None:
        live = []
        for p in list(params):
            if _is_live(p.grad):
                live.append(p)
            else:  # cleared since: nothing unscaled remains
                self._unscaled_accumulations.pop(id(p), None)
        if live:
            raise RuntimeError(
                f"{where} found gradients that a backward without the loss scale accumulated ({len(live)} parameter"
                " tensor(s)): with a gradient scaler every backward must go through it, or the step divides those"
                " gradients by the scale. Call `self.manual_backward(loss)` instead of `loss.backward()` (or"
                " `torch.autograd.backward`; in Fabric, `fabric.backward(loss)`) for every loss of the step. Nothing"
                " was changed."
            )

    def _check_raw_step(self, optimizer: Optimizer) -> None:
        if id(optimizer) in self._recipe_steps or hasattr(optimizer, "found_inf"):
            return  # our step, or inside the user's own `scaler.step` of a fused optimizer
        if self._torch.stage(optimizer) is not None and self._torch.stage(optimizer) is not GradientStage.READY:
            return  # the user unscaled through the scaler (`scaler.unscale_`, `scaler.step`): true gradients
        record = self._records.get(optimizer)
        if record is not None and record.stage is not GradientStage.READY:
            return
        if _holds_live_gradients(optimizer):
            raise RuntimeError(
                f"`{type(optimizer).__name__}.step()` was called on the raw optimizer, whose gradients are still"
                " multiplied by the loss scale: the scaler neither unscaled them nor checked them for inf/NaN. Step the"
                " optimizer `self.optimizers()` returns (the `LightningOptimizer`), or drive the scaler yourself"
                " (`scaler.unscale_(opt)` or `scaler.step(opt)`). The step was not taken."
            )

    # ---- signals ------------------------------------------------------------------------------------------------

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the last :meth:`step` of ``optimizer`` was skipped because its gradients held inf/NaN.

        ``False`` before its first step, and for a step with no gradients. Reading it synchronises with the device.

        """
        record = self._records.get(optimizer)
        found_inf = None if record is None else record.last_found_inf
        return found_inf is not None and bool(found_inf.item() > 0)

    def forget_last_step(self, optimizer: Optimizer) -> None:
        """``optimizer`` did not step in this iteration (nothing to step on): no step of it was skipped, and an unscale
        without gradients (clipping on a batch without backward) leaves no state behind."""
        record = self._records.get(optimizer)
        if record is None:
            return
        record.last_found_inf = None
        if record.stage is GradientStage.UNSCALED and self._torch.found_inf(optimizer) is None:
            self._torch.forget(optimizer)
            record.stage = GradientStage.READY

    @property
    def update_owed(self) -> bool:
        """Whether inf checks were recorded since the last ``scaler.update()``: the iteration's update is still due."""
        return self._torch.has_inf_checks()

    @property
    def updates(self) -> int:
        """How many ``scaler.update()`` calls this recipe applied."""
        return self._updates

    @property
    def skipped_steps(self) -> Tensor:
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

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle plugins (`ddp_spawn`); hooks and weak records stay in this process
        state = self.__dict__.copy()
        unpicklable = ("_records", "_aliases", "_optimizers", "_watched")
        state.update(dict.fromkeys(unpicklable), _unscaled_accumulations={}, _unscaled_watch=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._records = weakref.WeakKeyDictionary()
        self._watched = WeakIdKeyDictionary()
        self._aliases = lambda optimizer: ()
        self._optimizers = tuple


def _retire_collected(adapter_ref: "weakref.ref[_TorchScalerAdapter]", key: int) -> None:
    adapter = adapter_ref()
    if adapter is not None:
        adapter._retire_key(key)


def _accumulate_grad_hook(recipe_ref: "weakref.ref[GradScalerRecipe]", param: Tensor) -> None:
    recipe = recipe_ref()
    if recipe is not None and recipe._scaled_backward_depth == 0:
        recipe._unscaled_accumulations[id(param)] = param


def _unscaled_reached_hook(
    recipe_ref: "weakref.ref[GradScalerRecipe]", optimizer: Any, cleared: bool, param: Tensor
) -> None:
    recipe = recipe_ref()
    record = None if recipe is None else recipe._records.get(optimizer)
    if record is None or record.stage is not GradientStage.UNSCALED:
        return  # restarted by an earlier parameter of this backward
    if cleared:
        recipe._restart_step_cycle(optimizer)
    else:
        record.mixed_scales = True


def _raw_step_pre_hook(recipe_ref: "weakref.ref[GradScalerRecipe]", optimizer: Optimizer, *_: Any) -> None:
    recipe = recipe_ref()
    if recipe is not None:
        recipe._check_raw_step(optimizer)


def _is_live(grad: Optional[Tensor]) -> bool:
    """Whether ``grad`` holds anything: ``zero_grad(set_to_none=False)`` leaves zeros, which are not live."""
    return grad is not None and bool(grad.ne(0).any())


def _holds_live_gradients(optimizer: Any) -> bool:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return False
    # one device synchronisation for all of them; only on paths that are about to raise or to forget a state
    return bool(torch.stack([g.ne(0).any().to(grads[0].device) for g in grads]).any())


def _protect_fused_sgd_momentum(optimizer: Optimizer) -> None:
    """Give fused SGD's momentum buffers a defined value before a step the scaler may skip.

    ``SGD(fused=True)`` allocates its momentum buffers uninitialised on its first step and lets the kernel fill them;
    when the scaler skips that step (inf/NaN, the usual start of fp16 training) they stay garbage and the weights blow
    up on the next step. Zero buffers give exactly for-loop SGD's first step when ``dampening == 0``
    (``0 * momentum + grad == grad``), so they are created here; with dampening they would not, so that raises.
    """
    if not isinstance(optimizer, SGD) or not optimizer.defaults.get("fused"):
        return
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


class _ScalerRecipeHolder:
    """What every precision plugin that may drive a gradient scaler holds, in the Trainer as in Fabric: the
    :class:`GradScalerRecipe` of its ``scaler``, and the wrappers put around the user's optimizers
    (``LightningOptimizer``, Fabric's optimizer wrapper), which a user may hand to ``scaler.unscale_``.

    Subclasses set ``scaler`` and call :meth:`_init_amp_recipe` in ``__init__``.

    """

    scaler: Optional[Any]

    def _init_amp_recipe(self) -> None:
        self._scaler_recipe: Optional[GradScalerRecipe] = None
        self._optimizer_wrappers: weakref.WeakSet = weakref.WeakSet()

    def _check_scaler(self) -> None:
        """Before training: refuse a scaler torch disabled (constructing the plugin on a machine without the scaler's
        device is fine, training with it is not)."""
        _check_scaler_is_enabled(self.scaler, f"`{type(self).__name__}`")

    @property
    def _recipe(self) -> GradScalerRecipe:
        assert self.scaler is not None
        if self._scaler_recipe is None or self._scaler_recipe.scaler is not self.scaler:
            self._scaler_recipe = GradScalerRecipe(
                self.scaler, aliases=self._aliases, optimizers=self._known_optimizers
            )
        return self._scaler_recipe

    def track_optimizer_wrapper(self, wrapper: Any) -> None:
        self._optimizer_wrappers.add(wrapper)

    def _aliases(self, optimizer: Any) -> tuple[Any, ...]:
        """The tracked wrappers of ``optimizer``."""
        return tuple(w for w in self._optimizer_wrappers if w.optimizer is optimizer)

    def _known_optimizers(self) -> list[Any]:
        """The optimizers that tracked wrappers wrap."""
        return [w.optimizer for w in self._optimizer_wrappers]

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle the plugin (e.g. `ddp_spawn`): the weak references to wrappers stay in this process
        state = self.__dict__.copy()
        state["_optimizer_wrappers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._optimizer_wrappers = weakref.WeakSet()
        if self._scaler_recipe is not None:
            self._scaler_recipe._aliases = self._aliases
            self._scaler_recipe._optimizers = self._known_optimizers


class _AMPRecipePrecision(_ScalerRecipeHolder, Precision):
    """The gradient scaler's part of a Fabric precision plugin that may scale the loss (``MixedPrecision``,
    ``FSDPPrecision``): one implementation of PyTorch's AMP recipe through :class:`GradScalerRecipe`.

    Fabric's loop belongs to the user. Unless the user marks an iteration (``with fabric.training_iteration():``), none
    is open (:attr:`IterationPhase.OUTSIDE`): the single ``scaler.update()`` owed by an iteration's steps is applied
    right before the next ``fabric.backward()`` scales a loss, and before ``fabric.save`` or the plugin's
    ``state_dict``, so several optimizers fed by one backward are all unscaled with the scale that scaled their
    gradients. Inside a marked iteration the update waits for its end, so a loop that interleaves backward and step of
    several optimizers (a GAN) gets one update per iteration, as in PyTorch's recipe.

    Under an enabled scaler the parameters of every optimizer ``fabric.setup`` wraps are watched (as in the Trainer's
    manual optimization): gradients accumulated by a backward the scaler did not scale (``loss.backward()`` instead of
    ``fabric.backward(loss)``) make the next step or clipping of their optimizer raise, and so does a ``step()`` of the
    raw optimizer on gradients still multiplied by the scale.

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
        if self.scaler is not None and self.scaler.is_enabled():
            # the loop is the user's: `loss.backward()` instead of `fabric.backward(loss)`, or a step of the raw
            # optimizer, would leave gradients the scaler did not scale, or step on scaled ones: both raise instead of
            # training silently wrong (a disabled scaler is refused at the first backward)
            self._recipe.watch_unscaled_backward([wrapper.optimizer])

    @override
    def teardown(self) -> None:
        if self._scaler_recipe is not None:
            self._scaler_recipe.finish()
            self._scaler_recipe.unwatch()
        super().teardown()

    @override
    def training_iteration_start(self) -> None:
        if self.scaler is not None:
            self._recipe.iteration_start()

    @override
    def training_iteration_end(self) -> None:
        if self.scaler is not None:
            self._recipe.iteration_end()

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        _refuse_lbfgs(optimizer, TypeError)
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
        if self.scaler is None:
            return {}
        # what the run continues with: Fabric's loop may save anywhere in an iteration, and the save changes nothing
        return self._recipe.state_dict(include_owed_update=True)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self._recipe.load_state_dict(state_dict)
