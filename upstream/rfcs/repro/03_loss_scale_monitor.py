"""RFC 03: under 16-mixed the loss scale moves (and steps are skipped) without anything logging it.

Run: ``python 03_loss_scale_monitor.py`` (lightning 2.6.6, torch >= 2.3, CPU; a few seconds). Two of four losses are
made to overflow: the scale falls from 65536 to 16384 and half of the steps are skipped, yet the logged metrics only
hold what the model logs itself; a user has to know about ``trainer.precision_plugin.scaler`` to see it.
"""

import tempfile

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision


class Model(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x).float(), y)
        self.log("train_loss", loss)
        return loss * float("inf") if batch_idx in (1, 2) else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)), batch_size=4)
scaler = torch.amp.GradScaler("cpu")
scales = []
update = scaler.update
scaler.update = lambda *args, **kwargs: (update(*args, **kwargs), scales.append(scaler.get_scale()))
trainer = Trainer(accelerator="cpu", max_epochs=1, log_every_n_steps=1, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  logger=CSVLogger(tempfile.mkdtemp()), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
trainer.fit(Model(), data)
print("loss scale after each step:", scales)
print("logged metric names:", sorted(trainer.logged_metrics))
