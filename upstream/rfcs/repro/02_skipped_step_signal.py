"""RFC 02: a step-interval LR scheduler advances on steps the gradient scaler skipped; nothing tells it.

Run: ``python 02_skipped_step_signal.py`` (lightning 2.6.6, torch >= 2.3, CPU; a few seconds). The first two of four
losses overflow (``inf``), so ``GradScaler.step`` skips those optimizer steps, yet the scheduler halves the learning
rate four times. (#5558 was closed as "won't fix"; #16229 proposes a heuristic on the scale.)
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import MixedPrecision


class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 2)
        self.weights_after_step = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x).float(), y)
        return loss * float("inf") if batch_idx in (0, 1) else loss

    def on_train_batch_end(self, *args):
        self.weights_after_step.append(self.layer.weight.detach().clone())

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)), batch_size=4)
model = Model()
initial = model.layer.weight.detach().clone()
trainer = Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
trainer.fit(model, data)

changed = [not torch.equal(w, prev) for w, prev in zip(model.weights_after_step, [initial, *model.weights_after_step])]
print("optimizer steps that changed the weights:", changed)
print("scheduler.last_epoch =", trainer.lr_scheduler_configs[0].scheduler.last_epoch,
      "lr =", trainer.optimizers[0].param_groups[0]["lr"], "(after 2 real steps: 0.25)")
print("loss scale:", trainer.precision_plugin.scaler.get_scale(), "(65536 halved once per skipped step)")
