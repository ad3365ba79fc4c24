"""``import pytorch_lightning`` gets the fork's fixes too.

The standalone ``pytorch-lightning`` distribution of the fork is built from the same patches and modules as
``lightning``, renamed (``lightning.pytorch`` -> ``pytorch_lightning``). Two of the fixes, checked through both import
names against a hand-written PyTorch AMP recipe loop, bitwise, and through stock 2.6.6 (``stock_pytorch_lightning``,
the tests' unpatched copy) as the negative control:

* manual optimization under 16-mixed: ``self.clip_gradients`` clips the *unscaled* gradients (stock clips gradients
  still multiplied by the loss scale, so it ends far from the recipe);
* a fused optimizer (``AdamW(fused=True)``) with ``gradient_clip_val`` under 16-mixed: unscaled through the scaler and
  clipped like any other (stock refuses to clip it).

16-mixed on CPU needs an explicit scaler: ``MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))``.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from amp_oracle.torch_features import GradScaler, cpu_grad_scaler

FORK = ("lightning.pytorch", "pytorch_lightning")  # the fork, under both import names
STOCK = "stock_pytorch_lightning"  # the unpatched 2.6.6, renamed (forkbuild: --flavour stock-pytorch-lightning)
#: why the negative controls skip where the stock copy is absent (an environment with only the fork installed)
NO_STOCK = (
    f"the negative control needs the unpatched Lightning 2.6.6 installed as `{STOCK}`, a test-only copy that"
    " `make setup` builds and installs beside the fork"
)
CLIP = 0.05  # small enough that every step clips
STEPS = 4


def _fused_adamw_works() -> bool:
    try:
        p = torch.nn.Parameter(torch.ones(2))
        p.grad = torch.ones(2)
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, TypeError):
        return False
    return True


def _api(package: str):
    pl = importlib.import_module(package) if package != STOCK else pytest.importorskip(STOCK, reason=NO_STOCK)
    return pl, importlib.import_module(f"{package}.plugins.precision").MixedPrecision


def _scaler() -> GradScaler:
    """A scale that grows after every update, so that an extra or missing update changes the result."""
    return cpu_grad_scaler(init_scale=2.0**8, growth_interval=1)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(STEPS)]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


def _optimizer(params, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, fused=True) if fused else torch.optim.SGD(params, lr=0.1)


def recipe(fused: bool) -> dict[str, torch.Tensor]:
    """PyTorch's AMP recipe: autocast around forward and loss, scale, unscale before clipping, step, one update."""
    model = _model()
    opt = _optimizer(model.parameters(), fused)
    scaler = _scaler()
    for x, y in _data():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        scaler.step(opt)
        scaler.update()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def lightning(package: str, manual: bool, fused: bool) -> dict[str, torch.Tensor]:
    pl, MixedPrecision = _api(package)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            if not manual:
                return loss
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            opt.step()
            return None

        def configure_optimizers(self):
            return _optimizer(self.parameters(), fused)

        def train_dataloader(self):
            x, y = (torch.cat(t) for t in zip(*_data()))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=_scaler())],
        **({} if manual else {"gradient_clip_val": CLIP, "gradient_clip_algorithm": "norm"}),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.net.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("package", FORK)
def test_manual_clipping_16_mixed_clips_unscaled_gradients(package: str) -> None:
    assert _equal(lightning(package, manual=True, fused=False), recipe(fused=False))


def test_manual_clipping_16_mixed_stock_clips_scaled_gradients() -> None:
    """Negative control: stock 2.6.6 clips the scaled gradients and ends far from the recipe."""
    stock, expected = lightning(STOCK, manual=True, fused=False), recipe(fused=False)
    assert max((stock[k] - expected[k]).abs().max().item() for k in expected) > 1e-3


@pytest.mark.skipif(not _fused_adamw_works(), reason="this torch has no fused AdamW on CPU")
@pytest.mark.parametrize("package", FORK)
def test_fused_optimizer_clipping_16_mixed(package: str) -> None:
    assert _equal(lightning(package, manual=False, fused=True), recipe(fused=True))


@pytest.mark.skipif(not _fused_adamw_works(), reason="this torch has no fused AdamW on CPU")
def test_fused_optimizer_clipping_16_mixed_stock_refuses() -> None:
    """Negative control: stock 2.6.6 refuses to clip a fused optimizer."""
    with pytest.raises(Exception, match="(?i)clip"):
        lightning(STOCK, manual=False, fused=True)


def test_the_import_names_are_the_fork() -> None:
    """The fork under both names: the same version, and the fork's modules under ``pytorch_lightning`` too."""
    import pytorch_lightning

    import lightning

    assert pytorch_lightning.__version__ == lightning.__version__ != "2.6.6"
    assert importlib.util.find_spec("pytorch_lightning.plugins.precision.amp_recipe") is not None


def test_the_stock_copy_is_unpatched() -> None:
    """The negative controls' stock 2.6.6 (which skip, with the reason, in an environment without it)."""
    stock_pytorch_lightning = pytest.importorskip(STOCK, reason=NO_STOCK)
    import stock_lightning_fabric

    assert stock_pytorch_lightning.__version__ == stock_lightning_fabric.__version__ == "2.6.6"
    assert importlib.util.find_spec("stock_pytorch_lightning.plugins.precision.amp_recipe") is None
