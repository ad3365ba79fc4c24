"""``self.clip_gradients`` under ``precision="16-mixed"`` in manual optimization clips the scaled gradients.

Run: ``python 04_clip_gradients_in_manual_optimization.py`` (lightning >= 2.1, torch >= 2.4, CPU; seconds). It trains
a ``BoringModel`` for six manual-optimization steps with ``self.clip_gradients(...)`` before ``opt.step()`` (the manual
optimization docs' example), one step with an overflow among them, and the same model with PyTorch's AMP recipe
(``scaler.scale(loss).backward()``, ``scaler.unscale_(opt)``, clip, ``scaler.step(opt)``, ``scaler.update()``). It prints
the final loss scale and the largest parameter difference from the recipe, by norm and by value.
"""

import copy
import warnings

import torch
from torch.utils.data import DataLoader

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins import MixedPrecision

warnings.filterwarnings("ignore")
CLIP = {"norm": 0.05, "value": 0.01}


def batches():
    generator = torch.Generator().manual_seed(0)
    data = [torch.randn(4, 32, generator=generator) for _ in range(6)]
    data[2][0, 0] = float("inf")  # an overflow: the scaler must skip this step and halve its scale
    return data


def scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


class Model(BoringModel):
    def __init__(self, algorithm):
        super().__init__()
        self.automatic_optimization = False
        self.algorithm = algorithm

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.layer(batch).float().pow(2).mean())
        self.clip_gradients(opt, gradient_clip_val=CLIP[self.algorithm], gradient_clip_algorithm=self.algorithm)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


for algorithm in ("norm", "value"):
    torch.manual_seed(1)
    model = Model(algorithm)
    reference = copy.deepcopy(model)
    lightning_scaler = scaler()
    Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, plugins=[MixedPrecision("16-mixed", "cpu", scaler=lightning_scaler)],
            ).fit(model, DataLoader(batches(), batch_size=None))

    recipe_scaler = scaler()
    optimizer = reference.configure_optimizers()
    for batch in batches():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = reference.layer(batch).float().pow(2).mean()
        recipe_scaler.scale(loss).backward()
        recipe_scaler.unscale_(optimizer)
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP["norm"])
        else:
            torch.nn.utils.clip_grad_value_(reference.parameters(), CLIP["value"])
        recipe_scaler.step(optimizer)
        recipe_scaler.update()

    difference = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    print(f"clip by {algorithm}: scale {lightning_scaler.get_scale():g} (recipe {recipe_scaler.get_scale():g}),"
          f" max |parameter - recipe| = {difference:.3g}")
