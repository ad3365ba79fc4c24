"""``fabric.clip_gradients(..., max_norm=...)`` raises on the first overflow step under ``precision="16-mixed"``.

Run: ``python 07_fabric_clip_gradients_on_an_overflow_step.py`` (lightning >= 2.1, torch >= 2.4, CPU; seconds). Four
steps of a Fabric loop with a gradient scaler, the third with an overflow (inf) in its batch, which the scaler is meant
to skip; the same loop with PyTorch's AMP recipe (``clip_grad_norm_`` with its default ``error_if_nonfinite=False``).
"""

import torch
from torch import nn

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision

generator = torch.Generator().manual_seed(0)
batches = [torch.randn(4, 32, generator=generator) for _ in range(4)]
batches[2][0, 0] = float("inf")

torch.manual_seed(1)
module = nn.Linear(32, 2)
reference = nn.Linear(32, 2)
reference.load_state_dict(module.state_dict())
fabric = Fabric(accelerator="cpu", devices=1,
                plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))])
model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
for step, batch in enumerate(batches):
    optimizer.zero_grad()
    fabric.backward(model(batch).float().pow(2).mean())
    try:
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    except RuntimeError as err:
        print(f"fabric, step {step}: RuntimeError: {str(err).splitlines()[0]}")
        break
    optimizer.step()
    print(f"fabric, step {step}: norm {norm.item():.4g}, scale {fabric.strategy.precision.scaler.get_scale():g}")

reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
for step, batch in enumerate(batches):
    reference_optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = reference(batch).float().pow(2).mean()
    scaler.scale(loss).backward()
    scaler.unscale_(reference_optimizer)
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    scaler.step(reference_optimizer)
    scaler.update()
    print(f"PyTorch's recipe, step {step}: norm {norm.item():.4g}, scale {scaler.get_scale():g}")
