"""Autocast's weight cache under ``MixedPrecision``.

- Unset, it is on in automatic optimization where torch makes it safe (torch >= 2.11) and off in manual optimization,
  where a ``training_step`` may edit weights in place between two forwards, which the cache cannot see.
- Where it is on, it is cleared after every backward and after every optimizer step. Each clear has a case of its own
  that fails without it: a forward after a step with no backward in between (gradient surgery), and a forward after an
  in-place edit that follows a backward.
- A cached cast of the wrong dtype (a weight used in a nested float16 region and in the bfloat16 rest) keeps torch's
  exception, with the switch named in its message; other errors pass through untouched.
"""

import pytest
import torch
from amp_oracle.torch_features import requires_cpu_fp16_autocast
from amp_oracle.trainer import FORK, lightning_api, make_trainer
from lightning.pytorch.plugins.precision.amp import _AUTOCAST_CACHE_IS_SAFE, _is_autocast_cache_dtype_mismatch
from torch import nn

from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import MixedPrecision

needs_safe_cache = pytest.mark.skipif(
    not _AUTOCAST_CACHE_IS_SAFE, reason="autocast's cache is refused before torch 2.11"
)


class _Module(LightningModule):
    def __init__(self, automatic: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = automatic
        self.layer = nn.Linear(4, 4, bias=False)
        self.stale: list[bool] = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2)

    def record_fresh(self, batch: torch.Tensor, out: torch.Tensor) -> None:
        """Whether ``out`` is what the layer's current weights give, cast afresh."""
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            expected = self.layer(batch)
        self.stale.append(not torch.equal(out, expected))


class SharedWeightAcrossDtypes(_Module):
    """Uses one layer inside a float16 autocast region and again in the bfloat16 rest of the step."""

    def training_step(self, batch, batch_idx):
        with torch.autocast("cpu", dtype=torch.float16):
            inner = self.layer(batch)
        outer = self.layer(batch)
        return (inner.float() + outer.float()).sum()


class StepWithoutBackwardThenForward(_Module):
    """Gradient surgery: gradients from ``autograd.grad`` assigned to ``.grad``, a step, then a forward. No backward
    runs between the cached forward and the step, so only the clear after the step refreshes the cast."""

    def __init__(self) -> None:
        super().__init__(automatic=False)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.layer(batch).float().pow(2).sum()
        (grad,) = torch.autograd.grad(loss, [self.layer.weight])
        self.layer.weight.grad = grad
        opt.step()
        opt.zero_grad()
        self.record_fresh(batch, self.layer(batch))


class EditAfterBackwardThenForward(_Module):
    """A forward, its backward, an in-place edit of the weight (no step), then a forward: only the clear after the
    backward refreshes the cast."""

    def __init__(self) -> None:
        super().__init__(automatic=False)

    def training_step(self, batch, batch_idx):
        self.manual_backward(self.layer(batch).float().pow(2).sum())
        self.optimizers().zero_grad()
        with torch.no_grad():
            self.layer.weight.mul_(0.5)
        self.record_fresh(batch, self.layer(batch))


class EditBetweenForwards(_Module):
    """Reptile-style: a forward, an in-place update of the weight with ``autograd.grad``, and a second forward in the
    same ``training_step``. With the cache on nothing can tell the cast is stale; the default leaves it off here."""

    def __init__(self) -> None:
        super().__init__(automatic=False)

    def training_step(self, batch, batch_idx):
        first = self.layer(batch).float().pow(2).sum()
        (grad,) = torch.autograd.grad(first, [self.layer.weight])
        with torch.no_grad():
            self.layer.weight.sub_(0.1 * grad)
        self.record_fresh(batch, self.layer(batch))


class PlainAutomatic(_Module):
    def training_step(self, batch, batch_idx):
        return self.layer(batch).float().pow(2).sum()


def _fit(model: LightningModule, plugin: MixedPrecision) -> None:
    make_trainer(lightning_api(FORK), "bf16-mixed", plugin=plugin).fit(model)


def test_cache_default_before_fit_follows_torch_version():
    assert MixedPrecision("bf16-mixed", "cpu").cache_enabled is _AUTOCAST_CACHE_IS_SAFE
    assert MixedPrecision("bf16-mixed", "cpu").autocast_context_manager()._cache_enabled is _AUTOCAST_CACHE_IS_SAFE
    assert MixedPrecision("bf16-mixed", "cpu", cache_enabled=False).autocast_context_manager()._cache_enabled is False


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_cache_default_follows_the_optimization_mode(automatic):
    plugin = MixedPrecision("bf16-mixed", "cpu")
    _fit(PlainAutomatic() if automatic else EditBetweenForwards(), plugin)
    assert plugin.cache_enabled is (_AUTOCAST_CACHE_IS_SAFE and automatic)


@needs_safe_cache
def test_explicit_cache_stays_on_in_manual_optimization():
    plugin = MixedPrecision("bf16-mixed", "cpu", cache_enabled=True)
    _fit(EditBetweenForwards(), plugin)
    assert plugin.cache_enabled is True


@pytest.mark.parametrize(
    ("module", "cache_enabled", "stale"),
    [
        pytest.param(EditBetweenForwards, None, False, id="in-place-edit-between-forwards-seen-by-default"),
        # the reason for the manual default: with the cache on, the second forward reuses the first forward's cast
        pytest.param(EditBetweenForwards, True, True, marks=needs_safe_cache, id="in-place-edit-stale-with-cache-on"),
        pytest.param(StepWithoutBackwardThenForward, True, False, marks=needs_safe_cache, id="step-without-backward"),
        pytest.param(EditAfterBackwardThenForward, True, False, marks=needs_safe_cache, id="edit-after-backward"),
    ],
)
def test_a_forward_sees_the_current_weights(module, cache_enabled, stale):
    model = module()
    _fit(model, MixedPrecision("bf16-mixed", "cpu", cache_enabled=cache_enabled))
    assert model.stale == [stale, stale]


@needs_safe_cache
def test_weight_in_two_dtypes_names_the_switch():
    model = SharedWeightAcrossDtypes()
    before = model.layer.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"same dtype(.|\n)*cache_enabled=False") as info:
        _fit(model, MixedPrecision("bf16-mixed", "cpu"))
    assert type(info.value) is RuntimeError  # torch's own exception, not a new one
    assert torch.equal(model.layer.weight, before)  # nothing was computed with the wrongly typed cast


@requires_cpu_fp16_autocast
def test_weight_in_two_dtypes_runs_with_cache_off():
    model = SharedWeightAcrossDtypes()
    before = model.layer.weight.detach().clone()
    _fit(model, MixedPrecision("bf16-mixed", "cpu", cache_enabled=False))
    assert not torch.equal(model.layer.weight, before)


def _error_of(fn) -> RuntimeError:
    with pytest.raises(RuntimeError) as info:
        fn()
    return info.value


def _nested(layer: nn.Module, x: torch.Tensor) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.float16):
            layer(x)
        layer(x)


@pytest.mark.parametrize(
    "make_error",
    [
        pytest.param(lambda: _nested(nn.Linear(4, 4), torch.randn(2, 4)), id="linear"),
        pytest.param(lambda: _nested(nn.Conv1d(4, 4, 1), torch.randn(1, 4, 3)), id="conv"),
        pytest.param(
            lambda: _nested(lambda x, w=nn.Parameter(torch.randn(4, 4)): x @ w, torch.randn(2, 4)), id="matmul"
        ),
    ],
)
@requires_cpu_fp16_autocast
def test_every_form_of_the_cache_dtype_mismatch_is_recognised(make_error):
    assert _is_autocast_cache_dtype_mismatch(_error_of(make_error))


@pytest.mark.parametrize(
    "make_error",
    [
        pytest.param(lambda: nn.Conv1d(4, 4, 1)(torch.randn(1, 4, 3).double()), id="float64-input"),
        pytest.param(
            lambda: nn.functional.linear(torch.randn(2, 4).half(), torch.randn(4, 4)), id="float16-vs-float32"
        ),
        pytest.param(lambda: torch.mm(torch.randn(2, 3), torch.randn(2, 3)), id="shapes"),
    ],
)
def test_other_mismatches_are_not_rewritten(make_error):
    assert not _is_autocast_cache_dtype_mismatch(_error_of(make_error))


@pytest.mark.parametrize(
    "message",
    [
        # torch's device mismatches on a CUDA machine
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
        "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be the same",
        "Input type (torch.cuda.HalfTensor) and weight type (torch.HalfTensor) should be the same",
    ],
)
def test_device_mismatches_are_not_rewritten(message):
    assert not _is_autocast_cache_dtype_mismatch(RuntimeError(message))


@needs_safe_cache
def test_other_errors_pass_through_untouched():
    class ShapeMismatch(_Module):
        def training_step(self, batch, batch_idx):
            return torch.mm(self.layer(batch), torch.randn(3, 3)).sum()

    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        _fit(ShapeMismatch(), MixedPrecision("bf16-mixed", "cpu"))
    assert "cache_enabled" not in str(info.value)


@pytest.mark.skipif(_AUTOCAST_CACHE_IS_SAFE, reason="only refused where torch's cache is unsafe")
def test_cache_refused_where_unsafe():
    with pytest.raises(ValueError, match="torch >= 2.11"):
        MixedPrecision("bf16-mixed", "cpu", cache_enabled=True)
