"""RFC 07: clipping under a gradient scaler: Fabric raises on an overflow step; the Trainer's clip returns nothing.

Run: ``python 07_clipping_under_a_scaler.py`` (lightning 2.6.6, torch >= 2.3, CPU; a few seconds).

1. Fabric, 16-mixed with a CPU scaler, one overflowing loss: ``fabric.clip_gradients(..., max_norm=1.0)`` raises,
   where PyTorch's recipe clips (``error_if_nonfinite=False`` by default) and lets ``scaler.step`` skip the step.
2. Trainer, manual optimization: ``self.clip_gradients(...)`` returns ``None``; ``fabric.clip_gradients`` returns
   the total norm.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import MixedPrecision

fabric = Fabric(accelerator="cpu", devices=1,
                plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
module = nn.Linear(8, 2)
model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
fabric.backward(model(torch.randn(4, 8)).float().pow(2).mean() * float("inf"))
try:
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    print("1. fabric.clip_gradients on an overflow step: no error")
except RuntimeError as err:
    print("1. fabric.clip_gradients on an overflow step:", str(err).splitlines()[0])


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
print("2. self.clip_gradients(...) returned:", model.returned)
