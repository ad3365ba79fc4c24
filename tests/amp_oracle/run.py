"""What a run did (:class:`Run`, whichever driver trained it), the one comparison (:func:`differences`,
:func:`assert_same_run`), and the hand-written recipe's side of every comparison (:class:`RecipeRun`): PyTorch's AMP
recipe of the torch docs' "Automatic Mixed Precision examples": autocast around the forward and the loss only,
``scaler.scale(loss).backward()`` outside it, ``scaler.unscale_(opt)`` before anything reads the gradients,
``scaler.step(opt)`` for every optimizer, ``scaler.update()`` after the last step of an iteration.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from amp_oracle.world import (
    AUTOCAST_CACHE,
    INIT_SCALE,
    autocast_dtype,
    changed_since,
    inf_batch,
    inject_inf,
    late_inf_batch,
    named_params,
    new_scaler,
    optimizer_params,
    snapshot,
    trainable,
    trainer_batches,
    uses_scaler,
)


@dataclass
class Run:
    """What one training run did, whoever drove it."""

    #: the final parameters by name, on the CPU
    params: dict[str, torch.Tensor]
    #: the GradScaler's scale after every batch (``None`` without a scaler)
    scales: Optional[list[float]]
    #: per batch: did the trainable parameters change (``False``: every step of the batch was skipped); a tuple, one
    #: flag per optimizer, where the driver tells the optimizers apart
    changed: list[Any]
    #: anything the run chose to record (clip norms, autocast dtypes, the batches a resumed run trained on...)
    records: list[Any] = field(default_factory=list)
    #: per batch: the skip signal (``optimizer.step_was_skipped``; ``None`` where a package has none), a tuple per
    #: optimizer where the driver tells them apart
    skipped: Optional[list[Any]] = None
    #: the final optimizer state, per parameter in ``param_groups`` order
    state: Optional[list[dict[str, Any]]] = None
    #: per step, a copy of every gradient where the step reads it
    grads: Optional[list[dict[str, torch.Tensor]]] = None
    #: per batch: did the optimizer state change (a skipped step must leave it alone)
    state_changed: Optional[list[bool]] = None


#: ``(actual, expected) -> None`` if they are the same, else what differs
TensorCheck = Callable[[torch.Tensor, torch.Tensor], Optional[str]]


def bitwise(actual: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
    """The default :data:`TensorCheck`: same dtype, every bit equal."""
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != recipe {expected.dtype}"
    if torch.equal(actual, expected):
        return None
    return f"max abs diff {(actual.double() - expected.double()).abs().max().item():.3g}"


def _relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    diff = max((actual[n].double() - p.double()).abs().max().item() for n, p in expected.items())
    size = max(p.double().abs().max().item() for p in expected.values())
    return diff / size if math.isfinite(diff) else math.inf


def _tensor_dicts(what: str, actual: dict[str, Any], expected: dict[str, Any], check: TensorCheck) -> list[str]:
    if actual.keys() != expected.keys():
        return [f"{what}: keys {sorted(actual)} != recipe {sorted(expected)}"]
    out = []
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            problem = check(actual[key], value)
        else:
            problem = None if actual[key] == value else f"{actual[key]!r} != recipe {value!r}"
        if problem:
            out.append(f"{what}[{key}]: {problem}")
    return out


def differences(
    actual: Run,
    expected: Run,
    *,
    records: bool = False,
    check: TensorCheck = bitwise,
    grad_check: Optional[TensorCheck] = None,
) -> list[str]:
    """What differs between Lightning's run (``actual``) and the recipe's (``expected``), empty when they agree: the
    scale after every batch, what changed and what was skipped per batch, the parameters (bitwise unless ``check``
    says otherwise); the optimizer states, the batches that changed them and the gradients (by ``grad_check``, default
    ``check``) where both runs kept them; the records with ``records`` (by ``repr``: floats compare exactly and a NaN
    equals a NaN)."""
    out = []
    if None not in (actual.state_changed, expected.state_changed) and actual.state_changed != expected.state_changed:
        out.append(f"optimizer state changed per batch: {actual.state_changed} != recipe {expected.state_changed}")
    if actual.scales != expected.scales:
        out.append(f"scale trajectory: {actual.scales} != recipe {expected.scales}")
    if actual.changed != expected.changed:
        out.append(f"changed per batch: {actual.changed} != recipe {expected.changed}")
    if actual.skipped is not None and expected.skipped is not None and actual.skipped != expected.skipped:
        out.append(f"skipped per batch: {actual.skipped} != recipe {expected.skipped}")
    params = _tensor_dicts("params", actual.params, expected.params, check)
    if params:
        same_keys = actual.params.keys() == expected.params.keys()
        relative = f" (relative error {_relative_error(actual.params, expected.params):.3g})" if same_keys else ""
        out.append(f"parameters differ from the recipe{relative}: " + "; ".join(params))
    if actual.state is not None and expected.state is not None:
        for i, (a, e) in enumerate(zip(actual.state, expected.state, strict=True)):
            out += _tensor_dicts(f"state of parameter {i}", a, e, check)
    if actual.grads is not None and expected.grads is not None:
        if len(actual.grads) != len(expected.grads):
            out.append(f"{len(actual.grads)} steps read gradients, recipe {len(expected.grads)}")
        for i, (a, e) in enumerate(zip(actual.grads, expected.grads)):
            out += _tensor_dicts(f"gradients at step {i}", a, e, grad_check or check)
    if records and repr(actual.records) != repr(expected.records):
        out.append(f"records: {actual.records} != recipe {expected.records}")
    return out


def assert_same_run(
    actual: Run,
    expected: Run,
    *,
    records: bool = False,
    check: TensorCheck = bitwise,
    grad_check: Optional[TensorCheck] = None,
) -> None:
    """Lightning's run (``actual``) equals the recipe's (``expected``): :func:`differences` finds nothing."""
    found = differences(actual, expected, records=records, check=check, grad_check=grad_check)
    assert not found, "the run differs from the recipe:\n  " + "\n  ".join(found)


def assert_recipe_is_sharp(result: Run, precision: str) -> None:
    """Sanity of a recipe run: it trained, and under 16-mixed the injected inf backed the scale off."""
    assert any(result.changed), "the recipe never updated the parameters"
    if uses_scaler(precision):
        trajectory = [INIT_SCALE] + result.scales
        ratios = {b / a for a, b in zip(trajectory, trajectory[1:])}
        assert min(ratios) < 1, f"no back-off in {result.scales}"
        assert max(ratios) > 1, f"no growth in {result.scales}"
        assert all(math.log2(s).is_integer() for s in result.scales)
    else:
        assert result.scales is None
    for value in result.params.values():
        assert torch.isfinite(value).all()


class RecipeRun:
    """State of one hand-written PyTorch AMP loop: the autocast settings, the scaler, the per-batch records.

    A loop is a function ``(RecipeRun, optimizers) -> None`` (:mod:`amp_oracle.loops`) that iterates
    :meth:`batches`. Without a scaler (32, bf16-mixed) ``scaler`` is a disabled ``GradScaler``: ``scale`` returns the
    loss unchanged, ``unscale_`` and ``update`` do nothing and ``step`` calls ``optimizer.step()``, exactly as the
    torch docs suggest for switching AMP off (``enabled=use_amp``). On another ``device`` the net, the batches, the
    autocast and the scaler are that device's.
    """

    def __init__(
        self,
        net: nn.Module,
        precision: str,
        autocast_cache: bool = AUTOCAST_CACHE,
        *,
        device: str = "cpu",
        scaler: Any = None,
        init_scale: float = INIT_SCALE,
        data: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None,
    ) -> None:
        self.device = device
        self.net = net.to(device)
        self.precision = precision
        self.dtype = autocast_dtype(precision)
        #: the fork's default: on where torch makes it safe, in automatic optimization; off in manual optimization. A
        #: weight used twice is cast once with it, twice without, and its two gradients are summed in low precision
        #: with it, in fp32 without: the recipe must match the mode it is compared with, bit for bit.
        self.autocast_cache = autocast_cache
        if scaler is None:
            scaler = new_scaler(device, enabled=uses_scaler(precision), init_scale=init_scale)
        self.scaler = scaler
        self.inf_at = inf_batch(precision)
        self.late_inf_at = late_inf_batch(precision)
        self.scales: list[float] = []
        self.changed: list[bool] = []
        self.records: list[Any] = []
        #: the data (default: a Trainer run's fixed batches) and the batches of it :meth:`batches` yields:
        #: ``range(start, stop)`` (a resumed run starts later, a short one stops earlier)
        self.data = trainer_batches() if data is None else data
        self.start, self.stop = 0, len(self.data)
        #: with optimizers here, :meth:`batches` records ``changed`` per optimizer (a tuple per batch) and the result
        #: ``skipped``: the optimizer's parameters did not change
        self.tracked: list[torch.optim.Optimizer] = []

    def save_point(self, batch_idx: int, optimizers: list) -> None:
        """Where a recipe would save a checkpoint mid-iteration (between two optimizers' steps); nothing by default."""

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device, dtype=self.dtype, cache_enabled=self.autocast_cache)

    def inject(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return inject_inf(loss, batch_idx, self.inf_at)

    def inject_late(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return inject_inf(loss, batch_idx, self.late_inf_at)

    def batches(self) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Yield ``(batch_idx, (x, y))``, recording the scale and whether the parameters changed after each batch."""
        groups = [optimizer_params(opt) for opt in self.tracked] or [trainable(self.net)]
        for batch_idx in range(self.start, self.stop):
            x, y = self.data[batch_idx]
            before = [snapshot(params) for params in groups]
            yield batch_idx, (x.to(self.device), y.to(self.device))
            changed = tuple(changed_since(b, params) for b, params in zip(before, groups))
            self.changed.append(changed if self.tracked else changed[0])
            if uses_scaler(self.precision):
                self.scales.append(self.scaler.get_scale())

    def result(self) -> Run:
        return Run(
            params={name: p.cpu() for name, p in named_params(self.net).items()},
            scales=self.scales if uses_scaler(self.precision) else None,
            changed=self.changed,
            records=[r.cpu() if isinstance(r, torch.Tensor) else r for r in self.records],
            skipped=[tuple(not c for c in row) for row in self.changed] if self.tracked else None,
        )
