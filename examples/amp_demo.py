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

    The runs and their comparison are the test suite's oracle (``tests/amp_oracle``): the recipe's side is a
    ``RecipeRun``, the Trainer's is ``fit_lightning``, and ``differences`` compares the two ``Run`` s.

What it prints
    For every run, the largest absolute difference of its final parameters (student and teacher) from the recipe's,
    whether the run is the recipe's bit for bit (the oracle's comparison: parameters, loss scale and skipped steps; 0
    and yes are the fork's promise), and the final loss (the trained student's MSE on the whole
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
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

# both sides and the comparison are the test suite's oracle (tests/amp_oracle), which is no installed package
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
from amp_oracle.run import RecipeRun, Run, differences  # noqa: E402
from amp_oracle.trainer import FORK, STOCK, fit_lightning, lightning_api  # noqa: E402
from amp_oracle.world import new_scaler, params_differ, uses_scaler  # noqa: E402

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
MODES = ("manual", "automatic")
#: label -> importable package: the fork, and the unpatched upstream release as the negative control
PACKAGES = {"fork": FORK, "stock": STOCK}
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
#: the gradient scaler (16-mixed only): a power of two (scaling is exact) that doubles every 20 iterations until float16
#: overflows
SCALER = {"init_scale": 2.0**12, "growth_interval": 20}

DEFAULT_PLOT = Path(__file__).resolve().parents[1] / "artifacts" / "amp_demo.png"  # artifacts/ of the checkout


# ---------------------------------------------------------------------------------------------------------------------
# what both sides share: data, network, optimizers (what a user writes once)
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


@torch.no_grad()
def final_loss(run: Run, dataset: list[Batch]) -> float:
    """The trained student's MSE on the whole data set, in float32."""
    model = StudentTeacher()
    model.load_state_dict(run.params)
    x, y = (torch.cat(t) for t in zip(*dataset))
    return F.mse_loss(model.student(x), y).item()


def max_abs_diff(run: Run, reference: Run) -> float:
    """The largest |parameter - recipe|: 0 where bitwise equal, NaN if a parameter went NaN."""
    return torch.tensor([0.0, *params_differ(run.params, reference.params).values()]).max().item()


@dataclass
class Row:
    """A line of the table: one run (the oracle's ``Run``, whose ``records`` are the losses) and what the demo shows."""

    optimizer: str
    precision: str
    package: str  # "torch" for the recipe, else a key of PACKAGES
    mode: str  # "recipe", "manual" or "automatic"
    run: Run | None = None  # None if it failed with `error`
    final_loss: float = math.nan
    error: str | None = None
    #: a Lightning run's largest |parameter - recipe| after each step (bf16-mixed only: the plot's distance panel)
    distances: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return "PyTorch AMP recipe" if self.package == "torch" else f"{self.package}, {self.mode}"

    @property
    def losses(self) -> list[float]:
        return self.run.records

    def differences(self, reference: Row) -> list[str]:
        """What differs from the recipe's run (the oracle's comparison: parameters bitwise, scales, skipped steps)."""
        return [self.error] if self.error is not None else differences(self.run, reference.run)


# ---------------------------------------------------------------------------------------------------------------------
# the reference: PyTorch's AMP recipe, written by hand
# ---------------------------------------------------------------------------------------------------------------------


OnStep = Callable[[StudentTeacher], None]  # called after every optimizer step with the trained model


def flat_params(model: StudentTeacher) -> Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train_with_recipe(optimizer_name: str, precision: str, dataset: list[Batch], steps: int, on_step: OnStep) -> Run:
    model = StudentTeacher()
    optimizer = OPTIMIZERS[optimizer_name](model.student.parameters())
    # a CPU scaler, disabled but for 16-mixed: then scale/unscale_/update do nothing, step() is optimizer.step()
    scaler = new_scaler(enabled=uses_scaler(precision), **SCALER)
    rc = RecipeRun(model, precision, scaler=scaler, data=training_batches(dataset, steps))
    for _, (x, y) in rc.batches():
        with rc.autocast():  # torch.autocast("cpu", dtype=torch.bfloat16 or torch.float16); none in 32
            loss = model.loss(x, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.student.parameters(), CLIP_NORM)
        scaler.step(optimizer)  # skipped if the gradients hold an inf or a NaN
        scaler.update()
        model.update_teacher()
        rc.records.append(loss.item())
        on_step(model)
    return rc.result()


# ---------------------------------------------------------------------------------------------------------------------
# the same training through a Lightning Trainer: the fork or the stock package
# ---------------------------------------------------------------------------------------------------------------------


def manual_step(self, batch, batch_idx):
    """The ``training_step`` of manual optimization, as the Lightning docs say: no autocast, no scaler."""
    loss = self.net.loss(*batch)  # Lightning runs `training_step` under autocast
    self.records.append(loss.item())
    optimizer = self.optimizers()
    self.manual_backward(loss)
    self.clip_gradients(optimizer, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    self.net.update_teacher()


def automatic_step(self, batch, batch_idx):
    loss = self.net.loss(*batch)
    self.records.append(loss.item())
    return loss  # Lightning does backward, clipping (`gradient_clip_val`) and the step


def train_with_lightning(
    package: str,
    optimizer_name: str,
    precision: str,
    mode: str,
    dataset: list[Batch],
    steps: int,
    on_step: OnStep,
) -> Run:
    automatic = mode == "automatic"

    class AfterStep(lightning_api(package).Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if automatic:
                module.net.update_teacher()  # after the optimizer step, as in manual optimization
            on_step(module.net)

    clip = {"gradient_clip_val": CLIP_NORM, "gradient_clip_algorithm": "norm"} if automatic else {}
    # `batch_size=None`: the loader hands out the prepared batches as they are, in order
    loader = torch.utils.data.DataLoader(training_batches(dataset, steps), batch_size=None, shuffle=False)
    return fit_lightning(
        package,
        precision,
        StudentTeacher(),
        lambda net: [OPTIMIZERS[optimizer_name](net.student.parameters())],
        automatic_step if automatic else manual_step,
        automatic=automatic,
        # as a `MixedPrecision` plugin: `precision="16-mixed"` alone would silently become bf16 on a CPU
        scaler=new_scaler(**SCALER) if uses_scaler(precision) else None,
        loader=loader,
        callbacks=(AfterStep(),),
        **clip,
    )


# ---------------------------------------------------------------------------------------------------------------------
# the report: table and plot
# ---------------------------------------------------------------------------------------------------------------------


TABLE_ROW = "{:<10} {:<11} {:<16} {:>21} {:>8} {:>11}"


def print_table(recipes: dict[tuple[str, str], Row], rows: list[Row]) -> None:
    header = TABLE_ROW.format("optimizer", "precision", "run", "max |param - recipe|", "bitwise", "final loss")
    print(header)
    print("-" * len(header))
    for (optimizer, precision), reference in recipes.items():
        print(TABLE_ROW.format(optimizer, precision, "recipe (torch)", "", "", f"{reference.final_loss:.5f}"))
        for row in rows:
            if (row.optimizer, row.precision) != (optimizer, precision):
                continue
            name = f"{row.package} {row.mode}"
            if row.error is not None:
                print(f"{'':<10} {'':<11} {name:<16} failed: {row.error}")
                continue
            equal = "NO" if row.differences(reference) else "yes"
            diff = max_abs_diff(row.run, reference.run)
            print(TABLE_ROW.format("", "", name, f"{diff:.3g}", equal, f"{row.final_loss:.5f}"))
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


def save_plot(recipes: dict[tuple[str, str], Row], runs: list[Row], path: Path) -> None:
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


def _progress(tty: bool, start: float, run: Row) -> None:
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
    packages = ["fork"] if args.no_stock else list(PACKAGES)
    settings = [(optimizer, precision) for optimizer in optimizers for precision in PRECISIONS]
    lightning_jobs = [(o, p, package, mode) for o, p in settings for package in packages for mode in MODES]
    dataset = make_dataset()

    recipes: dict[tuple[str, str], Row] = {}
    trajectories: dict[tuple[str, str], list[Tensor]] = {}  # the recipe's parameters after each step (bf16-mixed)
    runs: list[Row] = []
    start = time.perf_counter()
    total = (len(settings) + len(lightning_jobs)) * args.steps
    # a progress bar on a terminal; in a log (no TTY), one line per run instead of a bar's redraws
    tty = sys.stderr.isatty()
    with tqdm(total=total, unit="step", desc="training", mininterval=0.25, dynamic_ncols=True, disable=not tty) as bar:
        for optimizer, precision in settings:
            bar.set_postfix_str(f"{optimizer} {precision} recipe")
            trajectory = trajectories[(optimizer, precision)] = []
            on_step = _recorder(trajectory, bar) if precision == "bf16-mixed" else (lambda model: bar.update())
            run = train_with_recipe(optimizer, precision, dataset, args.steps, on_step)
            row = recipes[(optimizer, precision)] = Row(optimizer, precision, "torch", "recipe", run)
            row.final_loss = final_loss(run, dataset)
            _progress(tty, start, row)
        for optimizer, precision, package, mode in lightning_jobs:
            bar.set_postfix_str(f"{optimizer} {precision} {package} {mode}")
            steps_before = bar.n
            distances: list[float] = []
            on_step = _measurer(trajectories[(optimizer, precision)], distances, bar)
            row = Row(optimizer, precision, package, mode, distances=distances)
            try:
                run = train_with_lightning(PACKAGES[package], optimizer, precision, mode, dataset, args.steps, on_step)
                row.run, row.final_loss = run, final_loss(run, dataset)
            except Exception as err:  # shown in the table; a failing fork run fails the demo below
                if package == "fork":
                    tqdm.write(traceback.format_exc())
                row.error = f"{type(err).__name__}: {err}"
                bar.update(args.steps - (bar.n - steps_before))
            runs.append(row)
            _progress(tty, start, row)
    elapsed = time.perf_counter() - start

    print()
    print_table(recipes, runs)
    save_plot(recipes, runs, args.plot)
    print(f"\n{len(recipes) + len(runs)} runs of {args.steps} steps in {elapsed:.0f} s; loss curves: {args.plot}")

    failed: dict[str, list[str]] = {}  # what the oracle finds in each run of the fork that is not the recipe's
    for row in (r for r in runs if r.package == "fork"):
        if found := row.differences(recipes[(row.optimizer, row.precision)]):
            failed[f"{row.optimizer} {row.precision} {row.mode}"] = found
    if failed:
        print(f"FAIL: the fork differs from PyTorch's AMP recipe in: {', '.join(failed)}")
        for name, found in failed.items():
            print(f"  {name}:\n    " + "\n    ".join(found))
        return 1
    print("OK: every run of the fork is bitwise equal to PyTorch's AMP recipe.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
