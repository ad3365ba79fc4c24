"""``import lightning_fabric`` gets the fork's fixes too.

The standalone ``pytorch-lightning`` distribution of the fork ships ``lightning_fabric`` built from the same patches and
modules as ``lightning.fabric``, renamed. Checked through both import names against a hand-written PyTorch AMP recipe
loop, bitwise, with stock 2.6.6 (``stock_lightning_fabric``, the tests' unpatched copy) as the negative control:

* clipping under 16-mixed (``fabric.clip_gradients`` on unscaled gradients, one scaler update per iteration);
* a fused optimizer (``AdamW(fused=True)``) clipped under 16-mixed: unscaled through the scaler like any other
  (stock refuses to clip it);
* two optimizers fed by one backward: one scaler update per iteration, after both steps (stock updates after each
  step, so the second optimizer is unscaled with a scale that did not scale its gradients).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from amp_oracle.torch_features import GradScaler, cpu_grad_scaler

FORK = ("lightning.fabric", "lightning_fabric")  # the fork, under both import names
STOCK = "stock_lightning_fabric"  # the unpatched 2.6.6, renamed (forkbuild: --flavour stock-pytorch-lightning)
#: why the negative controls skip where the stock copy is absent (an environment with only the fork installed)
NO_STOCK = (
    f"the negative control needs the unpatched Fabric 2.6.6 installed as `{STOCK}`, a test-only copy that"
    " `make setup` builds and installs beside the fork"
)
CLIP = 0.05
STEPS = 4


def _fused_adamw_works() -> bool:
    try:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, TypeError):
        return False
    return True


def _scaler() -> GradScaler:
    """A scale that grows after every update, so that an extra or missing update changes the result."""
    return cpu_grad_scaler(init_scale=2.0**8, growth_interval=1)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS)]


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.nn.Linear(8, 8)


def _optimizers(first, second, fused: bool, two: bool) -> list[torch.optim.Optimizer]:
    make = (lambda p: torch.optim.AdamW(p, lr=0.01, fused=True)) if fused else (lambda p: torch.optim.SGD(p, lr=0.1))
    if two:
        return [make(first.parameters()), make(second.parameters())]
    return [make([*first.parameters(), *second.parameters()])]


def _state(first, second) -> dict[str, torch.Tensor]:
    out = {f"first.{k}": v.detach().clone() for k, v in first.state_dict().items()}
    out.update({f"second.{k}": v.detach().clone() for k, v in second.state_dict().items()})
    return out


def recipe(fused: bool, two: bool) -> dict[str, torch.Tensor]:
    """PyTorch's AMP recipe: autocast around forward and loss, scale, unscale before clipping, step every optimizer,
    one update per iteration."""
    first, second = _models()
    opts = _optimizers(first, second, fused, two)
    scaler = _scaler()
    for x, y in _data():
        for opt in opts:
            opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(second(first(x)), y)
        scaler.scale(loss).backward()
        for opt in opts:
            scaler.unscale_(opt)
            params = [p for group in opt.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            scaler.step(opt)
        scaler.update()
    return _state(first, second)


def fabric(package: str, fused: bool, two: bool) -> dict[str, torch.Tensor]:
    module = importlib.import_module(package) if package != STOCK else pytest.importorskip(STOCK, reason=NO_STOCK)
    Fabric = module.Fabric
    MixedPrecision = importlib.import_module(f"{package}.plugins.precision").MixedPrecision
    fab = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=_scaler())])
    first, second = _models()
    opts = _optimizers(first, second, fused, two)
    model = torch.nn.Sequential(first, second)
    model, *opts = fab.setup(model, *opts)
    for x, y in _data():
        for opt in opts:
            opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        fab.backward(loss)
        for opt in opts:
            fab.clip_gradients(model, opt, max_norm=CLIP, error_if_nonfinite=False)
            opt.step()
    return _state(first, second)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("package", FORK)
def test_clipping_16_mixed(package: str) -> None:
    assert _equal(fabric(package, fused=False, two=False), recipe(fused=False, two=False))


@pytest.mark.parametrize("package", FORK)
def test_two_optimizers_one_update_per_iteration(package: str) -> None:
    assert _equal(fabric(package, fused=False, two=True), recipe(fused=False, two=True))


def test_two_optimizers_stock_updates_after_every_step() -> None:
    """Negative control: stock Fabric 2.6.6 updates the scaler after each step and leaves the recipe."""
    assert not _equal(fabric(STOCK, fused=False, two=True), recipe(fused=False, two=True))


@pytest.mark.skipif(not _fused_adamw_works(), reason="this torch has no fused AdamW on CPU")
@pytest.mark.parametrize("package", FORK)
def test_fused_optimizer_clipping_16_mixed(package: str) -> None:
    assert _equal(fabric(package, fused=True, two=False), recipe(fused=True, two=False))


@pytest.mark.skipif(not _fused_adamw_works(), reason="this torch has no fused AdamW on CPU")
def test_fused_optimizer_clipping_16_mixed_stock_refuses() -> None:
    """Negative control: stock Fabric 2.6.6 refuses to clip a fused optimizer."""
    with pytest.raises(Exception, match="(?i)clip"):
        fabric(STOCK, fused=True, two=False)


def test_the_import_names_are_the_fork() -> None:
    import lightning_fabric

    import lightning

    assert lightning_fabric.__version__ == lightning.__version__ != "2.6.6"
    assert importlib.util.find_spec("lightning_fabric.plugins.precision.amp_recipe") is not None


def test_the_stock_copy_is_unpatched() -> None:
    stock_lightning_fabric = pytest.importorskip(STOCK, reason=NO_STOCK)

    assert stock_lightning_fabric.__version__ == "2.6.6"
    assert importlib.util.find_spec("stock_lightning_fabric.plugins.precision.amp_recipe") is None
