"""RFC 07: clipping under a gradient scaler: the Trainer's ``self.clip_gradients`` returns nothing.

Run: ``python 07_clipping_under_a_scaler.py`` (lightning 2.6.6, torch >= 2.3, CPU; a few seconds). Manual optimization
under ``16-mixed``: ``self.clip_gradients(...)`` returns ``None``, where ``fabric.clip_gradients`` returns the total norm.
(The Fabric half, raising on an overflow step, is reproduced by ``../../issues/repro/07_*.py``.)
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import MixedPrecision

class Manual(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(8, 2)
        self.returned = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.layer(x).float(), y))
        self.returned.append(self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm"))
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)), batch_size=4)
model = Manual()
Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]).fit(model, data)
print("self.clip_gradients(...) returned:", model.returned)
