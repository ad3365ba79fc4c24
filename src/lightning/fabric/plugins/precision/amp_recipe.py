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

- per optimizer, torch's own ``OptState`` (``READY``: gradients, if any, multiplied by the loss scale; ``UNSCALED``:
  true gradients, inf check recorded, not stepped yet; ``STEPPED``: stepped or skipped since the update), read from
  the scaler, where it lasts until the next update; the recipe keeps only what torch does not (gradients unscaled
  before an update, gradients that mix two scales, a step without the scaler);
- per scaler, an :class:`IterationPhase`: ``INSIDE`` an iteration that a loop opened (the Trainer's training batch),
  or ``OUTSIDE`` (Fabric's loop, a step in ``on_train_epoch_end``), which decides when the single update is due.

:class:`_StepSkips` tells whether a step was skipped, and how many were; :class:`_TorchScalerAdapter` is the only code
that reads torch's private per-optimizer scaler state, and writes it in four named operations. The misuse watch for
backwards without the scale is opt-in and lives in :mod:`~lightning.fabric.plugins.precision.amp_misuse_watch`; by
default only the free checks run (a step before the scaler scaled any loss, a disabled scaler, LBFGS).
"""

import enum
import functools
import inspect
import weakref
from collections.abc import Generator, Iterable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Union

import torch
from torch import Tensor
from torch.optim import LBFGS, SGD, Optimizer
from torch.utils.weak import WeakIdKeyDictionary

try:  # torch >= 2.3
    from torch.amp.grad_scaler import OptState
except ImportError:  # torch 2.1, 2.2: the scaler lived with CUDA's AMP
    from torch.cuda.amp.grad_scaler import OptState

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


class _RunAPI(NamedTuple):
    """What a user of the run calls, for the errors that tell them what to do."""

    backward: str
    optimizer: str


_TRAINER_API = _RunAPI("self.manual_backward(loss)", "`self.optimizers()` (the `LightningOptimizer`)")
_FABRIC_API = _RunAPI("fabric.backward(loss)", "`fabric.setup` (or `fabric.setup_optimizers`)")


class IterationPhase(enum.Enum):
    """Whether a loop declared the current training iteration open, which decides when the single update is due."""

    OUTSIDE = "outside"
    """No iteration is open (Fabric's loop; a step in ``on_train_epoch_end``): an update owed by earlier steps is
    applied before the next loss is scaled, before the next iteration opens, or before the scaler's state is saved."""
    INSIDE = "inside"
    """Inside a training iteration: the update waits for its end, and a checkpoint saved now holds the iteration's
    scale, so that re-running the iteration from it uses the scale that iteration had."""


class _TorchScalerAdapter:
    """The only code that touches torch's private per-optimizer scaler state (``GradScaler._per_optimizer_states``).

    torch keeps, per ``id(optimizer)``, a ``"stage"`` (``OptState``) and ``"found_inf_per_device"`` (device -> tensor;
    0-dim for ``GradScaler``, shape ``[1]`` for FSDP's ``ShardedGradScaler``), clears all of it in ``update()``, and
    collects the update's inf checks from every entry. It is read here, and written by four named operations only,
    each for a case torch's public API cannot express (``tests/tests_fabric/plugins/precision`` pins the behaviour each
    relies on, on every torch the fork supports):

    - :meth:`adopt`: the user's ``scaler.unscale_(wrapper)`` is keyed by the wrapper's id; the entry moves to the
      optimizer, or the step would unscale a second time;
    - :meth:`set_aside`: an optimizer that starts another step cycle before the update (a critic stepped twice before
      the generator), or is collected (its id is handed to the next object): torch would refuse its second step, so its
      entry moves to a key no object has, and its inf check still counts for the update;
    - :meth:`drop_empty`: an ``unscale_`` without gradients records an entry with no inf check, which no ``update()``
      clears when no other optimizer recorded one, and which makes torch refuse the next ``unscale_``;
    - :meth:`zero_dim_inf_checks`: fused kernels need 0-dim inf checks, ``ShardedGradScaler`` records shape ``[1]``.

    """

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler
        self._set_aside = 0

    def _states(self) -> dict:
        return self.scaler._per_optimizer_states

    # ---- reads ----------------------------------------------------------------------------------------------------

    def stage(self, optimizer: Any) -> Optional[OptState]:
        """torch's stage of ``optimizer`` since the last update; ``None`` if torch holds nothing for it."""
        state = self._states().get(id(optimizer))
        return None if state is None else state["stage"]

    def has_inf_check(self, optimizer: Any) -> bool:
        state = self._states().get(id(optimizer))
        return state is not None and bool(state["found_inf_per_device"])

    def found_inf(self, optimizer: Any) -> Optional[Tensor]:
        """A copy of the inf check recorded for ``optimizer``, summed over devices; ``None`` if none was recorded.

        A copy: ``update()`` sums the inf checks of all optimizers into the first one, in place.
        """
        state = self._states().get(id(optimizer))
        found_infs = [] if state is None else list(state["found_inf_per_device"].values())
        if not found_infs:
            return None
        return sum((f.to(found_infs[0].device) for f in found_infs[1:]), found_infs[0].clone())

    def has_inf_checks(self) -> bool:
        """Whether an unscale (ours or the user's) recorded an inf check since the last update."""
        return any(state["found_inf_per_device"] for state in self._states().values())

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

    # ---- torch's public transitions ---------------------------------------------------------------------------------

    def unscale_(self, optimizer: Any) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any, **kwargs: Any) -> Any:
        return self.scaler.step(optimizer, **kwargs)

    def update(self) -> None:
        self.scaler.update()
        self._set_aside = 0

    # ---- the four writes ------------------------------------------------------------------------------------------

    def adopt(self, optimizer: Any, aliases: Iterable[Any]) -> None:
        """Move what the user did through a wrapper (``scaler.unscale_(lightning_optimizer)``) to the optimizer."""
        states = self._states()
        for alias in aliases:
            alias_state = states.pop(id(alias), None)
            if (
                alias_state is not None
                and alias_state["stage"] is not OptState.READY
                and self.stage(optimizer) in (None, OptState.READY)
            ):
                states[id(optimizer)] = alias_state

    def set_aside(self, optimizer: Any) -> None:
        """Free ``optimizer``'s id for another step cycle; its inf check still counts for the update."""
        self._set_aside_key(id(optimizer))

    def _set_aside_key(self, key: int) -> None:
        states = self._states()
        state = states.pop(key, None)
        if state is not None and state["found_inf_per_device"]:
            self._set_aside += 1
            states[-self._set_aside] = state  # negative keys are no object's id

    def set_aside_when_collected(self, optimizer: Any) -> None:
        """torch keys the state by ``id()``, which a collected optimizer hands on to the next object (an inner-loop
        optimizer created per step): a new optimizer never inherits its stage."""
        release = weakref.finalize(optimizer, _set_aside_collected, weakref.ref(self), id(optimizer))
        release.atexit = False  # type: ignore[misc]  # at interpreter exit there is no next optimizer to protect

    def drop_empty(self, optimizer: Optional[Any] = None) -> None:
        """Drop the entry of ``optimizer`` (``None``: of every optimizer) that recorded no inf check."""
        states = self._states()
        keys = list(states) if optimizer is None else [id(optimizer)]
        for key in keys:
            if key in states and not states[key]["found_inf_per_device"]:
                del states[key]

    def zero_dim_inf_checks(self, optimizer: Any) -> None:
        """Give a fused optimizer 0-dim inf checks: its kernels subtract them from 0-dim step counters, and
        ``ShardedGradScaler`` records shape ``[1]`` (torch then fails with "output with shape [] doesn't match")."""
        state = self._states().get(id(optimizer))
        if state is not None:
            per_device = state["found_inf_per_device"]
            for device, found_inf in per_device.items():
                if found_inf.dim() != 0:
                    per_device[device] = found_inf.reshape(())


def _set_aside_collected(adapter_ref: "weakref.ref[_TorchScalerAdapter]", key: int) -> None:
    adapter = adapter_ref()
    if adapter is not None:
        adapter._set_aside_key(key)


@dataclass
class _OptimizerRecord:
    """What the recipe knows of an optimizer beyond torch's stage, which only lasts until the next update."""

    # its gradients were unscaled before the last update and neither stepped nor cleared: torch forgot them
    unscaled_before_update: bool = False
    # a scaled backward reached its parameters after their unscale: the gradients mix two scales
    mixed_scales: bool = False
    # stepped since the last update without the scaler (nothing reached it): torch holds nothing for it
    stepped_plainly: bool = False
    # the recipe's count of scaled losses at its last step, and (weakly) the gradient tensor of its first parameter
    # then: both unchanged, no backward ran since and nobody assigned new gradients (metadata, never values), so its
    # gradients are the true ones it stepped on, which clipping after `opt.step()` must not unscale again
    stepped_at: int = -1
    stepped_gradient: Optional[Callable[[], Optional[Tensor]]] = None

    def clear(self) -> None:
        self.unscaled_before_update = self.mixed_scales = self.stepped_plainly = False


class _StepSkips:
    """Whether each optimizer's last step was skipped for inf/NaN gradients, and how many steps were.

    torch's scaler decides a skip on the host: ``optimizer.step()`` runs only without an inf/NaN. So a step whose
    ``step()`` ran (a step hook sees it) was not skipped, and telling so costs no device synchronisation; the inf check
    of one whose ``step()`` did not run is read from the device only when someone asks. An optimizer that takes the
    inf check into its own kernel (``fused=True``) always runs ``step()``: its answer is always the inf check. The count
    of skipped steps stays on the device, and holds only the inf checks of those steps.
    """

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary[Any, Union[bool, Tensor]] = weakref.WeakKeyDictionary()
        self._step_hooks: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # optimizers in the scaler's step now, by id: what their step hook saw
        self._running: dict[int, list] = {}
        self._pending: list[Tensor] = []
        self._total: Optional[Tensor] = None

    @contextmanager
    def observe(self, optimizer: Any) -> Generator[list, None, None]:
        """Around the scaler's step of ``optimizer``: the list it yields is non-empty if its own ``step()`` ran."""
        if optimizer not in self._step_hooks and hasattr(optimizer, "register_step_post_hook"):
            self._step_hooks[optimizer] = optimizer.register_step_post_hook(
                functools.partial(_step_ran_hook, weakref.ref(self))
            )
        ran: list = []
        self._running[id(optimizer)] = ran
        try:
            yield ran
        finally:
            del self._running[id(optimizer)]

    def record(self, optimizer: Any, found_inf: Optional[Tensor], ran: bool) -> None:
        """The step of ``optimizer`` checked ``found_inf`` (``None``: nothing it could skip on)."""
        if found_inf is None:
            self._last.pop(optimizer, None)
            return
        in_kernel = getattr(optimizer, "_step_supports_amp_scaling", False)
        if ran and not in_kernel:
            self._last[optimizer] = False  # not skipped, and nothing to count
            return
        # torch decided a skip on the host when `step()` did not run; only an in-kernel check must be read to tell
        self._last[optimizer] = found_inf if in_kernel else True
        self._pending.append(found_inf)
        if len(self._pending) >= 64:  # a fused optimizer's every step: bounded
            self._fold()

    def forget(self, optimizer: Any) -> None:
        self._last.pop(optimizer, None)

    def release(self) -> None:
        """Take the step hooks off the optimizers (training ended); the next step puts them back."""
        for handle in list(self._step_hooks.values()):
            handle.remove()
        self._step_hooks.clear()

    def was_skipped(self, optimizer: Any, sync: bool = True) -> bool:
        last = self._last.get(optimizer, False)
        if isinstance(last, bool):
            return last
        return sync and bool(last.item() > 0)

    def _fold(self) -> None:
        skipped = (torch.cat([f.reshape(1) for f in self._pending]) > 0).sum()
        self._total = skipped if self._total is None else self._total + skipped
        self._pending.clear()

    @property
    def total(self) -> Tensor:
        if self._pending:
            self._fold()
        return torch.zeros((), dtype=torch.int64) if self._total is None else self._total

    def __getstate__(self) -> dict[str, Any]:
        return {"_pending": self._pending, "_total": self._total}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.__dict__.update(state)


def _step_ran_hook(skips_ref: "weakref.ref[_StepSkips]", optimizer: Any, *_: Any) -> None:
    skips = skips_ref()
    if skips is not None and id(optimizer) in skips._running:
        skips._running[id(optimizer)].append(True)


class GradScalerRecipe:
    """Drives a gradient scaler (``torch.amp.GradScaler``, FSDP's ``ShardedGradScaler``) through PyTorch's AMP recipe.

    Each optimizer is in torch's own ``OptState`` (:meth:`stage`): ``READY`` (gradients, if any, multiplied by the
    scale), ``UNSCALED`` (true gradients, inf check recorded), ``STEPPED`` (stepped or skipped since the update). The
    scaler is in an :class:`IterationPhase`. Every event is a transition:

    - :meth:`scale`: settles an owed update when ``OUTSIDE``; ``STEPPED`` -> ``READY`` (a new step cycle, the old inf
      check kept for the update); ``UNSCALED`` stays, and the backward watches its parameters: reaching cleared
      gradients starts a fresh cycle, reaching live ones mixes two scales (refused at the step).
    - :meth:`unscale`: ``READY`` -> ``UNSCALED`` through ``scaler.unscale_``; idempotent; after a step (clipping
      after ``opt.step()``), where torch raises, nothing happens: the gradients stepped on are true ones already.
    - :meth:`step`: ``READY``/``UNSCALED`` -> ``STEPPED``, always through ``scaler.unscale_`` (FSDP's inf checks
      all-reduce, so every rank must); a step with nothing to step on is the optimizer's own. ``STEPPED`` -> a new step
      cycle, for gradients the caller assigned itself. Once every optimizer of the run stepped, the update follows.
    - :meth:`iteration_start` / :meth:`iteration_end`: settle; ``OUTSIDE`` <-> ``INSIDE``.
    - :meth:`state_dict`: pure; :meth:`load_state_dict`: the owed update is consumed, every optimizer ``READY``.

    A user's own ``scaler.unscale_(opt)`` or ``scaler.step(opt)`` (with the optimizer or a tracked wrapper of it) is
    torch's stage, read as it is: following PyTorch's recipe to the letter gives the recipe's result.

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
        must be cleared before a backward reaches them again: the scale of new gradients cannot be told apart from the
        old ones afterwards, so the step raises instead.

    """

    def __init__(
        self,
        scaler: Any,
        aliases: Callable[[Any], Iterable[Any]] = lambda optimizer: (),
        optimizers: Callable[[], Iterable[Any]] = tuple,
        api: _RunAPI = _FABRIC_API,
    ) -> None:
        """
        Args:
            scaler: the gradient scaler.
            aliases: returns the wrappers of an optimizer (``LightningOptimizer``, Fabric's wrapper) that a user may
                hand to ``scaler.unscale_`` instead of the optimizer.
            optimizers: returns every optimizer of the run, where the caller knows them (the Trainer's, those
                ``fabric.setup`` wrapped). Once each of them has stepped, the update is applied right away: it is
                the iteration's single update, and ``scaler.get_scale()`` after a step shows whether it was skipped.
            api: what the user calls to backpropagate and to step, named by the errors.

        """
        self.scaler = scaler
        self._aliases = aliases
        self._optimizers = optimizers
        self.phase = IterationPhase.OUTSIDE
        self._torch = _TorchScalerAdapter(scaler)
        self._records: weakref.WeakKeyDictionary[Any, _OptimizerRecord] = weakref.WeakKeyDictionary()
        self._updates = 0
        # how many losses `scale` scaled, and how many had been at the last update (none since: no new gradients)
        self._scaled_losses = 0
        self._losses_at_update = 0
        self._skips = _StepSkips()
        self._api = api
        # the opt-in misuse watch (`watch_unscaled_backward`); `None`: off, nothing on the parameters
        self._watch: Optional[Any] = None
        # hooks on the parameters of optimizers unscaled and not stepped, for the coming scaled backward
        self._unscaled_watch: list[Any] = []

    def stage(self, optimizer: Any) -> OptState:
        """Where ``optimizer``'s gradients are: torch's stage since the last update, else what torch forgot."""
        torch_stage = self._torch.stage(optimizer)
        if torch_stage is not None and torch_stage is not OptState.READY:
            return torch_stage
        record = self._records.get(optimizer)
        if record is not None and record.unscaled_before_update:
            return OptState.UNSCALED
        if record is not None and record.stepped_plainly:
            return OptState.STEPPED
        return OptState.READY

    def _record(self, optimizer: Any) -> _OptimizerRecord:
        record = self._records.get(optimizer)
        if record is None:
            record = self._records[optimizer] = _OptimizerRecord()
            self._torch.set_aside_when_collected(optimizer)
        return record

    def _candidates(self, optimizers: Callable[[], Iterable[Any]] = tuple) -> list[Any]:
        others = () if optimizers == self._optimizers else optimizers()  # the plugins pass the recipe's own
        return list({id(o): o for o in (*self._records.keys(), *self._optimizers(), *others)}.values())

    # ---- events -------------------------------------------------------------------------------------------------

    def scale(self, loss: Tensor, optimizers: Callable[[], Iterable[Any]] = tuple) -> Tensor:
        """A loss is about to be backpropagated: multiply it by the scale.

        Args:
            loss: the loss.
            optimizers: returns every optimizer (and wrapper) the caller knows of, so that gradients the user unscaled
                through the scaler themselves are seen too.

        Raises:
            RuntimeError: if parameters hold gradients that a backward without the scale accumulated. Nothing is
                changed then.

        """
        if self._watch is not None:  # before any transition: a refused backward changes nothing
            self._watch.refuse("the next scaled backward")
        if self.phase is IterationPhase.OUTSIDE and not self._gradients_wait_for_a_step():
            self._settle()
        self._scaled_losses += 1
        self._stop_watching_unscaled()
        if self._records or self._torch.has_inf_checks():
            for optimizer in self._candidates(optimizers):
                self._begin_step_cycle(optimizer)
        return self.scaler.scale(loss)

    def _gradients_wait_for_a_step(self) -> bool:
        """Whether an optimizer of the run that has not stepped since the last update holds gradients produced since
        then: the owed update must wait (for its step, or the iteration's end), or this backward's gradients would meet
        a second scale. Read from metadata: torch's stage, the recipe's count of scaled losses, ``.grad`` presence."""
        if not self._torch.has_inf_checks():
            return False  # nothing owed
        produced_since = self._scaled_losses != self._losses_at_update
        for optimizer in self._optimizers():
            stage = self.stage(optimizer)
            if stage is OptState.STEPPED or (stage is OptState.READY and not produced_since):
                continue
            if _has_gradients(optimizer):
                return True
        return False

    def _begin_step_cycle(self, optimizer: Any) -> None:
        self._torch.adopt(optimizer, self._aliases(optimizer))
        if self.stage(optimizer) is OptState.UNSCALED:
            # legal as long as this backward does not reach its parameters (two networks, each clipped after its own
            # backward; a GAN's toggled optimizers); when it does, cleared gradients (None or zeros) start afresh
            self._watch_unscaled(optimizer)

    def _restart_step_cycle(self, optimizer: Any) -> None:
        self._torch.set_aside(optimizer)
        self._record(optimizer).clear()

    def _watch_unscaled(self, optimizer: Any) -> None:
        """Until this backward ends: if it reaches ``optimizer``'s parameters, its unscaled gradients would mix two
        scales, or, when they were cleared, it starts a fresh step cycle; if it does not, the optimizer stays unscaled,
        and its step is skipped on the inf check its unscale recorded, as in torch. Which of the two is told only when
        the backward reaches them, before it accumulates: a backward that does not (two networks, each clipped after
        its own backward) reads nothing."""
        self._record(optimizer)
        hook = functools.partial(_unscaled_reached_hook, weakref.ref(self), optimizer)
        self._unscaled_watch.extend(
            p.register_hook(hook)
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad
        )

    def _stop_watching_unscaled(self) -> None:
        for handle in self._unscaled_watch:
            handle.remove()
        self._unscaled_watch.clear()

    @contextmanager
    def backward(self) -> Generator[None, None, None]:
        """The backward of a loss returned by :meth:`scale`.

        Raises:
            RuntimeError: if parameters hold gradients that a backward without the scale accumulated: this backward
                would add scaled gradients to them.

        """
        try:
            with self._watch.scaled_backward() if self._watch is not None else nullcontext():
                yield
        finally:
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
                raise _unscales_itself_error(optimizer)
            return
        stage = self._prepare(optimizer, aliases, f"the unscale of {type(optimizer).__name__}'s gradients")
        if self._unreached_since_step(optimizer):
            return  # clipping after `opt.step()`: the gradients it stepped on are true ones already
        if stage is OptState.STEPPED:
            # stepped before the update and reached by a backward since (a critic stepped again): a new step cycle
            self._restart_step_cycle(optimizer)
            stage = OptState.READY
        if stage is OptState.READY:
            self._torch.unscale_(optimizer)

    def _prepare(self, optimizer: Any, aliases: Iterable[Any], where: str) -> OptState:
        """The checks before an unscale or a step: the refusals, and what was cleared since it was unscaled."""
        if self._watch is not None:
            self._watch.refuse(where, optimizer)
        self._torch.adopt(optimizer, aliases)
        record = self._record(optimizer)  # known from now on: an update that forgets its unscale marks it
        stage = self.stage(optimizer)
        if stage is OptState.READY and not self._torch.has_scaled() and _has_gradients(optimizer):
            # free: read only until the first loss is scaled, where torch's own `unscale_` fails with a bare assertion
            raise _nothing_scaled_error(optimizer, self._api)
        if record.mixed_scales or record.unscaled_before_update:
            if not _holds_live_gradients(optimizer):
                # zeroed since (`zero_grad(set_to_none=False)`): nothing unscaled remains, a fresh step cycle, as
                # torch's scaler starts one after its update
                self._restart_step_cycle(optimizer)
                return self.stage(optimizer)
            if record.mixed_scales:
                raise _mixed_scales_error(optimizer)
        return stage

    def step(self, optimizer: Optimizer, aliases: Iterable[Any] = (), **kwargs: Any) -> Any:
        """Step ``optimizer`` through the scaler, which unscales first if nobody did and skips the step on inf/NaN.

        Raises:
            RuntimeError: if given a closure (as torch's scaler), if parameters of ``optimizer`` hold gradients that a
                backward without the scale accumulated, or its gradients were unscaled before an earlier update.
                Nothing is changed then.

        """
        if not self.scaler.is_enabled():
            return optimizer.step(**kwargs)
        if kwargs.get("closure") is not None:
            raise _closure_error(optimizer)
        stage = self._prepare(optimizer, aliases, f"`{type(optimizer).__name__}.step()`")
        record = self._records[optimizer]
        if record.unscaled_before_update:
            raise _unscaled_earlier_error(optimizer)
        if stage is OptState.STEPPED:
            # a second step cycle without a scaled backward in between: gradients the caller assigned itself
            # (gradient surgery with `torch.autograd.grad(scaler.scale(loss), ...)`)
            self._restart_step_cycle(optimizer)
            stage = OptState.READY
        unscales_itself = _handles_unscaling_itself(optimizer)
        # always through the scaler, whatever the gradients hold: FSDP's `ShardedGradScaler.unscale_` all-reduces the
        # inf check, so every rank must unscale, in the same order, even one whose shard has no gradients
        if stage is OptState.READY and self._torch.has_scaled() and not unscales_itself:
            self._torch.unscale_(optimizer)
        if not unscales_itself and not self._torch.has_inf_check(optimizer):
            # no gradient reached this optimizer: torch's scaler would fail with "No inf checks were recorded for this
            # optimizer", so its own step is taken, which cannot overflow
            self._torch.drop_empty(optimizer)
            output = optimizer.step(**kwargs)
            record.stepped_plainly = True
            self._stepped(optimizer, record)
            self._skips.forget(optimizer)
            self._update_once_every_optimizer_stepped(optimizer)
            return output
        _protect_fused_sgd_momentum(optimizer)
        if getattr(optimizer, "_step_supports_amp_scaling", False) and not unscales_itself:
            self._torch.zero_dim_inf_checks(optimizer)
        watch = self._watch.recipe_step(optimizer) if self._watch is not None else nullcontext()
        with watch, self._skips.observe(optimizer) as ran:
            output = self._torch.step(optimizer, **kwargs)
        self._stepped(optimizer, record)
        self._skips.record(optimizer, self._torch.found_inf(optimizer), ran=bool(ran))
        self._update_once_every_optimizer_stepped(optimizer)
        return output

    def _stepped(self, optimizer: Any, record: _OptimizerRecord) -> None:
        record.stepped_at = self._scaled_losses
        gradient = _first_gradient(optimizer)
        record.stepped_gradient = _NO_GRADIENT if gradient is None else weakref.ref(gradient)

    def _unreached_since_step(self, optimizer: Any) -> bool:
        """Whether no scaled backward ran since ``optimizer``'s last step: READY then holds the true gradients it
        stepped on (one optimizer: the update followed the step), and unscaling would divide them by the scale.
        Gradients assigned since (``torch.autograd.grad`` of the scaled loss) are new tensors: they are unscaled."""
        record = self._records[optimizer]
        if record.stepped_at != self._scaled_losses or record.stepped_gradient is None:
            return False
        return record.stepped_gradient() is _first_gradient(optimizer)

    def _update_once_every_optimizer_stepped(self, optimizer: Any) -> None:
        # the last step of the iteration: nothing is left for the scale to unscale, so the update is due now, exactly
        # where PyTorch's recipe puts it (a second step cycle of one optimizer then starts afresh, as in torch)
        optimizers = list(self._optimizers())
        if any(o is optimizer for o in optimizers) and all(self.stage(o) is OptState.STEPPED for o in optimizers):
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
        whose inf check must still lower the scale)."""
        if self._torch.has_inf_checks():
            for optimizer in self._candidates():
                self._torch.adopt(optimizer, self._aliases(optimizer))
                if self._torch.stage(optimizer) is OptState.UNSCALED and self._torch.has_inf_check(optimizer):
                    # unscaled, not stepped: the gradients stay unscaled, and torch's update forgets that
                    self._record(optimizer).unscaled_before_update = True
            self._torch.update()
            self._updates += 1
            self._losses_at_update = self._scaled_losses
            watch = self._watch
            if watch is not None and self._updates >= watch.ends_at_update and not watch.accumulations:
                self.unwatch()
        self._torch.drop_empty()
        for record in self._records.values():
            record.stepped_plainly = False

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
        self._skips.release()
        self._records.clear()  # this fit's optimizers: the next fit has its own

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from ``state_dict``: the update owed so far is consumed (the loaded state replaces what it would
        leave), and every optimizer starts a fresh step cycle."""
        self._settle()
        self._torch.scaler.load_state_dict(state_dict)
        for record in self._records.values():
            record.clear()

    # ---- the opt-in misuse watch ------------------------------------------------------------------------------

    def watch_unscaled_backward(self, optimizers: Iterable[Optimizer]) -> None:
        """Switch the misuse watch on (:mod:`~lightning.fabric.plugins.precision.amp_misuse_watch`) for
        ``optimizers``: gradients accumulated by a backward that :meth:`scale` did not scale, and a raw ``step()`` on
        scaled gradients, raise for the next ``WATCHED_UPDATES`` scaler updates; then, or with :meth:`unwatch`, its
        hooks are removed. Costs one Python call per parameter per backward while on."""
        from lightning.fabric.plugins.precision.amp_misuse_watch import WATCHED_UPDATES, _UnscaledBackwardWatch

        if not self.scaler.is_enabled():
            return
        if self._watch is None:
            self._watch = _UnscaledBackwardWatch(lambda optimizer: self.stage(optimizer) is OptState.READY, self._api)
        self._watch.watch(optimizers, ends_at_update=self._updates + WATCHED_UPDATES)

    @property
    def watched(self) -> int:
        """How many optimizers and parameters the misuse watch holds a hook on (0 when it is off)."""
        return 0 if self._watch is None else self._watch.watching

    def unwatch(self) -> None:
        if self._watch is not None:
            self._watch.unwatch()
            self._watch = None

    # ---- signals ------------------------------------------------------------------------------------------------

    def step_was_skipped(self, optimizer: Optimizer, sync: bool = True) -> bool:
        """Whether the last :meth:`step` of ``optimizer`` was skipped because its gradients held inf/NaN.

        ``False`` before its first step, and for a step with no gradients. An optimizer that checks inf/NaN in its own
        kernel (``fused=True``) is answered by reading its inf check from the device; with ``sync=False`` it reads as
        not skipped instead (a step-interval scheduler's check, which must not synchronise every step).

        """
        return self._skips.was_skipped(optimizer, sync)

    def forget_last_step(self, optimizer: Optimizer) -> None:
        """``optimizer`` did not step in this iteration (nothing to step on): no step of it was skipped, and an unscale
        without gradients (clipping on a batch without backward) leaves no state behind."""
        self._skips.forget(optimizer)
        self._torch.drop_empty(optimizer)

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
        return self._skips.total

    def __getstate__(self) -> dict[str, Any]:
        # launchers pickle plugins (`ddp_spawn`); hooks and weak records stay in this process
        state = self.__dict__.copy()
        state.update(dict.fromkeys(("_records", "_aliases", "_optimizers", "_watch")), _unscaled_watch=[])
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._records = weakref.WeakKeyDictionary()
        self._aliases = lambda optimizer: ()
        self._optimizers = tuple


# ---- the recipe's refusals: what went wrong, why, and what to do instead ----------------------------------------


def _unscales_itself_error(optimizer: Any) -> RuntimeError:
    """Clipping an optimizer whose ``step()`` takes a ``grad_scaler``."""
    return RuntimeError(
        f"The optimizer {type(optimizer).__qualname__} unscales gradients inside its own `step()` (it takes"
        " a `grad_scaler` argument), so its gradients stay multiplied by the loss scale until then and"
        " cannot be clipped or inspected before the step without being unscaled twice. Use an optimizer"
        " that follows torch's `grad_scale`/`found_inf` protocol (any built-in `fused=True` optimizer),"
        " or do not clip gradients with this one."
    )


def _mixed_scales_error(optimizer: Any) -> RuntimeError:
    """A step or unscale on gradients a scaled backward added to after their unscale."""
    return RuntimeError(
        f"The gradients of {type(optimizer).__name__} were unscaled (by gradient clipping or"
        " `scaler.unscale_`) but the optimizer did not step before a later backward added new gradients"
        " multiplied by the loss scale to them, so they now mix two scales. With a gradient scaler, clip or"
        " unscale only in iterations that step the optimizer (inside your gradient-accumulation condition,"
        " for example), or zero its gradients before the next backward. Nothing was changed: zero its"
        " gradients to go on."
    )


def _closure_error(optimizer: Any) -> RuntimeError:
    """``step(closure)`` under an enabled scaler, which torch's scaler refuses too."""
    return RuntimeError(
        f"`{type(optimizer).__name__}.step(closure)` was called under a gradient scaler. torch's GradScaler"
        ' does not support closures ("Closure use is not currently supported if GradScaler is enabled"): the'
        " gradients the closure computes are multiplied by the loss scale and must be unscaled and checked for"
        " inf/NaN before the step. Run the closure yourself (`loss = closure()`), then call `step()` without"
        " it. The step was not taken."
    )


def _nothing_scaled_error(optimizer: Any, api: _RunAPI) -> RuntimeError:
    """A step or unscale of gradients while the scaler has not scaled any loss: no backward went through it."""
    return RuntimeError(
        f"Call `{api.backward}` instead of `loss.backward()`: with a gradient scaler (precision='16-mixed') every"
        f" backward must go through it. The gradients of {type(optimizer).__name__} come from a backward without the"
        " loss scale (the scaler has not scaled any loss yet), so the scaler can neither unscale them nor check them"
        " for inf/NaN. Nothing was changed."
    )


def _unscaled_earlier_error(optimizer: Any) -> RuntimeError:
    """A step on gradients unscaled before an update that changed the scale."""
    return RuntimeError(
        f"The gradients of {type(optimizer).__name__} were unscaled in an earlier iteration, before the loss"
        " scale was updated, and the optimizer steps on them only now. Step in the iteration that clips or"
        " unscales its gradients, or zero them and compute them again. The step was not taken."
    )


def _unscaled_reached_hook(recipe_ref: "weakref.ref[GradScalerRecipe]", optimizer: Any, grad: Tensor) -> None:
    # before the first accumulation into `optimizer`'s parameters: every one of them still holds what it held
    recipe = recipe_ref()
    if recipe is None or recipe.stage(optimizer) is not OptState.UNSCALED:
        return  # restarted by an earlier parameter of this backward
    cleared = not _holds_live_gradients(optimizer)
    if cleared:
        recipe._restart_step_cycle(optimizer)
    else:
        recipe._record(optimizer).mixed_scales = True


def _is_live(grad: Optional[Tensor]) -> bool:
    """Whether ``grad`` holds anything: ``zero_grad(set_to_none=False)`` leaves zeros, which are not live."""
    return grad is not None and bool(grad.ne(0).any())


def _NO_GRADIENT() -> None:
    return None


def _first_gradient(optimizer: Any) -> Optional[Tensor]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return p.grad
    return None


def _has_gradients(optimizer: Any) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


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
    #: what a step of LBFGS under the scaler raises: the type each package raised before
    _lbfgs_error: type[Exception] = TypeError
    #: what the user calls, for the errors
    _run_api: _RunAPI = _FABRIC_API

    def _init_amp_recipe(self) -> None:
        self._scaler_recipe: Optional[GradScalerRecipe] = None
        # the wrappers of this fit's optimizers (this `fabric.setup`'s): dropped when training ends
        self._optimizer_wrappers: weakref.WeakSet = weakref.WeakSet()
        #: whether the opt-in misuse watch (`amp_misuse_watch`) runs: off by default, it puts a hook on every parameter
        self.watch_misuse = False

    def _check_scaler(self) -> None:
        """Before training: refuse a scaler torch disabled (constructing the plugin on a machine without the scaler's
        device is fine, training with it is not)."""
        _check_scaler_is_enabled(self.scaler, f"`{type(self).__name__}`")

    @property
    def _recipe(self) -> GradScalerRecipe:
        assert self.scaler is not None
        if self._scaler_recipe is None or self._scaler_recipe.scaler is not self.scaler:
            self._scaler_recipe = GradScalerRecipe(
                self.scaler, aliases=self._aliases, optimizers=self._known_optimizers, api=self._run_api
            )
        return self._scaler_recipe

    def _refuse_lbfgs(self, optimizer: Any) -> None:
        if isinstance(optimizer, LBFGS):
            raise self._lbfgs_error(
                "AMP with a gradient scaler and the LBFGS optimizer are not compatible: LBFGS evaluates its closure"
                " several times per step and reads the gradients in between, which the scaler cannot unscale."
                " Use `precision='bf16-mixed'` or `'32-true'` with LBFGS."
            )

    def _finish_amp_recipe(self) -> None:
        """Training ends (the plugin's teardown): the owed update is applied, the watch goes, and this fit's optimizers
        are forgotten (a second fit with this plugin has its own)."""
        if self._scaler_recipe is not None:
            self._scaler_recipe.finish()
            self._scaler_recipe.unwatch()
        self._optimizer_wrappers = weakref.WeakSet()

    def training_iteration_start(self) -> None:
        """A loop opens a training iteration (the precision plugins' hook of both packages)."""
        if self.scaler is not None:
            self._recipe.iteration_start()

    def training_iteration_end(self) -> None:
        """A loop closes a training iteration, also when it raised: the iteration's single update."""
        if self.scaler is not None:
            self._recipe.iteration_end()

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
