"""``Fabric(accelerator="cpu", precision="16-mixed")`` trains in float16 with ``torch.amp.GradScaler("cpu")``.

Stock Fabric turns the flag into bf16-mixed on a CPU; the fork (patch cpu-16-mixed-is-float16, fork-only) gives it what
``plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]`` gives, and keeps the fallback,
with a warning naming what is missing, on torch < 2.3. The reference is the hand-written recipe of
``amp_oracle/fabric.py`` with the flag's scaler (torch's defaults), compared bitwise.
"""

import logging
import warnings

import pytest
import torch
from amp_oracle.fabric import Cell, FabricLoop, recipe_run
from amp_oracle.run import assert_same_run
from amp_oracle.torch_features import requires_cpu_16_mixed
from amp_oracle.world import N_BATCHES

from lightning.fabric import Fabric
from lightning.fabric import connector as fabric_connector
from lightning.fabric.plugins.precision import MixedPrecision

SLOW_CPU_INFO = "float16 matrix multiplications are slow on most CPUs: `precision='bf16-mixed'` is usually faster"


def cpu_16_mixed_fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1, precision="16-mixed")


@requires_cpu_16_mixed
def test_the_flag_gets_a_cpu_gradient_scaler(caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.simplefilter("error")  # stock warns here and trains bf16
        plugin = cpu_16_mixed_fabric().strategy.precision
    assert type(plugin) is MixedPrecision
    assert (plugin.precision, plugin.device) == ("16-mixed", "cpu")
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    assert plugin.scaler.is_enabled()
    assert plugin.scaler._device == "cpu"
    assert caplog.text.count(SLOW_CPU_INFO) == 1


@requires_cpu_16_mixed
def test_the_flag_trains_as_the_recipe():
    cell = Cell("16-mixed", clip="norm")
    init_scale = torch.amp.GradScaler("cpu").get_scale()
    expected = recipe_run(cell, scaler=torch.amp.GradScaler("cpu"))  # the recipe gets the flag's scaler
    assert any(any(row) for row in expected.changed)
    assert 0.5 in {b / a for a, b in zip([init_scale] + expected.scales, expected.scales)}

    loop = FabricLoop(cell, fabric=cpu_16_mixed_fabric())
    assert loop.scaler.get_scale() == init_scale
    actual = loop.train(range(N_BATCHES)).finish()
    assert_same_run(actual, expected, records=True)


def test_falls_back_to_bf16_where_torch_cannot(monkeypatch):
    """torch < 2.3 has neither a CPU gradient scaler nor float16 autocast on a CPU (here faked on any torch)."""
    monkeypatch.setattr(fabric_connector, "_TORCH_GREATER_EQUAL_2_3", False)
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead") as record:
        plugin = cpu_16_mixed_fabric().strategy.precision
    (message,) = [str(w.message) for w in record if "16-mixed" in str(w.message)]
    assert message.startswith(
        f"You passed `Fabric(accelerator='cpu', precision='16-mixed')`, but torch {torch.__version__} cannot run"
        " float16 AMP on a CPU: it has no CPU gradient scaler (`torch.amp.GradScaler('cpu')`)"
    )
    assert (plugin.precision, plugin.scaler) == ("bf16-mixed", None)
