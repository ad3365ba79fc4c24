"""Shared machinery for the mixed-precision equivalence tests.

Every test built on this module trains the same tiny model on the same data twice:

* through the Lightning ``Trainer`` (see :func:`fit_lightning`), and
* through a hand-written loop that follows PyTorch's own AMP recipe ("Automatic Mixed Precision examples" in the torch
  docs; see :class:`RecipeRun`): autocast around the forward pass and the loss only, ``scaler.scale(loss).backward()``
  outside autocast, ``scaler.unscale_(opt)`` before anything reads the gradients, ``scaler.step(opt)`` for every
  optimizer and one ``scaler.update()`` per iteration, after the last step.

and compares the outcome (:func:`assert_same_run`): every parameter bitwise, the ``GradScaler``'s scale after every
batch and, for every batch, whether the trainable parameters changed at all (a skipped step leaves them untouched).

What the two sides share is only what a user would write once for both: the network (including its forward code), the
data, the optimizer construction. The orchestration (backward, unscaling, clipping, stepping, scale updates) is
written separately on each side, so that a Lightning bug cannot cancel out against the reference.

The Lightning side is built through :func:`lightning_api`, parametrized by the package, so that the very same cells
can run against the fork (``lightning``) and against the unpatched ``stock_pytorch_lightning`` 2.6.6 (the negative
control).

Design choices that make bugs unable to hide:

* loss scales are powers of two (scaling and unscaling is then exact in fp32, so results are bitwise comparable) and
  ``growth_interval=1`` (the scale changes after every update, so a missing, extra or misplaced ``update()`` shows in
  the trajectory);
* an ``inf`` is injected into the loss of batch :data:`INF_BATCH` under 16-mixed, so that a skipped step and a back-off
  happen at a known place;
* clip values are small enough that clipping really happens (the recipe side asserts it).
"""

import contextlib
import copy
import functools
import importlib
import math
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version
from tests_fabric.helpers.amp_world import (
    CLIP_NORM,
    CLIP_VALUE,
    HIDDEN,
    IN_FEATURES,
    INIT_SCALE,
    OUT_FEATURES,
    assert_params_bitwise,
    autocast_dtype,
    changed_since,
    inf_batch,
    inject_inf,
    mlp,
    mlp_loss,
    named_params,
    new_scaler,
    optimizer_params,
    snapshot,
    uses_scaler,
)
from tests_fabric.helpers.amp_world import make_batches as world_batches
from torch import nn

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
MIXED_PRECISIONS = ("bf16-mixed", "16-mixed")
OPTIMIZERS = ("SGD", "AdamW")

#: the batches of a Trainer run (one epoch): two more than the Fabric suite's :data:`N_BATCHES`, for the cases with a
#: second inf (:data:`LATE_INF_BATCH`) and an accumulation over pairs of batches
TRAINER_BATCHES = 8
#: a second batch with an inf, for cases with several losses per batch: there the inf goes into a later loss
LATE_INF_BATCH = 5

#: Whether the recipe's autocast regions cache weight casts. PyTorch's default is on, and the fork turns the cache on
#: where torch makes it safe (torch >= 2.11, pytorch#165068), off below. The setting is not numerically neutral: a
#: weight used twice in one autocast region (the discriminator applied to real and fake samples) is cast once with the
#: cache and its two low-precision gradients are summed before the cast back to fp32, but cast twice without it and
#: the two gradients are summed in fp32. The recipe follows the fork's policy so that both sides round alike.
AUTOCAST_CACHE = Version(torch.__version__).release >= (2, 11)


def late_inf_batch(precision: str) -> Optional[int]:
    return LATE_INF_BATCH if uses_scaler(precision) else None


#: what the Trainer says about these tiny CPU runs (no workers, few batches, non-resumable loaders, checkpoints
#: loaded with ``weights_only=False``, a CUDA scaler on CPU...), none of it what the tests are about
TRAINER_CHATTER = (
    r".*(num_workers|does not have many workers|log_every_n_steps|dataloader is not resumable"
    r"|callbacks used to create the checkpoint|`weights_only` was not set|CUDA is not available"
    r"|`training_step` returned `None`|Found .* module\(s\) in eval mode).*"
)


@contextlib.contextmanager
def quiet_trainer():
    """Silence :data:`TRAINER_CHATTER` (use it in an autouse fixture)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRAINER_CHATTER)
        yield


# --------------------------------------------------------------------------------------------------------------------
# data, networks, optimizers (shared by both sides)
# --------------------------------------------------------------------------------------------------------------------


def make_batches(n_batches: int = TRAINER_BATCHES, **kwargs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The shared batches (:func:`~tests_fabric.helpers.amp_world.make_batches`), a Trainer run of them by default;
    ``y`` doubles as the generator's noise in the GAN."""
    return world_batches(n_batches, **kwargs)


class Positions:
    """A loader that yields only each batch's position in the epoch (``tensor([i])``); the data come from a function
    of ``batch_idx``, so that a run resumed mid-epoch (Lightning restarts a non-resumable loader while ``batch_idx``
    continues) trains on the batches the uninterrupted run trains on."""

    def __init__(self, n: int = TRAINER_BATCHES) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.tensor([i]) for i in range(self.n))

    def __len__(self) -> int:
        return self.n


class Batches:
    """The fixed batches as a plain iterable (a ``list`` would be taken by the Trainer as a list of dataloaders)."""

    def __iter__(self):
        return iter(make_batches())

    def __len__(self) -> int:
        return TRAINER_BATCHES


class GAN(nn.Module):
    """A generator (noise [4] -> sample [8]) and a discriminator (sample [8] -> logit [1])."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gen = nn.Sequential(nn.Linear(OUT_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN_FEATURES))
        self.disc = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


class TeacherStudent(nn.Module):
    """A student and its EMA teacher; the teacher's parameters never require grad."""

    EMA_WEIGHT = 0.25

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.student = mlp(seed)
        self.teacher = mlp(seed + 1)
        self.teacher.requires_grad_(False)

    @torch.no_grad()
    def update_teacher(self) -> None:
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            t.lerp_(s, self.EMA_WEIGHT)


class NestedAutocastNet(nn.Module):
    """A network whose forward opens its own autocast regions inside the surrounding one.

    * ``same``: an autocast region with the surrounding dtype (as in the seed report's ``training_step``);
    * ``island``: an ``enabled=False`` region computing a sub-block in fp32;
    * ``other``: a region with a different dtype, for a sub-block that uses only its own weights.

    """

    def __init__(self, outer: torch.dtype, other: torch.dtype, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.outer, self.other = outer, other
        self.inp = nn.Linear(IN_FEATURES, HIDDEN)
        self.same = nn.Linear(HIDDEN, HIDDEN)
        self.island = nn.Linear(HIDDEN, HIDDEN)
        self.foreign = nn.Linear(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, OUT_FEATURES)
        self.seen_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        with torch.autocast("cpu", dtype=self.outer):
            h = F.relu(self.same(h))
        with torch.autocast("cpu", enabled=False):
            h = F.relu(self.island(h.float()))
            island_dtype = h.dtype
        with torch.autocast("cpu", dtype=self.other):
            h = F.relu(self.foreign(h))
            foreign_dtype = h.dtype
        self.seen_dtypes = [island_dtype, foreign_dtype]
        return self.out(h)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "SGD":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-2)
    raise ValueError(name)


def trainable(net: nn.Module) -> list[torch.Tensor]:
    return [p for p in net.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------------------------------
# results and their comparison
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    params: dict[str, torch.Tensor]
    #: the GradScaler's scale after every batch (``None`` without a scaler)
    scales: Optional[list[float]]
    #: for every batch: did any trainable parameter change (``False``: every step of that batch was skipped)
    changed: list[bool]
    #: anything the run chose to record (autocast states, checks made inside ``training_step``)
    records: list[Any] = field(default_factory=list)


def assert_same_run(actual: RunResult, expected: RunResult) -> None:
    """Lightning's run (``actual``) equals the recipe's (``expected``): trajectory, skipped steps, params bitwise."""
    assert actual.scales == expected.scales, f"scale trajectory: {actual.scales} != recipe {expected.scales}"
    assert actual.changed == expected.changed, f"changed per batch: {actual.changed} != recipe {expected.changed}"
    assert_params_bitwise(actual.params, expected.params)


def assert_recipe_is_sharp(result: RunResult, precision: str) -> None:
    """Sanity of a recipe run: it trained, and under 16-mixed the injected inf backed the scale off."""
    assert any(result.changed), "the recipe never updated the parameters"
    if uses_scaler(precision):
        trajectory = [INIT_SCALE] + result.scales
        ratios = {b / a for a, b in zip(trajectory, trajectory[1:])}
        assert min(ratios) < 1, f"no back-off in {result.scales}"
        assert max(ratios) > 1, f"no growth in {result.scales}"
        assert all(math.log2(s).is_integer() for s in result.scales)
    else:
        assert result.scales is None
    for value in result.params.values():
        assert torch.isfinite(value).all()


# --------------------------------------------------------------------------------------------------------------------
# the recipe side
# --------------------------------------------------------------------------------------------------------------------


class RecipeRun:
    """State of one hand-written PyTorch AMP loop: the autocast settings, the scaler, the per-batch records.

    Without a scaler (32, bf16-mixed) ``scaler`` is a disabled ``GradScaler``: ``scale`` returns the loss unchanged,
    ``unscale_`` and ``update`` do nothing and ``step`` calls ``optimizer.step()``, exactly as the torch docs suggest
    for switching AMP off (``enabled=use_amp``).

    """

    def __init__(self, net: nn.Module, precision: str, autocast_cache: bool = AUTOCAST_CACHE) -> None:
        self.net = net
        self.precision = precision
        self.dtype = autocast_dtype(precision)
        #: the fork's default: on where torch makes it safe, in automatic optimization; off in manual optimization. A
        #: weight used twice is cast once with it, twice without, and its two gradients are summed in low precision
        #: with it, in fp32 without: the recipe must match the mode it is compared with, bit for bit.
        self.autocast_cache = autocast_cache
        self.scaler = new_scaler(enabled=uses_scaler(precision))
        self.inf_at = inf_batch(precision)
        self.late_inf_at = late_inf_batch(precision)
        self.scales: list[float] = []
        self.changed: list[bool] = []
        self.records: list[Any] = []
        #: the batches :meth:`batches` yields: ``range(start, stop)`` (a resumed run starts later, a short one stops
        #: earlier)
        self.start, self.stop = 0, TRAINER_BATCHES

    def save_point(self, batch_idx: int, optimizers: list) -> None:
        """Where a recipe would save a checkpoint mid-iteration (between two optimizers' steps); nothing by default."""

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.dtype, cache_enabled=self.autocast_cache)

    def inject(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return inject_inf(loss, batch_idx, self.inf_at)

    def inject_late(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return inject_inf(loss, batch_idx, self.late_inf_at)

    def batches(self):
        """Yield ``(batch_idx, (x, y))``, recording the scale and whether the parameters changed after each batch."""
        params = trainable(self.net)
        batches = make_batches()
        for batch_idx in range(self.start, self.stop):
            batch = batches[batch_idx]
            before = snapshot(params)
            yield batch_idx, batch
            self.changed.append(changed_since(before, params))
            if uses_scaler(self.precision):
                self.scales.append(self.scaler.get_scale())

    def result(self) -> RunResult:
        return RunResult(
            params=named_params(self.net),
            scales=self.scales if uses_scaler(self.precision) else None,
            changed=self.changed,
            records=self.records,
        )


# --------------------------------------------------------------------------------------------------------------------
# the Lightning side
# --------------------------------------------------------------------------------------------------------------------

#: the fork under test
FORK = "lightning"
#: the unpatched Lightning 2.6.6, the negative control: the import name of its ``lightning.pytorch`` counterpart. Every
#: test of this package reaches stock through this constant, so a rename of the stock package is a one-line change.
STOCK = "stock_pytorch_lightning"
PACKAGES = (FORK, STOCK)


#: why a negative control skips where the stock copy is absent (upstream's own CI, which tests one Lightning)
NO_STOCK = f"the negative control needs the unpatched Lightning 2.6.6 as `{STOCK}` (the fork's `make setup`)"


def _pytorch_package(package: str) -> str:
    if package == FORK:
        return "lightning.pytorch"
    if package == STOCK:
        pytest.importorskip(STOCK, reason=NO_STOCK)
        return STOCK
    raise ValueError(package)


def stock_is_unpatched() -> bool:
    """Whether the negative control is there: the unpatched 2.6.6 under :data:`STOCK`."""
    try:
        stock = importlib.import_module(STOCK)
    except ImportError:
        return False
    return stock.__version__ == "2.6.6"


@functools.cache
def lightning_api(package: str) -> SimpleNamespace:
    """The Lightning classes from ``package``: the fork (:data:`FORK`) or the unpatched copy (:data:`STOCK`)."""
    name = _pytorch_package(package)
    pl = importlib.import_module(name)
    MixedPrecision = importlib.import_module(f"{name}.plugins.precision").MixedPrecision

    class RecipeModule(pl.LightningModule):
        """Holds ``net``; ``configure(net)`` builds the optimizers, ``step(module, batch, batch_idx)`` is the
        ``training_step``; ``inf_at`` / ``late_inf_at`` the batches that must inject an inf into their first / a later
        loss; ``amp_dtype`` the autocast dtype the Trainer
        should use (``None``: none); ``records`` collects what the step saw."""

        def __init__(
            self, net: nn.Module, configure: Callable, step: Callable, automatic: bool, precision: str
        ) -> None:
            super().__init__()
            self.net = net
            self._configure = configure
            self._step = step
            self.automatic_optimization = automatic
            self.inf_at = inf_batch(precision)
            self.late_inf_at = late_inf_batch(precision)
            self.amp_dtype = autocast_dtype(precision)
            self.records: list[Any] = []

        def configure_optimizers(self):
            opts = self._configure(self.net)
            return opts[0] if len(opts) == 1 else opts

        def training_step(self, batch, batch_idx):
            return self._step(self, batch, batch_idx)

    class Recorder(pl.Callback):
        """Records the scaler's scale after every batch and whether the trainable parameters changed."""

        def __init__(self) -> None:
            self.scales: list[Optional[float]] = []
            self.changed: list[bool] = []
            self._before: list[torch.Tensor] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._before = snapshot(trainable(pl_module))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.changed.append(changed_since(self._before, trainable(pl_module)))
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.scales.append(None if scaler is None else scaler.get_scale())

    return SimpleNamespace(
        fork=package == FORK,
        pl=pl,
        Trainer=pl.Trainer,
        LightningModule=pl.LightningModule,
        Callback=pl.Callback,
        MixedPrecision=MixedPrecision,
        RecipeModule=RecipeModule,
        Recorder=Recorder,
    )


def make_trainer(
    api: SimpleNamespace,
    precision: str,
    scaler=None,
    callbacks=(),
    watch_misuse: bool = False,
    plugin: Any = None,
    **kwargs: Any,
):
    """A CPU trainer for one epoch over the fixed batches. 16-mixed goes through an explicit ``MixedPrecision`` with a
    CPU ``GradScaler`` of the test's own settings (initial scale, ``growth_interval``); with ``scaler="lightning"``
    through the ``precision`` flag, so that Lightning creates the scaler (on a CPU from torch 2.3). ``watch_misuse``
    switches the fork's opt-in misuse watch on (stock has none: it is not passed there); ``plugin`` reuses a
    ``MixedPrecision`` another Trainer has."""
    kwargs = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "callbacks": list(callbacks),
        **kwargs,
    }
    watch = {"watch_misuse": True} if watch_misuse and api.fork else {}
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    elif precision == "16-mixed" and (scaler != "lightning" or watch):
        scaler = new_scaler() if scaler is None else None if scaler == "lightning" else scaler
        kwargs["plugins"] = [api.MixedPrecision("16-mixed", "cpu", scaler=scaler, **watch)]
    else:
        assert scaler in (None, "lightning")
        kwargs["precision"] = "32-true" if precision == "32" else precision
    return api.Trainer(**kwargs)


def fit_lightning(
    package: str,
    precision: str,
    net: nn.Module,
    configure: Callable[[nn.Module], list[torch.optim.Optimizer]],
    step: Callable,
    automatic: bool = False,
    module_cls: Optional[type] = None,
    scaler=None,
    **trainer_kwargs: Any,
) -> RunResult:
    """Train ``net`` for one epoch through the Trainer of ``package`` and return what happened."""
    api = lightning_api(package)
    module_cls = module_cls or api.RecipeModule
    module = module_cls(net, configure, step, automatic, precision)
    recorder = api.Recorder()
    trainer = make_trainer(api, precision, scaler=scaler, callbacks=[recorder], **trainer_kwargs)
    trainer.fit(module, train_dataloaders=Batches())
    assert len(recorder.changed) == TRAINER_BATCHES, "the trainer did not run every batch"
    return RunResult(
        params=named_params(module.net),
        scales=None if all(s is None for s in recorder.scales) else recorder.scales,
        changed=recorder.changed,
        records=module.records,
    )


def fresh_autocast_forward(net: nn.Sequential, x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``mlp``'s forward from detached copies of its current weights under a new autocast region: copies do not
    require grad, so autocast never serves them from its weight cache."""
    w0, b0, w1, b1 = (p.detach().clone() for p in (net[0].weight, net[0].bias, net[2].weight, net[2].bias))
    ctx = contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)
    with ctx:
        return F.linear(F.relu(F.linear(x, w0, b0)), w1, b1)


def clone_net(net: nn.Module) -> nn.Module:
    return copy.deepcopy(net)


# --------------------------------------------------------------------------------------------------------------------
# cases shared by the test modules: optimizers, recipe loops and the matching ``training_step`` bodies
# --------------------------------------------------------------------------------------------------------------------
# A recipe is ``(RecipeRun, optimizers) -> None``; a ``training_step`` body is ``(module, batch, batch_idx)``, where the
# module has ``net``, ``inf_at``, ``late_inf_at`` and ``records`` (as ``RecipeModule`` has).


def one_optimizer(net: nn.Module, name: str) -> list[torch.optim.Optimizer]:
    return [make_optimizer(name, trainable(net))]


def two_optimizers(net: nn.Sequential, name: str) -> list[torch.optim.Optimizer]:
    # first layer and last layer, fed by one loss and one backward
    return [make_optimizer(name, net[0].parameters()), make_optimizer(name, net[2].parameters())]


def gan_optimizers(net: GAN, name: str) -> list[torch.optim.Optimizer]:
    return [make_optimizer(name, net.disc.parameters()), make_optimizer(name, net.gen.parameters())]


def clip_reference(rc: RecipeRun, opt: torch.optim.Optimizer, algorithm: str) -> None:
    """Clip like ``clip_gradients`` does: over the optimizer's parameters in ``param_groups`` order; remember the
    pre-clip size so that the cell can prove that clipping really happened."""
    params = optimizer_params(opt)
    if algorithm == "norm":
        rc.records.append(("norm", torch.nn.utils.clip_grad_norm_(params, CLIP_NORM).item()))
    else:
        rc.records.append(("value", max(p.grad.abs().max().item() for p in params)))
        torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)


def recipe_clip(*algorithms: str) -> Callable:
    """The plain single-optimizer recipe, unscaling once and clipping with each of ``algorithms`` (none: no unscale
    before the step, which unscales by itself)."""

    def recipe(rc: RecipeRun, opts: list) -> None:
        (opt,) = opts
        for i, (x, y) in rc.batches():
            opt.zero_grad()
            with rc.autocast():
                loss = rc.inject(mlp_loss(rc.net, x, y), i)
            rc.scaler.scale(loss).backward()
            if algorithms:
                rc.scaler.unscale_(opt)
            for algorithm in algorithms:
                clip_reference(rc, opt, algorithm)
            rc.scaler.step(opt)
            rc.scaler.update()

    return recipe


recipe_plain = recipe_clip()


def recipe_accumulate(rc: RecipeRun, opts: list) -> None:
    # a step every 2nd batch on the sum of two halved losses; no update() in batches without a step
    (opt,) = opts
    for i, (x, y) in rc.batches():
        if i % 2 == 0:
            opt.zero_grad()
        with rc.autocast():
            loss = rc.inject(mlp_loss(rc.net, x, y), i) / 2
        rc.scaler.scale(loss).backward()
        if i % 2 == 1:
            rc.scaler.step(opt)
            rc.scaler.update()


def recipe_two_optimizers(rc: RecipeRun, opts: list) -> None:
    # one backward feeds both optimizers: both are unscaled with the scale that scaled the loss, one update at the end
    opt_a, opt_b = opts
    for i, (x, y) in rc.batches():
        opt_a.zero_grad()
        opt_b.zero_grad()
        with rc.autocast():
            loss = rc.inject(mlp_loss(rc.net, x, y), i)
        rc.scaler.scale(loss).backward()
        rc.scaler.step(opt_a)
        rc.save_point(i, opts)
        rc.scaler.step(opt_b)
        rc.scaler.update()


def chunks(x: torch.Tensor, y: torch.Tensor, n: int):
    size = len(x) // n
    return [(x[k * size : (k + 1) * size], y[k * size : (k + 1) * size]) for k in range(n)]


def recipe_multi_step(rc: RecipeRun, opts: list, inner_steps: int = 2) -> None:
    """``inner_steps`` steps of one optimizer per batch (on chunks of the batch), each followed by its update: torch's
    ``GradScaler`` needs an ``update()`` between two steps of one optimizer, and with one optimizer each step is the
    last of its step cycle. Under 16-mixed an inf goes into both inner steps of one batch (the scale backs off twice
    in it) and into the second step of another (the first step's growth is undone at once)."""
    (opt,) = opts
    for i, (x, y) in rc.batches():
        for k, (xk, yk) in enumerate(chunks(x, y, inner_steps)):
            opt.zero_grad()
            with rc.autocast():
                loss = mlp_loss(rc.net, xk, yk)
                loss = rc.inject(loss, i) if k == 0 else rc.inject_late(rc.inject(loss, i), i)
            rc.scaler.scale(loss).backward()
            rc.scaler.step(opt)
            rc.scaler.update()


def recipe_gan(rc: RecipeRun, opts: list) -> None:
    # D step, then G's loss through the updated D, G step; the update D's step owes comes before G's backward (nothing
    # else waits for it), the one G's step owes at the batch's end. Under 16-mixed an inf goes into D's loss of one
    # batch and into G's loss of another: either backs the scale off.
    opt_d, opt_g = opts
    net = rc.net
    for i, (real, noise) in rc.batches():
        opt_d.zero_grad()
        with rc.autocast():
            fake = net.gen(noise)
            loss_d = F.mse_loss(net.disc(real), torch.ones(4, 1)) + F.mse_loss(
                net.disc(fake.detach()), torch.zeros(4, 1)
            )
            loss_d = rc.inject(loss_d, i)
        rc.scaler.scale(loss_d).backward()
        rc.scaler.step(opt_d)
        rc.save_point(i, opts)
        rc.scaler.update()
        opt_d.zero_grad()
        with rc.autocast():
            loss_g = rc.inject_late(F.mse_loss(net.disc(fake), torch.ones(4, 1)), i)
        opt_g.zero_grad()
        rc.scaler.scale(loss_g).backward()
        rc.scaler.step(opt_g)
        rc.scaler.update()


def manual_plain(self, batch, batch_idx):
    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
    self.manual_backward(loss)
    opt.step()


def manual_clip(algorithm: str) -> Callable:
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
        self.manual_backward(loss)
        clip_val = CLIP_NORM if algorithm == "norm" else CLIP_VALUE
        norm = self.clip_gradients(opt, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
        if algorithm == "norm":  # what it returns, as `clip_reference` records torch's (stock returns None)
            self.records.append(("norm", None if norm is None else norm.item()))
        opt.step()

    return training_step


def manual_accumulate(self, batch, batch_idx):
    opt = self.optimizers()
    x, y = batch
    if batch_idx % 2 == 0:
        opt.zero_grad()
    loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at) / 2
    self.manual_backward(loss)
    if batch_idx % 2 == 1:
        opt.step()


def manual_two_optimizers(self, batch, batch_idx):
    opt_a, opt_b = self.optimizers()
    x, y = batch
    opt_a.zero_grad()
    opt_b.zero_grad()
    loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
    self.manual_backward(loss)
    opt_a.step()
    opt_b.step()


def manual_multi_step(self, batch, batch_idx):
    opt = self.optimizers()
    for k, (xk, yk) in enumerate(chunks(*batch, 2)):
        opt.zero_grad()
        loss = mlp_loss(self.net, xk, yk)
        loss = inject_inf(loss, batch_idx, self.inf_at)
        loss = loss if k == 0 else inject_inf(loss, batch_idx, self.late_inf_at)
        self.manual_backward(loss)
        opt.step()


def manual_gan_step(between: Optional[Callable] = None, plain_g_backward: bool = False) -> Callable:
    """The GAN's ``training_step``: D step, then G's loss through the updated D, G step. ``between(module, batch_idx)``
    runs between D's step and G's backward (a checkpoint save, say); ``plain_g_backward``: the misuse of calling
    ``loss_g.backward()`` instead of ``self.manual_backward(loss_g)`` (the module is marked just before it)."""

    def training_step(self, batch, batch_idx):
        opt_d, opt_g = self.optimizers()
        real, noise = batch
        net = self.net
        fake = net.gen(noise)
        loss_d = F.mse_loss(net.disc(real), torch.ones(4, 1)) + F.mse_loss(net.disc(fake.detach()), torch.zeros(4, 1))
        loss_d = inject_inf(loss_d, batch_idx, self.inf_at)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        if between is not None:
            between(self, batch_idx)
        loss_g = F.mse_loss(net.disc(fake), torch.ones(4, 1))  # through the updated discriminator
        loss_g = inject_inf(loss_g, batch_idx, self.late_inf_at)
        opt_g.zero_grad()
        if plain_g_backward:
            self.mark()
            loss_g.backward()
        else:
            self.manual_backward(loss_g)
        opt_g.step()

    return training_step


manual_gan = manual_gan_step()


def manual_closure(self, batch, batch_idx):
    opt = self.optimizers()
    x, y = batch

    def closure():
        out = self.net(x)
        self.records.append(out.dtype)  # the closure's forward must run under autocast
        loss = inject_inf(F.mse_loss(out, y), batch_idx, self.inf_at)
        opt.zero_grad()
        self.manual_backward(loss)
        return loss

    opt.step(closure=closure)


def auto_plain(self, batch, batch_idx):
    x, y = batch
    return inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
