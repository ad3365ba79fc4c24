"""Precision plugins that drive a gradient scaler stay picklable, as launchers such as ``ddp_spawn`` need."""

import pickle

import pytest
import torch
from amp_oracle.torch_features import cpu_grad_scaler

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.pytorch.plugins.precision import MixedPrecision as TrainerMixedPrecision


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_fabric_mixed_precision_pickles_after_setup(precision):
    scaler = cpu_grad_scaler() if precision == "16-mixed" else None
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision(precision, "cpu", scaler=scaler)])
    module = torch.nn.Linear(2, 2)
    _, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    plugin = fabric.strategy.precision
    fit = [] if scaler is None else plugin._recipe._fit
    assert len(fit) == (scaler is not None)  # the optimizer of this fit is tracked (weakly), where a scaler drives it
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.precision == precision
    # the fit stays in the process that made it
    assert copy._scaler_recipe is None or (copy._scaler_recipe._fit, len(copy._scaler_recipe._records)) == ([], 0)
    assert (copy.scaler is None) == (scaler is None)


def test_trainer_mixed_precision_pickles():
    plugin = TrainerMixedPrecision("16-mixed", "cpu", scaler=cpu_grad_scaler())
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.scaler.get_scale() == plugin.scaler.get_scale()
