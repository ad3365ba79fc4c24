"""Fabric's precision plugins serve their gradient scaler (patch 0024): a scaler of torch's own class, the one the
plugin creates or one the user passes, tells the plugin about each loss it scales, in place. What that does for the
misuse watch is tested in the Trainer (``tests_pytorch/plugins/precision/test_amp_users_own_scale.py``); the scaler's
``scale()`` is the same object's in both packages."""

import pytest
from tests_fabric.helpers.torch_features import GradScaler, cpu_grad_scaler, requires_cpu_sharded_grad_scaler

from lightning.fabric.plugins.precision import FSDPPrecision, MixedPrecision
from lightning.fabric.plugins.precision.lightning_scaler import _TellsThePlugin


def _assert_served(plugin, scaler) -> None:
    assert plugin.scaler is scaler
    assert isinstance(scaler, _TellsThePlugin)
    assert scaler._plugin is plugin


def test_mixed_precision_serves_the_users_scaler():
    scaler = cpu_grad_scaler(init_scale=2.0**10)
    _assert_served(MixedPrecision("16-mixed", "cpu", scaler=scaler), scaler)
    assert isinstance(scaler, GradScaler)


@pytest.mark.filterwarnings("ignore:.*CUDA is not available")  # the scaler it creates is CUDA's
def test_mixed_precision_serves_the_scaler_it_creates():
    plugin = MixedPrecision("16-mixed", "cuda")
    _assert_served(plugin, plugin.scaler)


@requires_cpu_sharded_grad_scaler
def test_fsdp_precision_serves_the_users_sharded_scaler():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device="cpu", init_scale=2.0**10)
    _assert_served(FSDPPrecision("16-mixed", scaler=scaler), scaler)
    assert isinstance(scaler, ShardedGradScaler)


@pytest.mark.filterwarnings("ignore:.*CUDA is not available")
def test_fsdp_precision_serves_the_scaler_it_creates():
    plugin = FSDPPrecision("16-mixed")
    _assert_served(plugin, plugin.scaler)


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:.*CUDA is not available")
def test_the_deprecated_cuda_scaler_class_is_served_too():
    """``torch.cuda.amp.GradScaler`` (deprecated, still common in older code) is torch's own class as well."""
    import torch

    scaler = torch.cuda.amp.GradScaler()
    _assert_served(MixedPrecision("16-mixed", "cuda", scaler=scaler), scaler)
    assert isinstance(scaler, torch.cuda.amp.GradScaler)


def test_a_scaler_of_the_users_own_subclass_is_not_served():
    class MyScaler(GradScaler):
        pass

    scaler = cpu_grad_scaler(MyScaler, enabled=False)
    MixedPrecision("16-mixed", "cpu", scaler=scaler)
    assert type(scaler) is MyScaler
