"""``Fabric(accelerator="cpu", precision="16-mixed")`` trains in float16 with ``torch.amp.GradScaler("cpu")``.

Stock Fabric turns the flag into bf16-mixed on a CPU; the fork (patch cpu-16-mixed-is-float16, fork-only) gives it what
``plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]`` gives, and keeps the fallback,
with a warning naming what is missing, on torch < 2.3. The reference is the hand-written recipe of
``tests_fabric/helpers/amp_fabric.py`` with the flag's scaler (torch's defaults), compared bitwise.
"""

import logging
import warnings

import pytest
import torch
from amp_oracle.torch_features import GradScaler, requires_cpu_16_mixed
from amp_oracle.world import N_BATCHES
from tests_fabric.helpers import amp_fabric
from tests_fabric.helpers.amp_fabric import Cell, FabricLoop, assert_same_run, recipe_run

from lightning.fabric import Fabric
from lightning.fabric import connector as fabric_connector
from lightning.fabric.plugins.precision import MixedPrecision

SLOW_CPU_INFO = "float16 matrix multiplications are slow on most CPUs: `precision='bf16-mixed'` is usually faster"


def cpu_16_mixed_fabric(*_, **__) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, precision="16-mixed")


def default_cpu_scaler(enabled: bool = True, **_) -> GradScaler:
    return torch.amp.GradScaler("cpu", enabled=enabled)


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
def test_the_flag_trains_as_the_recipe(monkeypatch):
    cell = Cell("16-mixed", clip="norm")
    monkeypatch.setattr(amp_fabric, "new_scaler", default_cpu_scaler)  # the recipe gets the flag's scaler
    expected = recipe_run(cell)
    assert any(any(row) for row in expected.changed)
    assert 0.5 in {b / a for a, b in zip(expected.scales, expected.scales[1:] + [expected.final_scale])}

    monkeypatch.setattr(amp_fabric, "make_fabric", cpu_16_mixed_fabric)
    loop = FabricLoop(cell)
    loop.scaler = loop.precision_plugin.scaler  # what the loop reads the scale from
    assert loop.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
    actual = loop.train(range(N_BATCHES)).finish()
    assert_same_run(actual, expected)


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
