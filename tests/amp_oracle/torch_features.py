"""What the installed torch can do, for the tests of the torch matrix (oldest torch 2.1.2 to the newest).

``lightning`` 2.6.6 declares ``torch>=2.1``; the fork's tests run on 2.1.2, 2.13.0 and 2.14.1 (``make test-matrix``).
Features are probed, not inferred from the version, and each marker's reason says what is missing and from which torch
it exists, so a skip report reads as the list of what this torch cannot do. The behaviour tests of both packages
(``tests_fabric`` and ``tests_pytorch``) import their markers from here, the one place that knows torch's history.

What torch 2.1.2 lacks, measured (``tests_fabric/plugins/precision/test_torch_behaviour_pins.py`` pins each fact):

- ``torch.amp.GradScaler`` and ``torch.amp.grad_scaler`` (from 2.3; before, ``torch.cuda.amp.grad_scaler``, CUDA only:
  on a CPU it disables itself with a warning, and ``MixedPrecision("16-mixed", "cpu")`` of stock 2.6.6 gets a disabled
  scaler), so no ``GradScaler("cpu")``;
- fp16 autocast on CPU (entering ``torch.autocast("cpu", dtype=torch.float16)`` raises "AutocastCPU only support
  Bfloat16"): ``precision="16-mixed"`` cannot run on a CPU at all, with any scaler;
- fused optimizers on CPU (``Adam``/``AdamW(fused=True)`` need CUDA; ``SGD``/``Adagrad`` have no ``fused`` argument);
- ``torch.is_autocast_enabled(device_type)`` and ``torch.get_autocast_dtype`` (from 2.4);
- a safe autocast weight cache (before 2.11, pytorch#165068: a cast cached under ``no_grad`` is reused by a later
  forward with grad enabled, whose output then has no ``grad_fn``).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from packaging.version import Version

TORCH = Version(torch.__version__).release
_THIS_TORCH = f"this is torch {torch.__version__}"

#: ``torch.amp.GradScaler`` (device-generic, ``GradScaler("cpu")``): torch >= 2.3
HAS_AMP_GRAD_SCALER = hasattr(torch.amp, "GradScaler")

#: the gradient scaler class: ``torch.amp.GradScaler``, or on torch < 2.3 ``torch.cuda.amp.GradScaler`` (CUDA only;
#: ``GradScaler(enabled=False)`` works everywhere, which is what the 32-true/bf16-mixed reference loops use)
GradScaler = torch.amp.GradScaler if HAS_AMP_GRAD_SCALER else torch.cuda.amp.GradScaler

if HAS_AMP_GRAD_SCALER:
    from torch.amp.grad_scaler import OptState
else:  # torch < 2.3
    from torch.cuda.amp.grad_scaler import OptState  # noqa: F401

#: ``torch.is_autocast_enabled(device_type)`` (and ``torch.get_autocast_dtype``): torch >= 2.4
AUTOCAST_ENABLED_TAKES_DEVICE = hasattr(torch, "get_autocast_dtype")

#: autocast's weight cache cannot go stale under ``torch.no_grad``: torch >= 2.11 (pytorch#165068)
AUTOCAST_CACHE_IS_SAFE = TORCH >= (2, 11)


def _cpu_fp16_autocast() -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.1: "In CPU autocast, but the target dtype is not supported"
        try:
            with torch.autocast("cpu", dtype=torch.float16):
                return torch.mm(torch.ones(1, 1), torch.ones(1, 1)).dtype is torch.float16
        except RuntimeError:
            return False


#: fp16 autocast on CPU
CPU_FP16_AUTOCAST = _cpu_fp16_autocast()


def _cpu_fused(name: str) -> bool:
    param = torch.nn.Parameter(torch.ones(1))
    param.grad = torch.ones(1)
    try:
        getattr(torch.optim, name)([param], lr=0.1, fused=True).step()
    except (RuntimeError, TypeError):  # torch 2.1: Adam/AdamW "supported devices: ['cuda', ...]"; SGD/Adagrad: no kwarg
        return False
    return True


#: the optimizers with a fused CPU implementation in this torch (Adam/AdamW/SGD/Adagrad from about torch 2.4-2.5)
CPU_FUSED = frozenset(name for name in ("Adam", "AdamW", "SGD", "Adagrad") if _cpu_fused(name))

#: precision="16-mixed" on CPU needs both a CPU gradient scaler and fp16 autocast on CPU
CPU_16_MIXED = HAS_AMP_GRAD_SCALER and CPU_FP16_AUTOCAST

requires_cpu_grad_scaler = pytest.mark.skipif(
    not HAS_AMP_GRAD_SCALER, reason=f"torch.amp.GradScaler('cpu') needs torch >= 2.3 ({_THIS_TORCH})"
)
requires_cpu_16_mixed = pytest.mark.skipif(
    not CPU_16_MIXED,
    reason=(
        "16-mixed on CPU needs torch.amp.GradScaler('cpu') (torch >= 2.3) and fp16 autocast on CPU"
        f" ({_THIS_TORCH}, which has {'neither' if not (HAS_AMP_GRAD_SCALER or CPU_FP16_AUTOCAST) else 'only one'})"
    ),
)
requires_cpu_fp16_autocast = pytest.mark.skipif(
    not CPU_FP16_AUTOCAST,
    reason=f"fp16 autocast on CPU is missing in this torch (torch 2.1 has only bf16; {_THIS_TORCH})",
)
requires_cpu_sharded_grad_scaler = pytest.mark.skipif(
    TORCH < (2, 2), reason=f"ShardedGradScaler takes a device (CPU) from torch 2.2 ({_THIS_TORCH})"
)


def requires_cpu_fused(*names: str) -> pytest.MarkDecorator:
    """Skip unless each of ``names`` (``"AdamW"``, ``"SGD"``, ...) has a fused CPU implementation in this torch."""
    missing = [name for name in names if name not in CPU_FUSED]
    return pytest.mark.skipif(
        bool(missing),
        reason=f"no fused CPU {'/'.join(missing)} in this torch (torch 2.13 has them, 2.1 none; {_THIS_TORCH})",
    )


def cpu_grad_scaler(cls: type | None = None, **kwargs) -> torch.amp.GradScaler:
    """``cls("cpu", **kwargs)`` (``cls``: ``torch.amp.GradScaler`` or a subclass) for a test that trains 16-mixed on
    CPU; where this torch cannot, the calling test skips with the reason. A disabled scaler (``enabled=False``) works
    on every torch (before 2.3 ``cls`` is ``torch.cuda.amp.GradScaler`` or a subclass, which takes no device)."""
    cls = GradScaler if cls is None else cls
    if kwargs.get("enabled", True) is False:
        return cls("cpu", **kwargs) if HAS_AMP_GRAD_SCALER else cls(**kwargs)
    if not CPU_16_MIXED:
        pytest.skip(requires_cpu_16_mixed.kwargs["reason"])
    return cls("cpu", **kwargs)


def cuda_grad_scaler(**kwargs) -> torch.amp.GradScaler:
    """``torch.amp.GradScaler("cuda", **kwargs)`` on every torch (``torch.cuda.amp.GradScaler`` before 2.3); on a
    machine without CUDA it disables itself with a warning."""
    return torch.amp.GradScaler("cuda", **kwargs) if HAS_AMP_GRAD_SCALER else torch.cuda.amp.GradScaler(**kwargs)


def optimizer(cls: type, params, **kwargs) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)``; with ``fused=True`` on a torch without that fused CPU optimizer, the calling test
    skips with the reason. ``fused=False`` is dropped where ``cls`` has no ``fused`` argument (``SGD``, ``Adagrad`` in
    torch 2.1)."""
    if kwargs.get("fused") and cls.__name__ not in CPU_FUSED:
        pytest.skip(requires_cpu_fused(cls.__name__).kwargs["reason"])
    if "fused" in kwargs and not kwargs["fused"] and "fused" not in inspect.signature(cls.__init__).parameters:
        del kwargs["fused"]
    return cls(params, **kwargs)


def autocast_enabled(device_type: str) -> bool:
    """``torch.is_autocast_enabled(device_type)`` on every torch (before 2.4: ``is_autocast_cpu_enabled()`` for CPU)."""
    if AUTOCAST_ENABLED_TAKES_DEVICE:
        return torch.is_autocast_enabled(device_type)
    return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def require_cpu_16_mixed() -> None:
    """Skip the calling test where this torch cannot train 16-mixed on CPU at all (whatever scaler it is given)."""
    if not CPU_16_MIXED:
        pytest.skip(requires_cpu_16_mixed.kwargs["reason"])


def require_cpu_fp16_autocast() -> None:
    """Skip the calling test where this torch has no fp16 autocast on CPU (a nested ``torch.float16`` region)."""
    if not CPU_FP16_AUTOCAST:
        pytest.skip(requires_cpu_fp16_autocast.kwargs["reason"])
