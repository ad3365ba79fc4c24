"""Clipping a fused optimizer under ``precision="16-mixed"`` raises, in the Trainer and in Fabric, although PyTorch's
AMP recipe handles it (``scaler.unscale_(opt)`` then ``scaler.step(opt)`` passes no ``grad_scale`` to the fused step).

Run: ``python 03_clip_fused_optimizers.py`` (lightning >= 2.1, torch >= 2.4, CPU; seconds). It prints what the Trainer
(``gradient_clip_val``) and Fabric (``fabric.clip_gradients``) do with ``AdamW(fused=True)``, and that PyTorch's recipe
gives the fused and the for-loop ``AdamW`` the same parameters with clipping.
"""

import copy
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import MixedPrecision

warnings.filterwarnings("ignore")
generator = torch.Generator().manual_seed(0)
batches = [torch.randn(4, 32, generator=generator) for _ in range(4)]


def first_line(err):
    return f"{type(err).__name__}: {str(err).splitlines()[0]}"


class Model(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)


try:
    Trainer(accelerator="cpu", max_epochs=1, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
            ).fit(Model(), DataLoader(batches, batch_size=None))
    print("Trainer(gradient_clip_val=1.0), AdamW(fused=True): trained")
except Exception as err:
    print("Trainer(gradient_clip_val=1.0), AdamW(fused=True):", first_line(err))

fabric = Fabric(accelerator="cpu", devices=1,
                plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
module = nn.Linear(32, 2)
model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=0.01, fused=True))
fabric.backward(model(batches[0]).float().pow(2).mean())
try:
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    print("fabric.clip_gradients, AdamW(fused=True): clipped")
except Exception as err:
    print("fabric.clip_gradients, AdamW(fused=True):", first_line(err))

# PyTorch's recipe with clipping, fused and for-loop AdamW
torch.manual_seed(1)
layers = {"fused": nn.Linear(32, 2)}
layers["for-loop"] = copy.deepcopy(layers["fused"])
for kind, layer in layers.items():
    opt = torch.optim.AdamW(layer.parameters(), lr=0.01, fused=kind == "fused")
    scaler = torch.amp.GradScaler("cpu")
    for batch in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = layer(batch).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
difference = max((p - q).abs().max().item() for p, q in zip(layers["fused"].parameters(), layers["for-loop"].parameters()))
print(f"PyTorch's recipe with clipping: max |fused - for-loop AdamW| = {difference:.2g}")
