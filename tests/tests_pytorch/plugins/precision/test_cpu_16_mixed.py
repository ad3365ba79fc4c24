"""``Trainer(accelerator="cpu", precision="16-mixed")`` trains in float16 with ``torch.amp.GradScaler("cpu")``.

Stock Lightning turns the flag into bf16-mixed on a CPU ("AMP with fp16 is not supported on CPU"), which torch 2.3
made untrue. The fork (patch cpu-16-mixed-is-float16, fork-only) gives the flag what
``plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]`` gives, with one info line that
float16 is slow on most CPUs, and keeps the fallback, with a warning naming what is missing, on torch < 2.3.

The reference is the hand-written PyTorch AMP recipe of ``amp_oracle`` (``tests/amp_oracle``) with the flag's
scaler (torch's defaults: ``init_scale=2**16``, ``growth_interval=2000``): parameters, scale trajectory and skipped
steps must be equal bitwise.
"""

import copy
import functools
import logging
import warnings

import pytest
import torch
from amp_oracle.loops import auto_plain, manual_plain, recipe_plain
from amp_oracle.run import RecipeRun, Run, assert_same_run
from amp_oracle.torch_features import requires_cpu_16_mixed
from amp_oracle.trainer import FORK, lightning_api, make_trainer, quiet_trainer
from amp_oracle.world import AUTOCAST_CACHE, TRAINER_BATCHES, Batches, mlp, one_optimizer

from lightning.fabric import connector as fabric_connector

SLOW_CPU_INFO = "float16 matrix multiplications are slow on most CPUs: `precision='bf16-mixed'` is usually faster"


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


def cpu_16_mixed_trainer(**kwargs):
    """The flag alone: Lightning creates the scaler."""
    return make_trainer(lightning_api(FORK), "16-mixed", scaler="lightning", **kwargs)


@requires_cpu_16_mixed
def test_the_flag_gets_a_cpu_gradient_scaler(caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.INFO):
        warnings.simplefilter("error")  # stock warns here and trains bf16
        plugin = cpu_16_mixed_trainer().precision_plugin
    assert type(plugin) is lightning_api(FORK).MixedPrecision
    assert (plugin.precision, plugin.device) == ("16-mixed", "cpu")
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    assert plugin.scaler.is_enabled()
    assert plugin.scaler._device == "cpu"
    assert plugin.autocast_context_manager().fast_dtype is torch.float16
    assert caplog.text.count(SLOW_CPU_INFO) == 1


@requires_cpu_16_mixed
@pytest.mark.parametrize("mode", ["manual", "automatic"])
def test_the_flag_trains_as_the_recipe(mode):
    automatic = mode == "automatic"
    configure = functools.partial(one_optimizer, name="AdamW")
    net = mlp()

    rc = RecipeRun(copy.deepcopy(net), "16-mixed", autocast_cache=AUTOCAST_CACHE and automatic)
    rc.scaler = torch.amp.GradScaler("cpu")  # the flag's scaler: torch's defaults
    rc.get_scale = rc.scaler.get_scale
    recipe_plain(rc, configure(rc.net))
    expected = rc.result()
    assert any(expected.changed)
    assert 0.5 in {b / a for a, b in zip(expected.scales, expected.scales[1:])}

    api = lightning_api(FORK)
    module = api.RecipeModule(
        copy.deepcopy(net), configure, auto_plain if automatic else manual_plain, automatic, "16-mixed"
    )
    recorder = api.Recorder()
    cpu_16_mixed_trainer(callbacks=[recorder]).fit(module, train_dataloaders=Batches())
    assert len(recorder.changed) == TRAINER_BATCHES
    actual = Run(
        params={name: p.detach().clone() for name, p in module.net.named_parameters()},
        scales=recorder.scales,
        changed=recorder.changed,
    )
    assert_same_run(actual, expected)


def test_falls_back_to_bf16_where_torch_cannot(monkeypatch):
    """torch < 2.3 has neither a CPU gradient scaler nor float16 autocast on a CPU (here faked on any torch)."""
    monkeypatch.setattr(fabric_connector, "_TORCH_GREATER_EQUAL_2_3", False)
    with pytest.warns(UserWarning, match="16-mixed") as record:
        plugin = cpu_16_mixed_trainer().precision_plugin
    (message,) = [str(w.message) for w in record if "16-mixed" in str(w.message)]
    assert message == (
        f"You passed `Trainer(accelerator='cpu', precision='16-mixed')`, but torch {torch.__version__} cannot run"
        " float16 AMP on a CPU: it has no CPU gradient scaler (`torch.amp.GradScaler('cpu')`) and no float16 autocast"
        " there, both new in torch 2.3. Using `precision='bf16-mixed'` instead; for float16 on a CPU, upgrade torch to"
        " 2.3 or newer."
    )
    assert (plugin.precision, plugin.scaler) == ("bf16-mixed", None)
