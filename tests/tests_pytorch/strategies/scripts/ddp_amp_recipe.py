"""Train the DDP mixed-precision cases of ``tests_pytorch/helpers/amp_ddp.py`` with 2 CPU processes over gloo.

Usage: ``python ddp_amp_recipe.py OUTDIR [--stock]``. The first ``Trainer(strategy="ddp").fit`` re-launches this
script as rank 1 (Lightning's subprocess launcher); rank 0 keeps going and sets ``LOCAL_RANK`` for itself, so every
later Trainer of the script joins the same two processes and process group. Both ranks run every case in the same
order and save what they recorded as ``OUTDIR/<package>-<case>-rank<r>.pt`` (the test compares the two ranks too).
With ``--stock`` the negative-control cases run afterwards through the unpatched ``stock_pytorch_lightning`` 2.6.6.
"""

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

# tests/ on sys.path, for the shared helper (this file is tests/tests_pytorch/strategies/scripts/...)
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from amp_oracle.trainer import FORK, STOCK, lightning_api
from amp_oracle.world import CLIP_NORM, LOW_INIT_SCALE, new_scaler
from tests_pytorch.helpers.amp_ddp import CASES, STOCK_CASES, Case, RankBatches, make_net, make_optimizers


def api(package: str):
    shared = lightning_api(package)
    return shared.pl, shared.MixedPrecision


def module_class(pl):
    class DDPRecipeModule(pl.LightningModule):
        def __init__(self, case: Case, seed: int = 11) -> None:
            super().__init__()
            self.case = case
            self.net = make_net(seed)
            self.automatic_optimization = case.automatic
            self.scales: list[float] = []
            self.skipped: list[tuple] = []

        def configure_optimizers(self):
            opts = make_optimizers(self.case, self.net)
            return opts[0] if len(opts) == 1 else opts

        def train_dataloader(self):
            return RankBatches(self.global_rank)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            if self.global_rank in self.case.inf_ranks(batch_idx):
                loss = loss * float("inf")
            if self.automatic_optimization:
                return loss
            opts = self.optimizers()
            opts = opts if isinstance(opts, list) else [opts]
            for opt in opts:
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in opts:
                if self.case.clip:
                    self.clip_gradients(opt, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
                opt.step()
            self.skipped.append(tuple(getattr(opt, "step_was_skipped", None) for opt in opts))
            return None

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if self.automatic_optimization:
                self.skipped.append((getattr(self.optimizers(), "step_was_skipped", None),))
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                self.scales.append(scaler.get_scale())

    return DDPRecipeModule


def fit(package: str, case: Case, epochs: int, module=None, ckpt_path=None):
    pl, MixedPrecision = api(package)
    kwargs = {}
    if case.uses_scaler:
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=new_scaler(init_scale=LOW_INIT_SCALE))]
    else:
        kwargs["precision"] = "32-true" if case.precision == "32" else case.precision
    if case.automatic and case.clip:
        kwargs.update(gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        **kwargs,
    )
    module = module if module is not None else module_class(pl)(case)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def record(module, scales=None, skipped=None) -> dict:
    return {
        "params": {name: p.detach().clone() for name, p in module.net.named_parameters()},
        "scales": (scales or []) + module.scales,
        "skipped": (skipped or []) + module.skipped,
    }


def run_case(package: str, case: Case, outdir: Path) -> None:
    trainer, module = fit(package, case, case.epochs)
    results = {case.name: record(module)}
    if case.resume:
        # the same training, interrupted after all but the last epoch and resumed by a fresh Trainer from the
        # checkpoint, into a network with other weights: everything must come from the checkpoint
        trainer, first = fit(package, case, case.epochs - 1)
        ckpt = outdir / f"{package}-{case.name}.ckpt"
        trainer.save_checkpoint(ckpt)
        pl, _ = api(package)
        _, second = fit(package, case, case.epochs, module=module_class(pl)(case, seed=99), ckpt_path=ckpt)
        results[case.name + "-resumed"] = record(second, first.scales, first.skipped)
    rank = trainer.global_rank
    for name, result in results.items():
        torch.save(result, outdir / f"{package}-{name}-rank{rank}.pt")


def main() -> None:
    outdir = Path(sys.argv[1])
    warnings.filterwarnings("ignore")
    # one intra-op thread per process: 2 processes share the 2 cores; tiny matmuls do not use more anyway
    torch.set_num_threads(1)
    for case in CASES.values():
        run_case(FORK, case, outdir)
    if "--stock" in sys.argv:
        for name in STOCK_CASES:
            run_case(STOCK, CASES[name], outdir)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        (outdir / "done").touch()


if __name__ == "__main__":
    main()
