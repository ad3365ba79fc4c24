"""The gradient scaler's per-iteration bookkeeping under ``MixedPrecision``: one update per training batch, after its
last optimizer step, and never lost when the scaler's state is saved."""

import pytest
import torch
from tests_fabric.helpers.torch_features import cpu_grad_scaler
from torch import nn

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision


class TwoStepsPerBatch(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for _ in range(2):
            self.manual_backward(self.layer(batch).float().pow(2).mean())
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(6, 4), batch_size=2)


class RecordScale(Callback):
    def __init__(self) -> None:
        self.scales = []
        self.pending = []

    def on_train_batch_end(self, trainer, *_):
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        self.pending.append(trainer.precision_plugin._recipe.update_owed)


def _plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=cpu_grad_scaler(init_scale=2.0**4, growth_interval=1))


def _fit_quietly(model: LightningModule, **trainer_kwargs) -> Trainer:
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=[_plugin()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return trainer


def test_one_update_per_batch_before_on_train_batch_end(tmp_path):
    record = RecordScale()
    trainer = _fit_quietly(TwoStepsPerBatch(), callbacks=[record])
    # growth_interval=1 and finite gradients: each batch grows the scale exactly once, although it steps twice
    assert record.scales == [2.0**5, 2.0**6, 2.0**7]
    assert record.pending == [False, False, False]
    checkpoint = tmp_path / "last.ckpt"
    trainer.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["MixedPrecision"]
    assert saved["scale"] == 2.0**7


def test_state_dict_applies_a_pending_update():
    plugin = _plugin()
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    plugin._recipe.scale(param.sum()).backward()
    plugin._recipe.step(optimizer)
    assert plugin._recipe.update_owed
    assert plugin.state_dict()["scale"] == 2.0**5  # the iteration's update happened before saving
    assert not plugin._recipe.update_owed
    plugin.training_iteration_end()  # nothing left to apply: no second update
    assert plugin.scaler.get_scale() == 2.0**5


def test_user_update_is_not_applied_twice():
    """A user following PyTorch's recipe to the letter calls ``scaler.update()`` themselves."""

    class UpdatesItself(TwoStepsPerBatch):
        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            self.manual_backward(self.layer(batch).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
            self.trainer.precision_plugin.scaler.update()

    record = RecordScale()
    _fit_quietly(UpdatesItself(), callbacks=[record])
    assert record.scales == [2.0**5, 2.0**6, 2.0**7]


class ClipsEveryBatchStepsEveryOther(LightningModule):
    """Gradient accumulation over two batches, but clipping on every batch: the first clip unscales gradients that no
    step consumes, and the next backward would add scaled gradients to them."""

    def __init__(self, zero_before_next_backward: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(4, 4)
        self.zero_before_next_backward = zero_before_next_backward

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        self.manual_backward(self.layer(batch).float().pow(2).mean())
        self.clip_gradients(opt, gradient_clip_val=1e9, gradient_clip_algorithm="value")
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
        elif self.zero_before_next_backward:
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


def test_unscaled_gradients_without_a_step_are_refused_before_the_next_backward():
    model = ClipsEveryBatchStepsEveryOther(zero_before_next_backward=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"unscaled .* did not step before this backward"):
        _fit_quietly(model)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_unscaled_gradients_cleared_before_the_next_backward_are_fine():
    model = ClipsEveryBatchStepsEveryOther(zero_before_next_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    _fit_quietly(model)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


class SkipsSomeBatches(LightningModule):
    """Automatic optimization with clipping; ``training_step`` returns None on odd batches (no backward, no step)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else self.layer(batch).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=2)


def test_clipping_on_a_batch_without_backward_leaves_no_state():
    """Clipping runs on a batch whose ``training_step`` returned None; the scaler must not carry that empty unscale into
    the next batch (it used to fail there with "No inf checks were recorded for this optimizer")."""
    torch.manual_seed(0)
    model = SkipsSomeBatches()
    reference = SkipsSomeBatches()
    reference.load_state_dict(model.state_dict())
    trainer = _fit_quietly(model, gradient_clip_val=1e9, gradient_clip_algorithm="norm")
    # the recipe: only the even batches train, one update each
    scaler = cpu_grad_scaler(init_scale=2.0**4, growth_interval=1)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    for batch_idx, batch in enumerate(reference.train_dataloader()):
        if batch_idx % 2:
            continue
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference.layer(batch).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
    assert trainer.precision_plugin.scaler.get_scale() == scaler.get_scale()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
