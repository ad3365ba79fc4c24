"""RFC 05: in Fabric, every ``optimizer.step()`` under 16-mixed also calls ``scaler.update()``.

Run: ``python 05_fabric_training_iteration.py`` (lightning 2.6.6, torch >= 2.3, CPU; a few seconds). A GAN-style
iteration (D step, then G step, each with its own backward) updates the scale twice per iteration, where PyTorch's
multi-optimizer recipe updates once, after all steps. The documented-recipe alternative below drives the scaler by hand
for the iteration: ``scaler.step`` per optimizer, one ``scaler.update()``.
"""

import torch
from torch import nn

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision


def run(one_update_per_iteration):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    torch.manual_seed(0)
    g_module, d_module = nn.Linear(8, 8), nn.Linear(8, 2)
    g, opt_g = fabric.setup(g_module, torch.optim.SGD(g_module.parameters(), lr=0.1))
    d, opt_d = fabric.setup(d_module, torch.optim.SGD(d_module.parameters(), lr=0.1))
    scales = []
    for _ in range(2):
        x, y = torch.randn(4, 8), torch.randn(4, 2)
        for model, optimizer, loss in ((d, opt_d, lambda: d(g(x).detach())), (g, opt_g, lambda: d(g(x)))):
            optimizer.zero_grad()
            fabric.backward(nn.functional.mse_loss(loss().float(), y))
            if one_update_per_iteration:
                scaler.step(optimizer.optimizer)  # the raw optimizer: no update here
            else:
                optimizer.step()  # Fabric: scaler.step(...) and scaler.update()
                scales.append(scaler.get_scale())
        if one_update_per_iteration:
            scaler.update()
            scales.append(scaler.get_scale())
    return scales


print("Fabric's optimizer.step(): scale after each update:", run(False))
print("one update per iteration (by hand):               ", run(True))
