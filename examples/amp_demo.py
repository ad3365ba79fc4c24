"""Mixed precision in manual and automatic optimization: the fork against PyTorch's own AMP recipe.

What is trained
    A small regression MLP (the *student*) and an EMA copy of it (the *teacher*), evaluated under ``torch.no_grad()``
    and moved only as an exponential moving average of the student, as in the user report "Proper way to use mixed
    precision with manual optimization". The loss is the student's MSE to the targets plus a consistency MSE to the
    teacher's output. Gradients are clipped by norm. Two optimizers, one run each:

    * ``SGD`` with momentum, the plainest optimizer, whose step autocast leaves alone;
    * ``Adafactor`` (``torch.optim.Adafactor``), whose step multiplies its factored second moments with a matmul,
      which autocast lowers to bf16/fp16 when the step runs under it.

What is compared
    The same training (same initial weights, same batches in the same order, same optimizer) is run

    * by a hand-written loop that follows PyTorch's AMP recipe ("Automatic Mixed Precision examples" in the torch
      docs): ``torch.autocast`` around the forward pass and the loss only, ``scaler.scale(loss).backward()``,
      ``scaler.unscale_(opt)`` before clipping, ``scaler.step(opt)``, one ``scaler.update()`` per iteration. This is the
      reference;
    * through the fork's ``lightning`` Trainer, in manual optimization (``self.manual_backward``,
      ``self.clip_gradients``, ``opt.step()``, written as the Lightning docs say: no autocast, no scaler in user code)
      and in automatic optimization (``Trainer(gradient_clip_val=...)``);
    * through the stock 2.6.6 Trainer, the same two ways: ``stock_pytorch_lightning``, upstream's ``pytorch_lightning``
      2.6.6 wheel unpatched, with its packages renamed so that it installs next to the fork (``make setup`` builds and
      installs it): it shows what the fork fixes;

    each in precision ``32``, ``bf16-mixed`` and ``16-mixed``. On a CPU, stock 2.6.6 turns ``precision="16-mixed"``
    into bf16 (the fork, with torch >= 2.3, does not), so 16-mixed is requested from both as
    ``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu"))``: float16 autocast with a real gradient scaler,
    whose scale grows until float16 overflows and steps get skipped.

What it prints
    For every run, the largest absolute difference of its final parameters (student and teacher) from the recipe's,
    whether they are bitwise equal (0 is the fork's promise), and the final loss (the trained student's MSE on the whole
    data set, in float32). The loss curves go to ``artifacts/amp_demo.png``: one panel per optimizer and precision,
    which reproduces the user report's comparison (32 against bf16-mixed, manual against automatic), with the fork and
    the stock package side by side.

What to expect (torch 2.13, CPU)
    Every run of the fork, and every automatic-optimization run of stock 2.6.6, equals the recipe bit for bit. Stock
    2.6.6 in manual optimization does not, because it runs the whole ``training_step`` under autocast and knows nothing
    of the scaler until ``opt.step()``:

    * ``self.clip_gradients`` clips gradients still multiplied by the loss scale, so under 16-mixed SGD's true gradients
      are clipped to 1/scale of the norm asked for and training stalls (Lightning issue #18089);
    * ``opt.step()`` runs under autocast, so Adafactor's second-moment matmul runs in bf16 and drifts from the recipe
      under bf16-mixed, and in float16, where it underflows and writes NaN into the weights at the first step.

    The stock package is equal to the recipe in bf16-mixed with SGD: what the user report saw there is not reproduced on
    this torch for an optimizer whose step autocast leaves alone.

The exit status is 1 if any run of the fork is not bitwise equal to the recipe, so the demo doubles as a check.

Run it with ``make demo``, or ``python examples/amp_demo.py`` where the fork is installed as ``lightning``.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
AMP_DTYPES = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
MODES = ("manual", "automatic")
#: label -> importable package: the fork, and the unpatched upstream release as the negative control
PACKAGES = {"fork": "lightning", "stock": "stock_pytorch_lightning"}
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "Adafactor": lambda params: torch.optim.Adafactor(params, lr=0.01),
}

IN_FEATURES, HIDDEN, OUT_FEATURES = 16, 64, 4
BATCH_SIZE, DATASET_BATCHES = 32, 16  # a data set of 16 batches of 32, seen once per epoch
STEPS = 320  # 20 epochs; small matrices keep float16 (slow on a CPU) as fast as the rest
CLIP_NORM = 1.0
EMA_DECAY = 0.9
CONSISTENCY = 0.5
#: a power of two (scaling is exact) that doubles every 20 iterations until float16 overflows
INIT_SCALE, GROWTH_INTERVAL = 2.0**12, 20

DEFAULT_PLOT = Path(__file__).resolve().parents[1] / "artifacts" / "amp_demo.png"  # artifacts/ of the checkout


# ---------------------------------------------------------------------------------------------------------------------
# what both sides share: data, network, optimizer, scaler (what a user writes once)
# ---------------------------------------------------------------------------------------------------------------------

Batch = tuple[Tensor, Tensor]


def make_dataset(seed: int = 1234) -> list[Batch]:
    """Fixed batches ``(x, y)`` of a smooth nonlinear regression with a little noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(DATASET_BATCHES * BATCH_SIZE, IN_FEATURES, generator=gen)
    w_in = torch.randn(IN_FEATURES, 32, generator=gen) / IN_FEATURES**0.5
    w_out = torch.randn(32, OUT_FEATURES, generator=gen) / 32**0.5
    y = torch.tanh(x @ w_in) @ w_out + 0.05 * torch.randn(len(x), OUT_FEATURES, generator=gen)
    return list(zip(x.split(BATCH_SIZE), y.split(BATCH_SIZE)))


def training_batches(dataset: list[Batch], steps: int) -> list[Batch]:
    """The data set repeated epoch after epoch, cut at ``steps`` batches: one optimizer step per batch."""
    return [dataset[i % len(dataset)] for i in range(steps)]


class StudentTeacher(nn.Module):
    """A student MLP and its EMA teacher; the teacher never requires grad and runs under ``no_grad``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.student = nn.Sequential(
            nn.Linear(IN_FEATURES, HIDDEN),
            nn.GELU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.GELU(),
            nn.Linear(HIDDEN, OUT_FEATURES),
        )
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """The forward code: the part of a training step that runs under autocast."""
        with torch.no_grad():
            target = self.teacher(x)
        prediction = self.student(x)
        return F.mse_loss(prediction, y) + CONSISTENCY * F.mse_loss(prediction, target)

    @torch.no_grad()
    def update_teacher(self) -> None:
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            t.lerp_(s, 1.0 - EMA_DECAY)


def make_optimizer(name: str, model: StudentTeacher) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](model.student.parameters())


def make_scaler(precision: str) -> torch.amp.GradScaler:
    """A CPU gradient scaler, enabled for 16-mixed only (``GradScaler()`` without a device means CUDA)."""
    return torch.amp.GradScaler(
        "cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL, enabled=precision == "16-mixed"
    )


@torch.no_grad()
def final_loss(model: StudentTeacher, dataset: list[Batch]) -> float:
    """The trained student's MSE on the whole data set, in float32."""
    x, y = (torch.cat(t) for t in zip(*dataset))
    return F.mse_loss(model.student(x), y).item()


@dataclass
class Run:
    """One training run and what came out of it."""

    optimizer: str
    precision: str
    package: str  # "torch" for the recipe, else a key of PACKAGES
    mode: str  # "recipe", "manual" or "automatic"
    losses: list[float] = field(default_factory=list)
    params: dict[str, Tensor] = field(default_factory=dict)
    final_loss: float = math.nan
    error: str | None = None

    @property
    def label(self) -> str:
        return "PyTorch AMP recipe" if self.package == "torch" else f"{self.package}, {self.mode}"

    def finish(self, model: StudentTeacher, dataset: list[Batch]) -> Run:
        self.params = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.final_loss = final_loss(model, dataset)
        return self

    def max_abs_diff(self, reference: Run) -> float:
        diffs = [(p - reference.params[name]).abs().max() for name, p in self.params.items()]
        return torch.stack(diffs).max().item()  # NaN if any parameter went NaN

    def bitwise_equal(self, reference: Run) -> bool:
        return self.error is None and all(torch.equal(p, reference.params[n]) for n, p in self.params.items())


# ---------------------------------------------------------------------------------------------------------------------
# the reference: PyTorch's AMP recipe, written by hand
# ---------------------------------------------------------------------------------------------------------------------


def train_with_recipe(
    optimizer_name: str, precision: str, dataset: list[Batch], steps: int, on_step: Callable[[], None]
) -> Run:
    run = Run(optimizer_name, precision, package="torch", mode="recipe")
    model = StudentTeacher()
    optimizer = make_optimizer(optimizer_name, model)
    scaler = make_scaler(precision)  # when disabled: scale/unscale_/update do nothing, step() is optimizer.step()
    dtype = AMP_DTYPES[precision]
    for x, y in training_batches(dataset, steps):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model.loss(x, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.student.parameters(), CLIP_NORM)
        scaler.step(optimizer)  # skipped if the gradients hold an inf or a NaN
        scaler.update()
        model.update_teacher()
        run.losses.append(loss.item())
        on_step()
    return run.finish(model, dataset)


# ---------------------------------------------------------------------------------------------------------------------
# the same training through a Lightning Trainer: the fork or the stock package
# ---------------------------------------------------------------------------------------------------------------------


def load_lightning(package: str) -> SimpleNamespace:
    """``Trainer``, ``MixedPrecision`` and this demo's ``LightningModule`` class, from ``package``."""
    if package == "lightning":
        import lightning.pytorch as pl
        from lightning.pytorch.plugins.precision import MixedPrecision
    else:
        import stock_pytorch_lightning as pl
        from stock_pytorch_lightning.plugins.precision import MixedPrecision
    return SimpleNamespace(Trainer=pl.Trainer, MixedPrecision=MixedPrecision, Module=lightning_module_class(pl))


def lightning_module_class(pl) -> type:
    """The demo's ``LightningModule``, written once against the API of the package ``pl``."""

    class StudentTeacherModule(pl.LightningModule):
        def __init__(self, optimizer_name: str, automatic: bool, on_step: Callable[[], None]) -> None:
            super().__init__()
            self.model = StudentTeacher()
            self.optimizer_name = optimizer_name
            self.automatic_optimization = automatic
            self.losses: list[float] = []
            self._on_step = on_step

        def configure_optimizers(self):
            return make_optimizer(self.optimizer_name, self.model)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = self.model.loss(x, y)  # Lightning runs `training_step` under autocast
            self.losses.append(loss.item())
            if self.automatic_optimization:
                return loss  # Lightning does backward, clipping (`gradient_clip_val`) and the step

            optimizer = self.optimizers()
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            self.model.update_teacher()
            return None

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            if self.automatic_optimization:
                self.model.update_teacher()  # after the optimizer step, as in manual optimization
            self._on_step()

    return StudentTeacherModule


def train_with_lightning(
    package: str,
    optimizer_name: str,
    precision: str,
    mode: str,
    dataset: list[Batch],
    steps: int,
    on_step: Callable[[], None],
) -> Run:
    label = next(label for label, name in PACKAGES.items() if name == package)
    run = Run(optimizer_name, precision, package=label, mode=mode)
    api = load_lightning(package)
    trainer_args = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,  # one pass over the `steps` batches the recipe sees, one optimizer step each
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    if mode == "automatic":
        trainer_args.update(gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
    if precision == "16-mixed":
        # `precision="16-mixed"` alone would silently become bf16 on a CPU
        trainer_args["plugins"] = [api.MixedPrecision("16-mixed", "cpu", scaler=make_scaler(precision))]
    else:
        trainer_args["precision"] = "32-true" if precision == "32" else precision
    module = api.Module(optimizer_name, automatic=mode == "automatic", on_step=on_step)
    # `batch_size=None`: the loader hands out the prepared batches as they are, in order
    loader = torch.utils.data.DataLoader(training_batches(dataset, steps), batch_size=None, shuffle=False)
    api.Trainer(**trainer_args).fit(module, train_dataloaders=loader)
    run.losses = module.losses
    return run.finish(module.model, dataset)


# ---------------------------------------------------------------------------------------------------------------------
# the report: table and plot
# ---------------------------------------------------------------------------------------------------------------------


TABLE_ROW = "{:<10} {:<11} {:<16} {:>21} {:>8} {:>11}"


def print_table(recipes: dict[tuple[str, str], Run], runs: list[Run]) -> None:
    header = TABLE_ROW.format("optimizer", "precision", "run", "max |param - recipe|", "bitwise", "final loss")
    print(header)
    print("-" * len(header))
    for (optimizer, precision), reference in recipes.items():
        print(TABLE_ROW.format(optimizer, precision, "recipe (torch)", "", "", f"{reference.final_loss:.5f}"))
        for run in runs:
            if (run.optimizer, run.precision) != (optimizer, precision):
                continue
            name = f"{run.package} {run.mode}"
            if run.error is not None:
                print(f"{'':<10} {'':<11} {name:<16} failed: {run.error}")
                continue
            equal = "yes" if run.bitwise_equal(reference) else "NO"
            diff = run.max_abs_diff(reference)
            print(TABLE_ROW.format("", "", name, f"{diff:.3g}", equal, f"{run.final_loss:.5f}"))
    print("fork = this repository's `lightning`; stock = `stock_pytorch_lightning` 2.6.6, unpatched.")
    print("0 is the promise: every run of the fork equals the recipe bit for bit.")


def epoch_mean(values: list[float]) -> list[float]:
    """Trailing mean over one epoch's batches, which takes out the ripple of the batch order (a NaN ends the curve)."""
    means = []
    for i in range(len(values)):
        recent = values[max(0, i + 1 - DATASET_BATCHES) : i + 1]
        means.append(sum(recent) / len(recent))
    return means


def save_plot(recipes: dict[tuple[str, str], Run], runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # stock first, so that the fork's curves are drawn on top of the recipe they should hide under
    styles = {
        ("stock", "manual"): dict(color="tab:red", linestyle="-", linewidth=1.3),
        ("stock", "automatic"): dict(color="tab:orange", linestyle=(0, (1, 2)), linewidth=2.0),
        ("fork", "manual"): dict(color="tab:blue", linestyle="-", linewidth=1.5),
        ("fork", "automatic"): dict(color="tab:cyan", linestyle=(0, (5, 4)), linewidth=1.5),
    }
    optimizers = list(dict.fromkeys(optimizer for optimizer, _ in recipes))
    fig, axes = plt.subplots(
        len(optimizers), len(PRECISIONS), figsize=(5.2 * len(PRECISIONS), 3.6 * len(optimizers) + 0.9), squeeze=False
    )
    for row, optimizer in zip(axes, optimizers):
        for ax, precision in zip(row, PRECISIONS):
            reference = recipes[(optimizer, precision)]
            ax.plot(epoch_mean(reference.losses), color="0.8", linewidth=7, label=reference.label)
            panel = [r for r in runs if (r.optimizer, r.precision) == (optimizer, precision) and r.error is None]
            for run in sorted(panel, key=lambda r: list(styles).index((r.package, r.mode))):
                style = styles[(run.package, run.mode)]
                ax.plot(epoch_mean(run.losses), label=run.label, **style)
                first_nan = next((i for i, v in enumerate(run.losses) if not math.isfinite(v)), None)
                if first_nan is not None:
                    note = f"{run.label}: loss is NaN from step {first_nan}"
                    ax.text(0.97, 0.95, note, transform=ax.transAxes, ha="right", va="top", color=style["color"])
            ax.set_title(f"{optimizer}, precision={precision!r}", fontsize=10)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("step")
        row[0].set_ylabel(f"training loss (mean of {DATASET_BATCHES} steps)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle("Student + EMA teacher, clipped by norm: fork and stock Lightning 2.6.6 vs PyTorch's AMP recipe")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------


def import_lightning() -> ModuleType:
    """Import the fork (``lightning``) and the stock package, and refuse a ``lightning`` that is not the fork."""
    import lightning
    import stock_pytorch_lightning  # noqa: F401  (imported now, so that `quiet_lightning` reaches its loggers)

    if importlib.util.find_spec("lightning.fabric.plugins.precision.amp_recipe") is None:
        sys.exit(
            f"`lightning` at {Path(lightning.__file__).parent} is not the fork (it has no amp_recipe module)."
            " Install the fork from this checkout (`make install`) and run again."
        )
    return lightning


def quiet_lightning() -> None:
    """Silence the Trainer's banners, and warnings about this toy setup that have nothing to do with precision."""
    for name in ("lightning.pytorch", "lightning.fabric", "stock_pytorch_lightning", "stock_lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="the plot's path (artifacts/amp_demo.png)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps per run ({STEPS})")
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), action="append", help="only these optimizers")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock 2.6.6 runs (stock_pytorch_lightning)")
    args = parser.parse_args(argv)

    lightning = import_lightning()
    quiet_lightning()
    if importlib.util.find_spec("matplotlib") is None:
        sys.exit("The demo draws its plot with matplotlib: `pip install -r requirements/demo.txt`, then run it again.")
    torch.set_num_threads(1)  # matrices this small run fastest on one thread
    print(f"fork: lightning {lightning.__version__} from {Path(lightning.__file__).parent}; torch {torch.__version__}")

    optimizers = args.optimizer or list(OPTIMIZERS)
    packages = ["lightning"] if args.no_stock else list(PACKAGES.values())
    settings = [(optimizer, precision) for optimizer in optimizers for precision in PRECISIONS]
    lightning_jobs = [(o, p, package, mode) for o, p in settings for package in packages for mode in MODES]
    dataset = make_dataset()

    recipes: dict[tuple[str, str], Run] = {}
    runs: list[Run] = []
    start = time.perf_counter()
    total = (len(settings) + len(lightning_jobs)) * args.steps
    with tqdm(total=total, unit="step", desc="training", mininterval=0.25, dynamic_ncols=True) as bar:
        for optimizer, precision in settings:
            bar.set_postfix_str(f"{optimizer} {precision} recipe")
            recipes[(optimizer, precision)] = train_with_recipe(optimizer, precision, dataset, args.steps, bar.update)
        for optimizer, precision, package, mode in lightning_jobs:
            bar.set_postfix_str(f"{optimizer} {precision} {package} {mode}")
            steps_before = bar.n
            try:
                run = train_with_lightning(package, optimizer, precision, mode, dataset, args.steps, bar.update)
            except Exception as err:  # shown in the table; a failing fork run fails the demo below
                if package == "lightning":
                    tqdm.write(traceback.format_exc())
                label = next(label for label, name in PACKAGES.items() if name == package)
                run = Run(optimizer, precision, package=label, mode=mode, error=f"{type(err).__name__}: {err}")
                bar.update(args.steps - (bar.n - steps_before))
            runs.append(run)
    elapsed = time.perf_counter() - start

    print()
    print_table(recipes, runs)
    save_plot(recipes, runs, args.plot)
    print(f"\n{len(recipes) + len(runs)} runs of {args.steps} steps in {elapsed:.0f} s; loss curves: {args.plot}")

    failed = [r for r in runs if r.package == "fork" and not r.bitwise_equal(recipes[(r.optimizer, r.precision)])]
    if failed:
        names = ", ".join(f"{r.optimizer} {r.precision} {r.mode}" for r in failed)
        print(f"FAIL: the fork differs from PyTorch's AMP recipe in: {names}")
        return 1
    print("OK: every run of the fork is bitwise equal to PyTorch's AMP recipe.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
