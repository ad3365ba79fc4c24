"""RFC 06: autocast's weight cache in manual optimization: the stale weights it brings, the memory it saves.

Run: ``python 06_autocast_cache_policy.py [cpu|cuda]`` (torch >= 2.4 and lightning; CPU about a minute). Seeded: the
same numbers on every run.

1. Stale weights. Manual optimization, ``bf16-mixed``: a forward after ``opt.step()`` in the same ``training_step``
   against a fresh forward of the same weights (autocast without the cache). 0 where nothing is stale.
2. Peak memory. Manual optimization, ``bf16-mixed``: one ``Linear(4096, 4096)`` applied 8 times in ``training_step``
   (weights reused, as an RNN cell or tied layers), ``manual_backward`` and ``opt.step()``. Each measurement runs in a
   fresh process: the peak resident memory on CPU (``ru_maxrss``), ``torch.cuda.max_memory_allocated`` on CUDA, above
   what the process held before ``fit``. First with plain torch, autocast's cache on and off (what #21611 is about:
   with the cache off, each use saves its own low-precision copy of the weight for the backward), then through the
   ``lightning`` this script imports.
"""

import resource
import subprocess
import sys

import torch
from torch import nn

DEVICE = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in ("cpu", "cuda") else "cpu"
SIZE, USES, BATCH = 4096, 8, 16


def peak_bytes():
    if DEVICE == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure(mode):
    """One measurement in this (fresh) process; prints the peak above the start in MiB."""
    torch.manual_seed(0)
    layer = nn.Linear(SIZE, SIZE, device=DEVICE)
    x = torch.randn(BATCH, SIZE, device=DEVICE)
    if mode.startswith("torch"):
        opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
        start = peak_bytes()
        for _ in range(2):
            with torch.autocast(DEVICE, dtype=torch.bfloat16, cache_enabled=mode == "torch-cache-on"):
                out = x
                for _ in range(USES):
                    out = layer(out)
                loss = out.float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        from lightning.pytorch import LightningModule, Trainer

        class Reuse(LightningModule):
            def __init__(self):
                super().__init__()
                self.automatic_optimization = False
                self.layer = layer

            def training_step(self, batch, batch_idx):
                opt = self.optimizers()
                out = batch
                for _ in range(USES):
                    out = self.layer(out)
                self.manual_backward(out.float().pow(2).mean())
                opt.step()
                opt.zero_grad()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=1e-3)

        model = Reuse()
        trainer = Trainer(accelerator=DEVICE, devices=1, max_steps=2, precision="bf16-mixed", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        start = peak_bytes()
        trainer.fit(model, torch.utils.data.DataLoader([x.cpu(), x.cpu()], batch_size=None))
    print(f"{(peak_bytes() - start) / 2**20:.0f}")




def stale_weights():
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    import lightning
    from lightning.pytorch import LightningModule, Trainer

    warnings.filterwarnings("ignore")

    class Model(LightningModule):
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
    torch.manual_seed(0)
    model = Model()
    Trainer(accelerator="cpu", max_epochs=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(model, data)
    print(f"lightning {lightning.__version__} from {lightning.__file__}")
    print("1. max |forward after opt.step() - fresh forward| per batch:", [round(d, 3) for d in model.differences])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "--measure":
        measure(sys.argv[3])
        sys.exit(0)
    stale_weights()
    weight_cast = SIZE * SIZE * 2 / 2**20
    print(f"2. peak memory above the start, {DEVICE}, Linear({SIZE}, {SIZE}) used {USES} times per step"
          f" (one bf16 copy of the weight: {weight_cast:.0f} MiB):")
    for mode in ("torch-cache-on", "torch-cache-off", "lightning"):
        out = subprocess.run([sys.executable, __file__, DEVICE, "--measure", mode], capture_output=True, text=True)
        value = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else f"failed: {out.stderr[-300:]}"
        print(f"   {mode}: {value} MiB")
