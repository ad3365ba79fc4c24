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
can run against the fork (``lightning``) and against the unpatched ``pytorch_lightning`` 2.6.6 (the negative control).

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
import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch import nn

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
MIXED_PRECISIONS = ("bf16-mixed", "16-mixed")
OPTIMIZERS = ("SGD", "AdamW")

N_BATCHES = 8
BATCH_SIZE = 4
IN_FEATURES = 8
HIDDEN = 16
OUT_FEATURES = 4

#: initial loss scale of every GradScaler (a power of two, see the module docstring)
INIT_SCALE = 2.0**10
#: batch whose loss is multiplied by ``inf`` in 16-mixed cells
INF_BATCH = 2
#: a second batch with an inf, for cases with several losses per batch: there the inf goes into a later loss
LATE_INF_BATCH = 5
#: clip values, small enough to really clip this model's gradients (the recipe asserts it)
CLIP_NORM = 0.05
CLIP_VALUE = 0.005

#: Whether the recipe's autocast regions cache weight casts. PyTorch's default is on, and the fork turns the cache on
#: where torch makes it safe (torch >= 2.11, pytorch#165068), off below. The setting is not numerically neutral: a
#: weight used twice in one autocast region (the discriminator applied to real and fake samples) is cast once with the
#: cache and its two low-precision gradients are summed before the cast back to fp32, but cast twice without it and
#: the two gradients are summed in fp32. The recipe follows the fork's policy so that both sides round alike.
AUTOCAST_CACHE = Version(torch.__version__).release >= (2, 11)

_AUTOCAST_DTYPES = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype Lightning's autocast uses for ``precision`` on CPU (``None``: no autocast)."""
    return _AUTOCAST_DTYPES[precision]


def uses_scaler(precision: str) -> bool:
    return precision == "16-mixed"


def inf_batch(precision: str) -> Optional[int]:
    """Batch whose loss gets an injected ``inf``: only with a scaler, without one an inf would destroy the weights."""
    return INF_BATCH if uses_scaler(precision) else None


def late_inf_batch(precision: str) -> Optional[int]:
    return LATE_INF_BATCH if uses_scaler(precision) else None


def inject_inf(loss: torch.Tensor, batch_idx: int, at: Optional[int]) -> torch.Tensor:
    return loss * float("inf") if batch_idx == at else loss


def new_scaler(cls: type = torch.amp.GradScaler, enabled: bool = True) -> torch.amp.GradScaler:
    return cls("cpu", init_scale=INIT_SCALE, growth_interval=1, enabled=enabled)


# --------------------------------------------------------------------------------------------------------------------
# data, networks, optimizers (shared by both sides)
# --------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(N_BATCHES, BATCH_SIZE, IN_FEATURES, generator=gen)
    y = torch.randn(N_BATCHES, BATCH_SIZE, OUT_FEATURES, generator=gen)
    return x, y


def make_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh copies of the fixed batches ``(x [4, 8], y [4, 4])``; ``y`` doubles as the generator's noise in the GAN."""
    x, y = _data()
    return [(x[i].clone(), y[i].clone()) for i in range(N_BATCHES)]


class Batches:
    """The fixed batches as a plain iterable (a ``list`` would be taken by the Trainer as a list of dataloaders)."""

    def __iter__(self):
        return iter(make_batches())

    def __len__(self) -> int:
        return N_BATCHES


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT_FEATURES))


def mlp_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x), y)


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


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``param_groups`` order (the order Lightning's clipping uses)."""
    return [p for group in opt.param_groups for p in group["params"]]


def trainable(net: nn.Module) -> list[torch.Tensor]:
    return [p for p in net.parameters() if p.requires_grad]


def _snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _changed(before: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    return any(not torch.equal(b, p) for b, p in zip(before, params))


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
    assert actual.params.keys() == expected.params.keys()
    differ = {}
    for name, p in expected.params.items():
        q = actual.params[name]
        assert q.dtype == p.dtype, f"{name}: dtype {q.dtype} != recipe {p.dtype}"
        if not torch.equal(q, p):
            differ[name] = (q - p).abs().max().item()
    assert not differ, f"parameters differ from the recipe (max abs diff): {differ}"


def assert_recipe_is_sharp(result: RunResult, precision: str) -> None:
    """Sanity of a recipe run: it trained, and under 16-mixed the injected inf backed the scale off."""
    assert any(result.changed), "the recipe never updated the parameters"
    if uses_scaler(precision):
        trajectory = [INIT_SCALE] + result.scales
        ratios = {b / a for a, b in zip(trajectory, trajectory[1:])}
        assert 0.5 in ratios, f"no back-off in {result.scales}"
        assert 2.0 in ratios, f"no growth in {result.scales}"
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

    def __init__(self, net: nn.Module, precision: str) -> None:
        self.net = net
        self.precision = precision
        self.dtype = autocast_dtype(precision)
        self.scaler = new_scaler(enabled=uses_scaler(precision))
        self.inf_at = inf_batch(precision)
        self.late_inf_at = late_inf_batch(precision)
        #: overridden by recipes that keep the scale themselves (see the multi-step case)
        self.get_scale: Callable[[], float] = self.scaler.get_scale
        self.scales: list[float] = []
        self.changed: list[bool] = []
        self.records: list[Any] = []

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=self.dtype, cache_enabled=AUTOCAST_CACHE)

    def inject(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return inject_inf(loss, batch_idx, self.inf_at)

    def inject_late(self, loss: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return inject_inf(loss, batch_idx, self.late_inf_at)

    def batches(self):
        """Yield ``(batch_idx, (x, y))``, recording the scale and whether the parameters changed after each batch."""
        params = trainable(self.net)
        for batch_idx, batch in enumerate(make_batches()):
            before = _snapshot(params)
            yield batch_idx, batch
            self.changed.append(_changed(before, params))
            if uses_scaler(self.precision):
                self.scales.append(self.get_scale())

    def result(self) -> RunResult:
        return RunResult(
            params={name: p.detach().clone() for name, p in self.net.named_parameters()},
            scales=self.scales if uses_scaler(self.precision) else None,
            changed=self.changed,
            records=self.records,
        )


# --------------------------------------------------------------------------------------------------------------------
# the Lightning side
# --------------------------------------------------------------------------------------------------------------------

PACKAGES = ("lightning", "pytorch_lightning")


@functools.lru_cache(maxsize=None)
def lightning_api(package: str) -> SimpleNamespace:
    """The Lightning classes from ``package``: the fork (``lightning``) or the unpatched copy (``pytorch_lightning``)."""
    if package == "lightning":
        import lightning.pytorch as pl
        from lightning.pytorch.plugins.precision import MixedPrecision
    elif package == "pytorch_lightning":
        import pytorch_lightning as pl
        from pytorch_lightning.plugins.precision import MixedPrecision
    else:
        raise ValueError(package)

    class RecipeModule(pl.LightningModule):
        """Holds ``net``; ``configure(net)`` builds the optimizers, ``step(module, batch, batch_idx)`` is the
        ``training_step``; ``inf_at`` / ``late_inf_at`` the batches that must inject an inf into their first / a later
        loss; ``amp_dtype`` the autocast dtype the Trainer
        should use (``None``: none); ``records`` collects what the step saw."""

        def __init__(self, net: nn.Module, configure: Callable, step: Callable, automatic: bool, precision: str) -> None:
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
            self._before = _snapshot(trainable(pl_module))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.changed.append(_changed(self._before, trainable(pl_module)))
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.scales.append(None if scaler is None else scaler.get_scale())

    return SimpleNamespace(
        pl=pl,
        Trainer=pl.Trainer,
        LightningModule=pl.LightningModule,
        Callback=pl.Callback,
        MixedPrecision=MixedPrecision,
        RecipeModule=RecipeModule,
        Recorder=Recorder,
    )


def make_trainer(api: SimpleNamespace, precision: str, scaler=None, callbacks=(), **kwargs: Any):
    """A CPU trainer for one epoch over the fixed batches. 16-mixed goes through an explicit ``MixedPrecision`` with a
    CPU ``GradScaler``: ``precision="16-mixed"`` alone silently becomes bf16 on CPU."""
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
    if precision == "16-mixed":
        kwargs["plugins"] = [api.MixedPrecision("16-mixed", "cpu", scaler=scaler if scaler is not None else new_scaler())]
    else:
        assert scaler is None
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
    assert len(recorder.changed) == N_BATCHES, "the trainer did not run every batch"
    return RunResult(
        params={name: p.detach().clone() for name, p in module.net.named_parameters()},
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
