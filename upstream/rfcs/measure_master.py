"""The measurements on upstream master quoted in these RFC drafts: `PYTHONPATH=<master>/src python measure_master.py`
(torch 2.13.0 CPU). Each block prints one line, numbered as the RFC it belongs to."""

import copy
import logging
import os
import tempfile
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins import MixedPrecision

warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)


def data(n=4):
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(
            torch.randn(4 * n, 8, generator=g), torch.randn(4 * n, 2, generator=g)
        ),
        batch_size=4,
    )


RUN = dict(
    accelerator="cpu",
    max_epochs=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


# (1) two optimizers fed by one backward: the second is unscaled with a scale that did not scale its gradients
class TwoOpt(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)
        self.seen = []

    def training_step(self, batch, i):
        x, y = batch
        oa, ob = self.optimizers()
        oa.zero_grad()
        ob.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self.b(self.a(x)).float(), y))
        oa.step()
        ob.step()

    def on_before_optimizer_step(self, opt):
        self.seen.append(
            torch.nn.utils.get_total_norm(
                [p.grad for g in opt.param_groups for p in g["params"]]
            ).item()
        )

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(
            self.b.parameters(), lr=0.1
        )


torch.manual_seed(0)
m = TwoOpt()
r = copy.deepcopy(m)
Trainer(
    plugins=[
        MixedPrecision(
            "16-mixed",
            "cpu",
            scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1),
        )
    ],
    **RUN,
).fit(m, data())
sc = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
oa, ob = r.configure_optimizers()
rseen = []
for x, y in data():
    oa.zero_grad()
    ob.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(r.b(r.a(x)).float(), y)
    sc.scale(loss).backward()
    for o in (oa, ob):
        sc.unscale_(o)
        rseen.append(
            torch.nn.utils.get_total_norm(
                [p.grad for p in o.param_groups[0]["params"]]
            ).item()
        )
        sc.step(o)
    sc.update()
print(
    "(1) second optimizer's unscaled grad norm / recipe's:",
    [round(a / b, 3) for a, b in zip(m.seen[1::2], rseen[1::2])],
    "first optimizer:",
    [round(a / b, 3) for a, b in zip(m.seen[0::2], rseen[0::2])],
)
print(
    "    max |param diff| vs recipe:",
    max((p - q).abs().max().item() for p, q in zip(m.parameters(), r.parameters())),
)


# (2) skipped steps: a step-interval scheduler advances on a step the scaler skipped
class Sched(LightningModule):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 2)

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.mse_loss(self.l(x).float(), y)
        return loss * float("inf") if i in (0, 1) else loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                "interval": "step",
            },
        }


m = Sched()
t = Trainer(
    plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
    **RUN,
)
t.fit(m, data())
print(
    "(2) 4 batches, the first 2 skipped (inf): scheduler.last_epoch =",
    t.lr_scheduler_configs[0].scheduler.last_epoch,
    "lr =",
    t.optimizers[0].param_groups[0]["lr"],
    "(2 real steps would give 0.25); scale",
    t.precision_plugin.scaler.get_scale(),
)


# (4) fabric.save/load of model + optimizer loses the scaler's state
def fabric(**scaler_kwargs):
    scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
    f = Fabric(
        accelerator="cpu",
        devices=1,
        plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    f.launch()
    return f


f = fabric()
torch.manual_seed(0)
net = nn.Linear(8, 2)
opt = torch.optim.SGD(net.parameters(), lr=0.1)
net, opt = f.setup(net, opt)
for i, (x, y) in enumerate(data(6)):
    opt.zero_grad()
    loss = nn.functional.mse_loss(net(x).float(), y)
    f.backward(loss * float("inf") if i < 3 else loss)
    opt.step()
live = f.strategy.precision.scaler.get_scale()
path = os.path.join(tempfile.mkdtemp(), "ckpt")
f.save(path, {"model": net, "optimizer": opt})
f2 = fabric()
net2 = nn.Linear(8, 2)
opt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
net2, opt2 = f2.setup(net2, opt2)
f2.load(path, {"model": net2, "optimizer": opt2})
print(
    "(4) live scale after 3 overflow steps:",
    live,
    "; scale after fabric.save/fabric.load of model+optimizer:",
    f2.strategy.precision.scaler.get_scale(),
)

# (5) Fabric, GAN-style D step then G's backward: an update lands between them
f = fabric(init_scale=2.0**8, growth_interval=1)
scales = []
orig_update = f.strategy.precision.scaler.update


def update(*a, **k):
    orig_update(*a, **k)
    scales.append(f.strategy.precision.scaler.get_scale())


f.strategy.precision.scaler.update = update
torch.manual_seed(0)
d = nn.Linear(8, 2)
g = nn.Linear(8, 8)
od = torch.optim.SGD(d.parameters(), lr=0.1)
og = torch.optim.SGD(g.parameters(), lr=0.1)
d, od = f.setup(d, od)
g, og = f.setup(g, og)
for x, y in data(2):
    od.zero_grad()
    f.backward(nn.functional.mse_loss(d(g(x).detach()).float(), y))
    od.step()
    og.zero_grad()
    f.backward(nn.functional.mse_loss(d(g(x)).float(), y))
    og.step()
print(
    "(5) Fabric, 2 iterations of D step + G step: scaler.update() calls:",
    len(scales),
    "scales after each:",
    scales,
)


# (6) master's cache: a forward after opt.step() in the same training_step reuses the stale bf16 weights
class Stale(LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.l = nn.Linear(8, 64)
        self.diff = []

    def training_step(self, batch, i):
        x, y = batch
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.l(x).float().pow(2).mean())
        opt.step()
        out = self.l(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            fresh = self.l(x)
        self.diff.append((out.float() - fresh.float()).abs().max().item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=10.0)


m = Stale()
Trainer(precision="bf16-mixed", **RUN).fit(m, data())
print(
    "(6) bf16-mixed manual: max |forward after opt.step() - fresh bf16 forward| per batch:",
    [round(v, 3) for v in m.diff],
)
