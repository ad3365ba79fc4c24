"""RFC 06: autocast's weight cache: what it buys, and the stale weights it brings into manual optimization.

Run: ``python 06_autocast_cache_policy.py`` (torch >= 2.4 and lightning, CPU; about 20 s).

1. A layer applied 8 times per forward (weights reused), bf16 autocast on CPU: forward and backward with the cache on
   and off (plain torch), the median time of 20 steps over 7 alternating rounds, and the ratio.
2. Manual optimization, ``bf16-mixed``: a forward after ``opt.step()`` in the same ``training_step`` against a fresh
   bf16 forward of the same weights. Lightning 2.6.6 runs ``training_step`` with the cache off: 0. Master (#21616) turns
   the cache on for the step: the forward reuses the casts of the weights from before the step (run this script with
   master's ``src/`` on ``PYTHONPATH`` to see it).
"""

import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning
from lightning.pytorch import LightningModule, Trainer

# 1. what the cache buys
layer = nn.Linear(256, 256)
x = torch.randn(64, 256)


def step(cache_enabled):
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
        out = x
        for _ in range(8):
            out = layer(out)
    out.float().sum().backward()


for cache_enabled in (True, False):  # warm up
    for _ in range(5):
        step(cache_enabled)
times = {True: [], False: []}
for _ in range(7):  # alternating rounds
    for cache_enabled in (True, False):
        start = time.perf_counter()
        for _ in range(20):
            step(cache_enabled)
        times[cache_enabled].append(time.perf_counter() - start)
on, off = statistics.median(times[True]), statistics.median(times[False])
print(f"tied layer x8, bf16 CPU, 20 steps (median of 7): cache on {on:.3f} s, off {off:.3f} s, on/off {on / off:.2f}")


# 2. stale weights after a step in manual optimization
class StepThenForward(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = nn.Linear(8, 64)
        self.differences = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.layer(x).float().pow(2).mean())
        opt.step()
        after_step = self.layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            fresh = self.layer(x)
        self.differences.append((after_step.float() - fresh.float()).abs().max().item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=10.0)


g = torch.Generator().manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)), batch_size=4)
model = StepThenForward()
Trainer(accelerator="cpu", max_epochs=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False).fit(model, data)
print(f"lightning from {lightning.__file__}: max |forward after opt.step() - fresh forward| per batch:",
      [round(d, 3) for d in model.differences])
