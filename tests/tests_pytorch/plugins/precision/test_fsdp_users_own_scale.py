"""PyTorch's AMP recipe written by hand with ``FSDPPrecision``'s scaler, in manual optimization:
``self.trainer.precision_plugin.scaler.scale(loss).backward()``, not the plugin's backward: it follows the recipe, and
the user's ``ShardedGradScaler`` is left as it is. On a CPU, through a one-process gloo group, as in
``test_fsdp_amp_recipe.py``, whose model, recipe and set-up these tests share."""

import pytest
import torch
from amp_oracle.torch_features import requires_cpu_16_mixed, requires_cpu_sharded_grad_scaler
from tests_pytorch.plugins.precision.test_fsdp_amp_recipe import (
    RecordScale,
    TwoOptimizersOneBackward,
    _fit,
    _recipe,
    one_process_group,  # noqa: F401 (the autouse fixture)
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning.pytorch.plugins.precision import FSDPPrecision


class HandWrittenBackward(TwoOptimizersOneBackward):
    def backward_of(self, loss: torch.Tensor) -> None:
        self.trainer.precision_plugin.scaler.scale(loss).backward()


@pytest.mark.filterwarnings("ignore:.*CUDA is not available")  # the scaler it creates is CUDA's
def test_the_scaler_fsdp_precision_creates_is_torchs_own():
    assert type(FSDPPrecision("16-mixed").scaler) is ShardedGradScaler


@requires_cpu_16_mixed
@requires_cpu_sharded_grad_scaler
def test_the_recipe_by_hand_with_the_users_sharded_scaler_follows_the_recipe():
    record = RecordScale()
    model = HandWrittenBackward(fused=False)
    _fit(model, record)  # `FSDPPrecision("16-mixed", scaler=ShardedGradScaler(...))`
    expected_params, expected_scales = _recipe(fused=False)
    assert record.scales == expected_scales
    for actual, expected in zip([p.detach() for p in model.parameters()], expected_params):
        assert torch.equal(actual, expected)
