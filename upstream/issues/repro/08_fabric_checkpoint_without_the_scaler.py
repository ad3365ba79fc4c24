"""``fabric.save``/``fabric.load`` of the checkpoint guide's state (model and optimizer) lose the gradient scaler's
state under ``precision="16-mixed"``; putting the scaler into the state, which no page says, keeps it.

Run: ``python 08_fabric_checkpoint_without_the_scaler.py`` (lightning >= 2.1, torch >= 2.4, CPU; seconds). After three
overflowing steps the live scale is 8192; a fresh Fabric that loads the guide's checkpoint starts again at 65536.
"""

import os
import tempfile

import torch
from torch import nn

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision


def setup():
    fabric = Fabric(accelerator="cpu", devices=1,
                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    module = nn.Linear(8, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    return fabric, model, optimizer


torch.manual_seed(0)
fabric, model, optimizer = setup()
for step in range(6):
    optimizer.zero_grad()
    loss = model(torch.randn(4, 8)).float().pow(2).mean()
    fabric.backward(loss * float("inf") if step < 3 else loss)
    optimizer.step()
print("live scale:", fabric.strategy.precision.scaler.get_scale())

folder = tempfile.mkdtemp()
fabric.save(os.path.join(folder, "a.ckpt"), {"model": model, "optimizer": optimizer})
fabric.save(os.path.join(folder, "b.ckpt"),
            {"model": model, "optimizer": optimizer, "scaler": fabric.strategy.precision.scaler})

for name, with_scaler in (("a.ckpt", False), ("b.ckpt", True)):
    fabric2, model2, optimizer2 = setup()
    state = {"model": model2, "optimizer": optimizer2}
    if with_scaler:
        state["scaler"] = fabric2.strategy.precision.scaler
    fabric2.load(os.path.join(folder, name), state)
    print(f"after fabric.load, state with{'' if with_scaler else 'out'} the scaler:",
          fabric2.strategy.precision.scaler.get_scale())
