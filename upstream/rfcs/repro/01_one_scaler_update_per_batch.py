"""RFC 01: two optimizers fed by one backward under 16-mixed get one scaler update each, not one per batch.

Run: ``python 01_one_scaler_update_per_batch.py`` (lightning 2.6.6, torch >= 2.3, CPU; about 10 s). The Trainer calls
``scaler.update()`` after every optimizer step, so the second optimizer's gradients are unscaled with a scale that did
not multiply them (``growth_interval=1`` makes the scale move at every update). PyTorch's recipe updates once per
iteration, after all steps (https://pytorch.org/docs/stable/notes/amp_examples.html#working-with-multiple-models-losses-and-optimizers).
"""

import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import MixedPrecision


def batches():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)), batch_size=4)


def scaler():
    return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)


def grad_norm(optimizer):
    return torch.cat([p.grad.flatten() for g in optimizer.param_groups for p in g["params"]]).norm().item()


class TwoOptimizers(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.norms = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.b(self.a(x)).float(), y))
        opt_a.step()
        opt_b.step()

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(grad_norm(optimizer))

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)


torch.manual_seed(0)
model = TwoOptimizers()
recipe = copy.deepcopy(model)
trainer = Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler())])
trainer.fit(model, batches())

recipe_scaler, recipe_norms = scaler(), []
opt_a, opt_b = recipe.configure_optimizers()
for x, y in batches():
    opt_a.zero_grad()
    opt_b.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(recipe.b(recipe.a(x)).float(), y)
    recipe_scaler.scale(loss).backward()
    for optimizer in (opt_a, opt_b):
        recipe_scaler.unscale_(optimizer)
        recipe_norms.append(grad_norm(optimizer))
        recipe_scaler.step(optimizer)
    recipe_scaler.update()

print("first optimizer, unscaled grad norm / recipe's: ",
      [round(a / b, 3) for a, b in zip(model.norms[0::2], recipe_norms[0::2])])
print("second optimizer, unscaled grad norm / recipe's:",
      [round(a / b, 3) for a, b in zip(model.norms[1::2], recipe_norms[1::2])])
print("final scale: Trainer", trainer.precision_plugin.scaler.get_scale(), "recipe", recipe_scaler.get_scale())
print("max |parameter difference| after 4 batches:",
      max((p - q).abs().max().item() for p, q in zip(model.parameters(), recipe.parameters())))
