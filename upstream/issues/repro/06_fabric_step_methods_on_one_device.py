"""On one device, Fabric runs ``forward`` under the precision but not the step methods (``training_step`` and the
methods marked with ``mark_forward_method``), which a strategy that wraps the module (DDP, FSDP) routes through
``forward``.

Run: ``python 06_fabric_step_methods_on_one_device.py`` (lightning >= 2.1, torch >= 2.1, CPU; seconds). It prints the
dtype a layer computes in, called through ``forward`` and through ``training_step``, with ``bf16-mixed``; and what
``training_step`` does with a float32 batch under ``bf16-true``, where ``forward`` converts the input.
"""

import warnings

import torch
from torch import nn

from lightning.fabric import Fabric

warnings.filterwarnings("ignore")


class Module(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.inside = []

    def forward(self, batch):
        out = self.layer(batch)
        self.inside.append(out.dtype)
        return out

    def training_step(self, batch):
        return self(batch)


batch = torch.randn(1, 2)
fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
model = fabric.setup_module(Module())
model(batch)
model.training_step(batch)
print("bf16-mixed, dtype inside: model(batch)", model.inside[0], "| model.training_step(batch)", model.inside[1])

fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
with fabric.init_module():
    module = Module()
model = fabric.setup_module(module)
print("bf16-true, model(batch) with a float32 batch:", model(batch).dtype)
try:
    print("bf16-true, model.training_step(batch) with a float32 batch:", model.training_step(batch).dtype)
except RuntimeError as err:
    print("bf16-true, model.training_step(batch) with a float32 batch: RuntimeError:", str(err).splitlines()[0])
