"""The gradient scaler's per-iteration bookkeeping under ``MixedPrecision``: one update per training batch, after its
last optimizer step, and never lost when the scaler's state is saved."""

import torch
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
        self.pending.append(trainer.precision_plugin._recipe.update_pending)


def _plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1))


def test_one_update_per_batch_before_on_train_batch_end(tmp_path):
    record = RecordScale()
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=[_plugin()],
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TwoStepsPerBatch())
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
    assert plugin._recipe.update_pending
    assert plugin.state_dict()["scale"] == 2.0**5  # the iteration's update happened before saving
    assert not plugin._recipe.update_pending
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
    trainer = Trainer(
        accelerator="cpu",
        max_epochs=1,
        plugins=[_plugin()],
        callbacks=[record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(UpdatesItself())
    assert record.scales == [2.0**5, 2.0**6, 2.0**7]
