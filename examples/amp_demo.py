"""Mixed precision in manual and automatic optimization: the fork against PyTorch's own AMP recipe.

What is trained
    A small regression MLP (the *student*) and an EMA copy of it (the *teacher*), evaluated under ``torch.no_grad()``
    and moved only as an exponential moving average of the student, as in the user report "Proper way to use mixed
    precision with manual optimization". The loss is the student's MSE to the targets plus a consistency MSE to the
    teacher's output. Gradients are clipped by norm. Three optimizers, one run each:

    * ``SGD`` with momentum, the plainest optimizer, whose step autocast leaves alone;
    * ``Adafactor`` (``torch.optim.Adafactor``), whose step multiplies its factored second moments with a matmul,
      which autocast lowers to bf16/fp16 when the step runs under it;
    * ``Muon``, a tiny Muon-style optimizer written below: momentum SGD whose update of each weight matrix is
      orthogonalised by five Newton-Schulz iterations, fifteen matrix products per matrix per step. PyTorch's recipe
      runs the optimizer step outside autocast, so these products run in float32.

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
    data set, in float32). The plot goes to ``artifacts/amp_demo.png``: manual optimization only (automatic equals the
    recipe in both packages), the loss curves where stock leaves the recipe (SGD and Adafactor under 16-mixed, Muon
    under bf16-mixed) and, for bf16-mixed, each run's largest distance from the recipe's parameters after each step.
    On a terminal a progress bar shows the training; in a log, one line per run.

What to expect (torch 2.13, CPU)
    Every run of the fork, and every automatic-optimization run of stock 2.6.6, equals the recipe bit for bit. Stock
    2.6.6 in manual optimization does not, because it runs the whole ``training_step`` under autocast and knows nothing
    of the scaler until ``opt.step()``:

    * ``self.clip_gradients`` clips gradients still multiplied by the loss scale, so under 16-mixed SGD's true gradients
      are clipped to 1/scale of the norm asked for and training stalls (Lightning issue #18089);
    * ``opt.step()`` runs under autocast, so the matrix products of an optimizer's step run in bf16: Muon's
      orthogonalisation and Adafactor's second moments drift from the recipe under bf16-mixed, and in float16
      Adafactor's underflows and writes NaN into the weights at the first step.

    The bf16 story, plainly: the user report ("manual optimization fails to converge with bf16") used an EMA teacher
    under ``no_grad``, ``lerp_`` after the step and clipping, with SGD/AdamW. With optimizers like those, whose step
    does no matrix product, stock 2.6.6 is bitwise equal to the recipe in bf16-mixed here too (the SGD rows), so that
    code was fine and the report is not reproduced on this torch. What the fork changes under bf16 is what runs
    outside the forward: ``manual_backward``, clipping and ``opt.step()`` run with autocast off, as in the recipe. That
    matters for optimizers whose step multiplies matrices (Muon, Shampoo, Adafactor: the Muon and Adafactor rows), for
    custom ``autograd.Function`` backwards and for fp32 islands; and fused optimizers can be clipped.

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
    "Muon": lambda params: Muon(params, lr=0.02, momentum=0.9),
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


def newton_schulz(g: Tensor, steps: int) -> Tensor:
    """The nearest semi-orthogonal matrix to ``g``, approximately: Muon's quintic Newton-Schulz iteration."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    for _ in range(steps):
        s = x @ x.T  # under autocast: a bf16 (or fp16) matmul
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """Momentum SGD whose update of each weight matrix is orthogonalised (Muon-style); vectors get plain momentum."""

    def __init__(self, params, lr: float, momentum: float, ns_steps: int = 5) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum, "ns_steps": ns_steps})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                update = newton_schulz(buf, group["ns_steps"]) if p.ndim == 2 else buf
                p.add_(update.to(p.dtype), alpha=-group["lr"])
        return loss


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
    #: the recipe's parameters after each step (bf16-mixed only: the plot's distance panel)
    trajectory: list[Tensor] = field(default_factory=list)
    #: a Lightning run's largest |parameter - recipe| after each step (bf16-mixed only)
    distances: list[float] = field(default_factory=list)

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


OnStep = Callable[[StudentTeacher], None]  # called after every optimizer step with the trained model


def flat_params(model: StudentTeacher) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train_with_recipe(optimizer_name: str, precision: str, dataset: list[Batch], steps: int, on_step: OnStep) -> Run:
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
        on_step(model)
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
        def __init__(self, optimizer_name: str, automatic: bool, on_step: OnStep) -> None:
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
            self._on_step(self.model)

    return StudentTeacherModule


def train_with_lightning(
    package: str,
    optimizer_name: str,
    precision: str,
    mode: str,
    dataset: list[Batch],
    steps: int,
    on_step: OnStep,
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
    print(
        "bf16-mixed: stock equals the recipe with SGD (a step without matrix products runs the same under autocast);"
        "\nwith Muon and Adafactor, whose steps multiply matrices, stock's manual optimization runs those products in"
        "\nbf16 (its opt.step() runs under autocast) and leaves the recipe. The fork runs backward, clipping and the"
        "\nstep with autocast off, as PyTorch's recipe does."
    )


def epoch_mean(values: list[float]) -> list[float]:
    """Trailing mean over one epoch's batches, which takes out the ripple of the batch order (a NaN ends the curve)."""
    means = []
    for i in range(len(values)):
        recent = values[max(0, i + 1 - DATASET_BATCHES) : i + 1]
        means.append(sum(recent) / len(recent))
    return means


#: the loss panels of the plot: where stock manual optimization leaves the recipe (the other settings: the table)
LOSS_PANELS = (("16-mixed", "SGD"), ("16-mixed", "Adafactor"), ("bf16-mixed", "Muon"))
STYLES = {
    "recipe": dict(color="0.75", linewidth=7),
    "stock": dict(color="tab:red", linestyle="-", linewidth=1.4),
    "fork": dict(color="tab:blue", linestyle=(0, (5, 3)), linewidth=1.6),
}
CAPTION = (
    "Manual optimization, written as the Lightning docs say (manual_backward, clip_gradients, opt.step()). Grey: "
    "PyTorch's AMP recipe. Blue: the fork, bitwise equal to the recipe in every run, so it hides the grey line. Red: "
    "stock Lightning 2.6.6. Under 16-mixed stock clips gradients still multiplied by the loss scale (SGD stalls) and "
    "runs the optimizer step under autocast (Adafactor writes NaN). Under bf16-mixed it runs the step's matrix "
    "products in bf16 (Muon, Adafactor: the loss barely shows it, the distance from the recipe does); with SGD it "
    "equals the recipe. Automatic "
    "optimization equals the recipe in both packages (see the printed table)."
)


def save_plot(recipes: dict[tuple[str, str], Run], runs: list[Run], path: Path) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    manual = [r for r in runs if r.mode == "manual" and r.error is None]
    panels = [(p, o) for p, o in LOSS_PANELS if (o, p) in recipes]
    bf16 = [r for r in manual if r.precision == "bf16-mixed" and r.distances]
    n = len(panels) + (1 if bf16 else 0)
    columns = 2 if n > 1 else 1
    rows = math.ceil(n / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 3.7 * rows + 1.4), squeeze=False)
    flat_axes = list(axes.flat)
    for ax, (precision, optimizer) in zip(flat_axes, panels):
        reference = recipes[(optimizer, precision)]
        ax.plot(epoch_mean(reference.losses), label="PyTorch AMP recipe", **STYLES["recipe"])
        # stock first, so that the fork is drawn on top of the recipe it should hide
        for run in sorted((r for r in manual if (r.optimizer, r.precision) == (optimizer, precision)),
                          key=lambda r: r.package != "stock"):  # fmt: skip
            ax.plot(epoch_mean(run.losses), label=f"{run.package}, manual", **STYLES[run.package])
            first_nan = next((i for i, v in enumerate(run.losses) if not math.isfinite(v)), None)
            if first_nan is not None:
                note = f"{run.package}: loss is NaN from step {first_nan}"
                ax.text(0.97, 0.95, note, transform=ax.transAxes, ha="right", va="top", color=STYLES[run.package]["color"])
        ax.set_title(f"{optimizer}, {precision}: training loss", fontsize=10)
        ax.set_yscale("log")
        ax.set_ylabel(f"mean of {DATASET_BATCHES} steps")
    if bf16:
        ax = flat_axes[len(panels)]
        shown = []
        for run in (r for r in bf16 if r.package == "stock"):
            if any(d > 0 for d in run.distances):
                ax.plot(run.distances, label=f"stock, {run.optimizer}", linewidth=1.4,
                        color={"Muon": "tab:red", "Adafactor": "tab:purple"}.get(run.optimizer, "tab:brown"))
                shown.append(run.optimizer)
        equal = sorted({f"{r.package} {r.optimizer}" for r in bf16 if not any(d > 0 for d in r.distances)})
        ax.text(0.03, 0.03, "0 at every step (not drawn on a log scale):\n" + textwrap.fill(", ".join(equal), 60),
                transform=ax.transAxes, fontsize=8, va="bottom", color="tab:blue")
        ax.set_title("bf16-mixed: max |parameter - recipe| after each step", fontsize=10)
        if shown:
            ax.set_yscale("log")
            ax.legend(fontsize=8, loc="upper left", frameon=False)
    for ax in flat_axes[:n]:
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("step")
    for ax in flat_axes[n:]:
        ax.set_visible(False)
    handles, labels = flat_axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle("Student + EMA teacher, clipped by norm: where stock Lightning 2.6.6 leaves PyTorch's AMP recipe",
                 x=0.01, ha="left", fontsize=11)
    fig.text(0.01, 0.01, textwrap.fill(CAPTION, 150), fontsize=8.5, va="bottom")
    fig.tight_layout(rect=(0, 0.11, 1, 0.95))
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


def _recorder(trajectory: list[Tensor], bar: tqdm) -> OnStep:
    def on_step(model: StudentTeacher) -> None:
        trajectory.append(flat_params(model))
        bar.update()

    return on_step


def _measurer(reference: list[Tensor], distances: list[float], bar: tqdm) -> OnStep:
    """Each step's largest |parameter - recipe| (where the recipe's trajectory was recorded)."""

    def on_step(model: StudentTeacher) -> None:
        if len(distances) < len(reference):
            distances.append((flat_params(model) - reference[len(distances)]).abs().max().item())
        bar.update()

    return on_step


def _progress(tty: bool, start: float, run: Run) -> None:
    if not tty:
        print(f"[{time.perf_counter() - start:5.0f} s] {run.optimizer} {run.precision} {run.label}", flush=True)


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
    # a progress bar on a terminal; in a log (no TTY), one line per run instead of a bar's redraws
    tty = sys.stderr.isatty()
    with tqdm(total=total, unit="step", desc="training", mininterval=0.25, dynamic_ncols=True, disable=not tty) as bar:
        for optimizer, precision in settings:
            bar.set_postfix_str(f"{optimizer} {precision} recipe")
            trajectory: list[Tensor] = []
            on_step = _recorder(trajectory, bar) if precision == "bf16-mixed" else (lambda model: bar.update())
            recipes[(optimizer, precision)] = run = train_with_recipe(optimizer, precision, dataset, args.steps, on_step)
            run.trajectory = trajectory
            _progress(tty, start, run)
        for optimizer, precision, package, mode in lightning_jobs:
            bar.set_postfix_str(f"{optimizer} {precision} {package} {mode}")
            steps_before = bar.n
            distances: list[float] = []
            on_step = _measurer(recipes[(optimizer, precision)].trajectory, distances, bar)
            try:
                run = train_with_lightning(package, optimizer, precision, mode, dataset, args.steps, on_step)
            except Exception as err:  # shown in the table; a failing fork run fails the demo below
                if package == "lightning":
                    tqdm.write(traceback.format_exc())
                label = next(label for label, name in PACKAGES.items() if name == package)
                run = Run(optimizer, precision, package=label, mode=mode, error=f"{type(err).__name__}: {err}")
                bar.update(args.steps - (bar.n - steps_before))
            run.distances = distances
            runs.append(run)
            _progress(tty, start, run)
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
