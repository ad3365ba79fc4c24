"""In manual optimization, ``manual_backward`` and the optimizer step run under autocast.

Run: ``python 05_manual_backward_under_autocast.py`` (lightning >= 2.1, torch >= 2.4, CPU; seconds). A model whose head
runs in float32 (``torch.autocast(..., enabled=False)`` in ``forward``, as the AMP docs advise for sensitive layers),
four steps with ``bf16-mixed``: it prints whether autocast is on where the backward and the step run, and the largest
parameter difference from PyTorch's AMP recipe (autocast around the forward and the loss only), in manual and in
automatic optimization.
"""

import copy
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning.pytorch import LightningModule, Trainer

warnings.filterwarnings("ignore")
generator = torch.Generator().manual_seed(0)
batches = [(torch.randn(4, 32, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(4)]


class Model(LightningModule):
    def __init__(self, manual):
        super().__init__()
        self.automatic_optimization = not manual
        self.layer = nn.Linear(32, 2)
        self.head = nn.Linear(2, 2)
        self.autocast_on = {}

    def forward(self, x):
        out = self.layer(x)
        with torch.autocast("cpu", enabled=False):
            return self.head(out.float())

    def loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def training_step(self, batch, batch_idx):
        if self.automatic_optimization:
            return self.loss(batch)
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.loss(batch))
        opt.step()
        return None

    def on_after_backward(self):
        self.autocast_on["on_after_backward"] = torch.is_autocast_enabled("cpu")

    def on_before_optimizer_step(self, optimizer):
        self.autocast_on["on_before_optimizer_step"] = torch.is_autocast_enabled("cpu")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


for manual in (True, False):
    torch.manual_seed(1)
    model = Model(manual)
    reference = copy.deepcopy(model)
    Trainer(accelerator="cpu", max_epochs=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(model, DataLoader(batches, batch_size=None))
    optimizer = reference.configure_optimizers()
    for batch in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = reference.loss(batch)
        loss.backward()
        optimizer.step()
    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    mode = "manual" if manual else "automatic"
    print(f"{mode} optimization: autocast on in {model.autocast_on}; max |parameter - recipe| = {difference:.2g}")
