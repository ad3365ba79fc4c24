"""The demo's bf16 row (``examples/amp_demo.py``): an optimizer whose step multiplies matrices (the demo's Muon-style
optimizer), stepped in manual optimization under bf16-mixed. The fork runs ``opt.step()`` with autocast off and
equals PyTorch's AMP recipe bit for bit; stock 2.6.6 runs it under autocast, its matmuls in bf16, and leaves the
recipe. A short run of the demo's own functions (40 steps, a few seconds), so that what ``make demo`` shows holds;
the demo's runs are the oracle's ``Run`` s, compared as every test compares them."""

from __future__ import annotations

import importlib.util
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch
from amp_oracle.run import assert_same_run, differences
from amp_oracle.torch_features import requires_cpu_grad_scaler

# the demo builds a CPU gradient scaler for every run (disabled but for 16-mixed): torch >= 2.3
pytestmark = requires_cpu_grad_scaler

DEMO = Path(__file__).resolve().parents[2] / "examples" / "amp_demo.py"
STEPS = 40
QUIETED = ("lightning.pytorch", "lightning.fabric", "stock_pytorch_lightning", "stock_lightning_fabric")


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("amp_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules["amp_demo"] = module  # dataclasses look their module up by name
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the demo does: matrices this small run fastest on one thread
    # the demo quiets Lightning's loggers and warnings for its own process: restore both for the tests that follow
    levels = {name: logging.getLogger(name).level for name in QUIETED}
    try:
        with warnings.catch_warnings():
            spec.loader.exec_module(module)
            module.quiet_lightning()
            yield module
    finally:
        sys.modules.pop("amp_demo", None)
        torch.set_num_threads(threads)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def _run(demo, package: str, optimizer: str, precision: str):
    dataset = demo.make_dataset()
    recipe = demo.train_with_recipe(optimizer, precision, dataset, STEPS, lambda model: None)
    run = demo.train_with_lightning(package, optimizer, precision, "manual", dataset, STEPS, lambda model: None)
    return run, recipe


@pytest.mark.parametrize("optimizer", ["Muon", "SGD"])
def test_fork_manual_bf16_equals_the_recipe(demo, optimizer: str) -> None:
    run, recipe = _run(demo, "lightning", optimizer, "bf16-mixed")
    assert_same_run(run, recipe)


def test_stock_manual_bf16_leaves_the_recipe_only_where_the_step_multiplies_matrices(demo) -> None:
    if importlib.util.find_spec("stock_pytorch_lightning") is None:
        pytest.skip("stock_pytorch_lightning is not installed (`make setup` builds it)")
    muon, muon_recipe = _run(demo, "stock_pytorch_lightning", "Muon", "bf16-mixed")
    assert differences(muon, muon_recipe)
    assert demo.max_abs_diff(muon, muon_recipe) > 1e-3  # bf16 matmuls in the step: far above float32 rounding
    sgd, sgd_recipe = _run(demo, "stock_pytorch_lightning", "SGD", "bf16-mixed")
    assert_same_run(sgd, sgd_recipe)  # the user's kind of code: fine on stock too
