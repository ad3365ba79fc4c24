"""The differential corpus: every scenario through PyTorch's recipe, the fork and stock 2.6.6.

The scenarios are in ``amp_oracle/scenarios.py``: the usage patterns (mid-iteration
checkpoints and resuming from them, a step in ``on_train_epoch_end``, a guard that skips non-finite steps,
``zero_grad(set_to_none=False)``, an optimizer clipped every batch but stepped every second, gradient surgery and
gradient penalties on ``autograd.grad`` of the scaled loss, ``loss.backward()`` misuse, the raw optimizer's step, a
disabled scaler, in-place weight edits between two forwards, an optimizer without gradients, the autocast-cache dtype
and device errors, ``LossScaleMonitor`` under accumulation) and the manual-optimization patterns real projects use (GAN,
accumulation with clipping, closures, several optimizers per backward, an inner loop, automatic accumulation with
clipping, fused AdamW with clipping), under 16-mixed (a CPU ``GradScaler``), bf16-mixed and 32-true.

Per cell ``scenario:precision``:

* ``test_fork``: the fork does what the scenario expects: the recipe's run bitwise, or a clear error that left the
  weights and optimizer states untouched;
* ``test_stock``: stock 2.6.6 does what is recorded for it (the negative control where it is wrong: it differs from the
  recipe, or raises, or trains without the error the fork must raise);
* ``test_fork_equals_stock``: where stock follows the recipe, the fork equals stock bitwise, so a regression of the
  fork against stock fails here by construction;
* ``test_recipe_is_sharp``: the reference itself trained, stayed finite and, under 16-mixed, backed the scale off.
"""

import math

import pytest
import torch
from amp_oracle.run import assert_same_run
from amp_oracle.scenarios import CELLS, EQUAL, MISSING, SCENARIOS, assert_outcome, lightning_outcome, recipe_outcome
from amp_oracle.trainer import FORK, STOCK, quiet_trainer, stock_is_unpatched
from amp_oracle.world import uses_scaler


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


def _split(cell: str):
    name, precision = cell.split(":")
    return SCENARIOS[name], precision


needs_stock = pytest.mark.skipif(not stock_is_unpatched(), reason=f"needs the unpatched `{STOCK}` 2.6.6")


@pytest.mark.parametrize("cell", CELLS)
def test_fork(cell):
    scenario, precision = _split(cell)
    assert_outcome(
        lightning_outcome(FORK, scenario.name, precision), scenario.expected(precision), scenario.name, precision
    )


def _on_stock(cell: str):
    scenario, precision = _split(cell)
    return scenario.expected(precision, stock=True)


STOCK_CELLS = [cell for cell in CELLS if _on_stock(cell) != MISSING]


@needs_stock
@pytest.mark.parametrize("cell", STOCK_CELLS)
def test_stock(cell):
    scenario, precision = _split(cell)
    assert_outcome(lightning_outcome(STOCK, scenario.name, precision), _on_stock(cell), scenario.name, precision)


@needs_stock
@pytest.mark.parametrize("cell", [cell for cell in STOCK_CELLS if _on_stock(cell) == EQUAL])
def test_fork_equals_stock(cell):
    scenario, precision = _split(cell)
    stock = lightning_outcome(STOCK, scenario.name, precision)
    assert stock.error is None, f"stock raised {stock.error!r}"
    assert_same_run(stock.run, recipe_outcome(scenario.name, precision), records=scenario.records)
    fork = lightning_outcome(FORK, scenario.name, precision)
    assert fork.error is None, f"stock follows the recipe, the fork raised {type(fork.error).__name__}: {fork.error}"
    assert_same_run(fork.run, stock.run, records=scenario.records)


@pytest.mark.parametrize("cell", [cell for cell in CELLS if _split(cell)[0].recipe is not None])
def test_recipe_is_sharp(cell):
    scenario, precision = _split(cell)
    result = recipe_outcome(scenario.name, precision)
    initial = scenario.net().state_dict()
    assert any(not torch.equal(initial[n], p) for n, p in result.params.items()), "the recipe never trained"
    for name, p in result.params.items():
        assert torch.isfinite(p).all(), f"{name} is not finite"
    if uses_scaler(precision):
        start = scenario.init_scale if scenario.resume is None else None
        trajectory = ([start] if start else []) + result.scales
        ratios = {b / a for a, b in zip(trajectory, trajectory[1:])}
        # an inf shows as a back-off, or as a batch that grew less than the others (two updates in one batch)
        backed_off = min(ratios) < 1 or min(ratios) < max(ratios)
        assert backed_off or scenario.resume is not None, f"the scale never backed off: {result.scales}"
        assert all(math.log2(s).is_integer() for s in result.scales)
    if scenario.sharp is not None:
        assert scenario.sharp(result), f"the recipe did not exercise the scenario: records {result.records}"
