"""``FSDPPrecision`` shares ``MixedPrecision``'s AMP recipe (``_AMPRecipePrecision``) and accepts the user's scaler.

FSDP's own sharding needs CUDA in Lightning, and ``FSDPPrecision`` autocasts on ``"cuda"`` only, so on a CPU these tests
drive the plugin's scaler logic through a plain single-device Trainer with a ``ShardedGradScaler`` (which needs a
process group: a one-process gloo group). Autocast is then off (CUDA autocast does nothing to CPU tensors), so the
reference is PyTorch's recipe without autocast: scale, backward, unscale, clip, step every optimizer, one update.
The end-to-end check with the FSDP strategy and fp16 autocast runs only where CUDA is available.
"""

import os
import socket
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from amp_oracle.torch_features import (
    GradScaler,
    optimizer,
    requires_cpu_16_mixed,
    requires_cpu_fused,
    requires_cpu_sharded_grad_scaler,
)
from amp_oracle.trainer import FORK, lightning_api, make_trainer
from amp_oracle.world import CLIP_VALUE, INF_BATCH, INIT_SCALE, N_BATCHES, inject_inf, new_scaler
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.plugins.precision import FSDPPrecision


@pytest.fixture(autouse=True)
def one_process_group():
    # per test: upstream's conftest tears the process group down after every test
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(N_BATCHES)]


def _loader() -> torch.utils.data.DataLoader:
    xs, ys = zip(*_data())
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4)


def _nets() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(8, 16), nn.Linear(16, 4)


def _optimizers(first: nn.Module, second: nn.Module, fused: bool) -> list[torch.optim.Optimizer]:
    return [
        optimizer(torch.optim.AdamW, first.parameters(), lr=1e-2, fused=fused),
        optimizer(torch.optim.SGD, second.parameters(), lr=0.1, momentum=0.9, fused=fused),
    ]


def _loss(first: nn.Module, second: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_idx: int) -> torch.Tensor:
    return inject_inf(nn.functional.mse_loss(second(torch.relu(first(x))), y), batch_idx, INF_BATCH)


def _scaler() -> ShardedGradScaler:
    return ShardedGradScaler(device="cpu", init_scale=INIT_SCALE, growth_interval=1)


def _recipe(fused: bool, scaler: Optional[GradScaler] = None) -> tuple[list[torch.Tensor], list[float]]:
    first, second = _nets()
    optimizers = _optimizers(first, second, fused)
    scaler, scales = scaler or _scaler(), []
    for batch_idx, (x, y) in enumerate(_data()):
        for opt in optimizers:
            opt.zero_grad()
        scaler.scale(_loss(first, second, x, y, batch_idx)).backward()
        for opt, net in zip(optimizers, (first, second)):
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_value_(net.parameters(), CLIP_VALUE)
        for opt in optimizers:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach() for p in (*first.parameters(), *second.parameters())], scales


class TwoOptimizersOneBackward(LightningModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.first, self.second = _nets()
        self.fused = fused

    def training_step(self, batch, batch_idx):
        x, y = batch
        optimizers = self.optimizers()
        for opt in optimizers:
            opt.zero_grad()
        self.backward_of(_loss(self.first, self.second, x, y, batch_idx))
        for opt in optimizers:
            self.clip_gradients(opt, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")
        for opt in optimizers:
            opt.step()

    def backward_of(self, loss: torch.Tensor) -> None:
        self.manual_backward(loss)

    def configure_optimizers(self):
        return _optimizers(self.first, self.second, self.fused)

    def train_dataloader(self):
        return _loader()


class RecordScale(Callback):
    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, *_) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())


def _fit(model: LightningModule, *callbacks: Callback, logger: Any = False) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        plugin = FSDPPrecision("16-mixed", scaler=_scaler())
        make_trainer(lightning_api(FORK), "16-mixed", plugin=plugin, callbacks=callbacks, logger=logger).fit(model)


def _assert_follows_the_recipe(fused: bool, scaler: Optional[GradScaler] = None) -> None:
    record = RecordScale()
    model = TwoOptimizersOneBackward(fused=fused)
    _fit(model, record)
    expected_params, expected_scales = _recipe(fused=fused, scaler=scaler)
    # one update per batch although two optimizers step: the inf batch halves the scale once
    assert record.scales == expected_scales
    assert expected_scales[INF_BATCH] == expected_scales[INF_BATCH - 1] / 2
    for actual, expected in zip([p.detach() for p in model.parameters()], expected_params):
        assert torch.equal(actual, expected)


@requires_cpu_16_mixed
@requires_cpu_sharded_grad_scaler
def test_fsdp_precision_follows_the_recipe():
    _assert_follows_the_recipe(fused=False)


def _plain_scaler() -> GradScaler:
    # on one process the sharded scaler's all-reduce of the inf checks is the identity: the same arithmetic
    return new_scaler()


@requires_cpu_16_mixed
@requires_cpu_sharded_grad_scaler
@requires_cpu_fused("AdamW", "SGD")
def test_fused_optimizer_with_sharded_scaler_follows_the_recipe():
    """torch's fused kernels cannot read ``ShardedGradScaler``'s 1-element inf checks (the plain recipe fails inside
    the step); the plugin reads them as 0-dim and trains exactly like the recipe with fused optimizers."""
    with pytest.raises(RuntimeError, match="shape"):
        _recipe(fused=True)
    _assert_follows_the_recipe(fused=True, scaler=_plain_scaler())


@requires_cpu_sharded_grad_scaler
def test_loss_scale_monitor_with_fsdp_precision():
    """``LossScaleMonitor`` reads ``FSDPPrecision``'s scaler (stock's monitor knew only ``MixedPrecision``): it logs the
    scale each batch ends with, and the one skipped step of the inf batch."""
    from tests_pytorch.callbacks.test_loss_scale_monitor import CaptureLogger

    from lightning.pytorch.callbacks import LossScaleMonitor

    record, logger = RecordScale(), CaptureLogger()
    _fit(TwoOptimizersOneBackward(fused=False), record, LossScaleMonitor(log_every_n_steps=1), logger=logger)
    logged = [m for _, m in logger.calls if "loss_scale" in m]
    assert [m["loss_scale"] for m in logged] == record.scales
    assert logged[-1]["skipped_steps"] == 2.0  # both optimizers' steps of the inf batch


@requires_cpu_sharded_grad_scaler
def test_fsdp_precision_keeps_the_users_scaler():
    scaler = _scaler()
    assert FSDPPrecision("16-mixed", scaler=scaler).scaler is scaler
    assert isinstance(FSDPPrecision("16-mixed").scaler, ShardedGradScaler)
    with pytest.raises(ValueError, match="does not use a scaler"):
        FSDPPrecision("bf16-mixed", scaler=scaler)


@requires_cpu_sharded_grad_scaler
def test_stock_fsdp_precision_refuses_any_scaler():
    """Negative control: upstream 2.6.6 raises for every user-provided scaler (#19803)."""
    stock = pytest.importorskip("stock_pytorch_lightning.plugins.precision")
    import stock_pytorch_lightning

    if stock_pytorch_lightning.__version__ != "2.6.6":
        pytest.skip("the negative control is about stock 2.6.6")
    with pytest.raises(ValueError, match="does not use a scaler"):
        stock.FSDPPrecision("16-mixed", scaler=_scaler())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDP with fp16 autocast needs CUDA")
def test_fsdp_strategy_manual_clip_on_cuda():
    """With the FSDP strategy and fp16 autocast on one GPU, manual value clipping sees unscaled gradients."""
    seen = []

    class Clip(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = nn.Linear(8, 4)

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.layer(batch[0]).float().pow(2).mean())
            self.clip_gradients(opt, gradient_clip_val=1e9, gradient_clip_algorithm="value")
            seen.append(max(p.grad.abs().max().item() for p in self.parameters()))
            opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return _loader()

    api = lightning_api(FORK)
    make_trainer(api, "16-mixed", scaler="lightning", device="cuda", strategy="fsdp", max_steps=2).fit(Clip())
    assert all(g < 100 for g in seen)  # scaled gradients would be ~65536 times larger


@requires_cpu_16_mixed
@requires_cpu_sharded_grad_scaler
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_fabric_fsdp_precision_follows_the_recipe(fused):
    """Fabric's ``FSDPPrecision`` shares Fabric's ``MixedPrecision`` recipe: one update per iteration for two optimizers
    fed by one backward, value clipping on unscaled gradients, the inf step skipped."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import FSDPPrecision as FabricFSDPPrecision

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricFSDPPrecision("16-mixed", scaler=_scaler())])
        first, second = _nets()
        optimizers = _optimizers(first, second, fused=fused)
        (first, opt_first), (second, opt_second) = (
            fabric.setup(first, optimizers[0]),
            fabric.setup(second, optimizers[1]),
        )
        scales = []
        for batch_idx, (x, y) in enumerate(_data()):
            opt_first.zero_grad()
            opt_second.zero_grad()
            fabric.backward(_loss(first, second, x, y, batch_idx))
            for net, opt in ((first, opt_first), (second, opt_second)):
                fabric.clip_gradients(net, opt, clip_val=CLIP_VALUE)
            opt_first.step()
            opt_second.step()
            assert opt_first.step_was_skipped == opt_second.step_was_skipped == (batch_idx == INF_BATCH)
            scales.append(fabric.strategy.precision.state_dict()["scale"])  # applies the iteration's update
    expected_params, expected_scales = _recipe(fused=fused, scaler=_plain_scaler() if fused else None)
    assert scales == expected_scales
    params = [p.detach() for p in (*first.parameters(), *second.parameters())]
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params))
