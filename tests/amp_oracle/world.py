"""The tiny mixed-precision world every AMP test of both suites (``tests_fabric``, ``tests_pytorch``) trains in.

Design choices that make bugs unable to hide:

* loss scales are powers of two (scaling and unscaling are then exact in fp32, so the two sides are bitwise
  comparable) and ``growth_interval=1`` (the scale moves on every update, so a missing, extra or misplaced
  ``update()`` shows in the trajectory);
* under 16-mixed the loss of batch :data:`INF_BATCH` is multiplied by ``inf``, so that a skipped step and a back-off
  happen at a known place;
* the clip values are small enough that every finite step of these runs really clips (the recipes assert it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Collection
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch import nn

from amp_oracle.torch_features import GradScaler, cpu_grad_scaler, cuda_grad_scaler, optimizer

#: the MLP: ``IN_FEATURES -> HIDDEN -> OUT_FEATURES``, fp32 parameters
IN_FEATURES, HIDDEN, OUT_FEATURES = 8, 16, 4
#: samples per batch
BATCH_SIZE = 4
#: batches of a run (a Trainer run's epoch is longer: :data:`TRAINER_BATCHES`)
N_BATCHES = 6

#: initial loss scale: a power of two, small enough that the MLP never overflows fp16 by itself in a run
INIT_SCALE = 2.0**10
#: a lower initial scale, for runs whose scale doubles on every step over many batches (or epochs): they stay far from
#: fp16's range, so that only the forced overflows skip a step
LOW_INIT_SCALE = 2.0**4
#: the batch whose loss is multiplied by ``inf`` under 16-mixed (not the first: fused SGD's first step is special)
INF_BATCH = 2
#: clip values, small enough that every finite step of these runs clips (the recipes assert it)
CLIP_NORM = 0.05
CLIP_VALUE = 0.004


def clip_args(algorithm: str) -> dict[str, Any]:
    """Lightning's clipping arguments (``clip_gradients``'s, the Trainer's) for ``"norm"`` or ``"value"``."""
    return {"gradient_clip_val": CLIP_NORM if algorithm == "norm" else CLIP_VALUE, "gradient_clip_algorithm": algorithm}


_AUTOCAST_DTYPES = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype Lightning's autocast uses for ``precision`` on CPU (``None``: no autocast)."""
    return _AUTOCAST_DTYPES[precision]


def uses_scaler(precision: str) -> bool:
    return precision == "16-mixed"


def inf_batch(precision: str) -> Optional[int]:
    """The batch whose loss gets an ``inf``: only with a scaler (without one an inf would destroy the weights)."""
    return INF_BATCH if uses_scaler(precision) else None


def new_scaler(
    device: str = "cpu",
    *,
    cls: Optional[type] = None,
    enabled: bool = True,
    init_scale: float = INIT_SCALE,
    growth_interval: int = 1,
    **kwargs,
) -> GradScaler:
    """The ``GradScaler`` of every test: a power-of-two ``init_scale`` and, by default, ``growth_interval=1``.

    On the CPU (``cls``: ``GradScaler`` or a subclass) a test that cannot train 16-mixed on this torch skips with the
    reason (a disabled scaler works everywhere); ``device="cuda"`` gives CUDA's, on every torch."""
    kwargs.update(init_scale=init_scale, growth_interval=growth_interval, enabled=enabled)
    if device == "cuda":
        assert cls is None
        return cuda_grad_scaler(**kwargs)
    assert device == "cpu", device
    return cpu_grad_scaler(cls, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# data and network (what a user writes once for both sides)
# --------------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _data(n_batches: int, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches, batch_size, IN_FEATURES, generator=gen)
    y = torch.randn(n_batches, batch_size, OUT_FEATURES, generator=gen)
    return x, y


def make_batches(
    n_batches: int = N_BATCHES, batch_size: int = BATCH_SIZE, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh copies of fixed random batches ``(x [batch_size, 8], y [batch_size, 4])``, the same for the same
    arguments."""
    x, y = _data(n_batches, batch_size, seed)
    return [(x[i].clone(), y[i].clone()) for i in range(n_batches)]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT_FEATURES))


def mlp_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x), y)


def inject_inf(loss: torch.Tensor, batch_idx: int, at: Union[None, int, Collection[int]]) -> torch.Tensor:
    """``loss * inf`` on the batch ``at`` (an index, several, or ``None``: none), else ``loss`` unchanged."""
    hit = batch_idx == at if at is None or isinstance(at, int) else batch_idx in at
    return loss * float("inf") if hit else loss


# --------------------------------------------------------------------------------------------------------------------
# parameters: snapshots and the bitwise comparison
# --------------------------------------------------------------------------------------------------------------------


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in ``param_groups`` order (the order Lightning's clipping uses)."""
    return [p for group in opt.param_groups for p in group["params"]]


def snapshot(params: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def same(x: Any, y: Any) -> bool:
    """Tensors bitwise equal, containers (dicts, lists, tuples: optimizer states) recursively, anything else ``==``."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


def changed_since(before: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    """Whether any of ``params`` differs from its copy in ``before`` (a skipped step changes none)."""
    return any(not torch.equal(b, p) for b, p in zip(before, params))


def named_params(net: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def params_differ(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max abs difference of every parameter that is not bitwise equal (empty: all bitwise equal)."""
    assert actual.keys() == expected.keys()
    differ = {}
    for name, p in expected.items():
        q = actual[name]
        assert q.dtype == p.dtype, f"{name}: dtype {q.dtype} != recipe {p.dtype}"
        if not torch.equal(q, p):
            differ[name] = (q - p).abs().max().item()
    return differ


class ThroughScaler:
    """``opt`` whose ``step()`` goes through torch's ``scaler.step``: torch's side of a loop written once for both
    sides (Lightning's optimizer wrappers step through the plugin's scaler)."""

    def __init__(self, opt: torch.optim.Optimizer, scaler: GradScaler) -> None:
        self.opt, self.scaler = opt, scaler

    def step(self) -> None:
        self.scaler.step(self.opt)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)


# --------------------------------------------------------------------------------------------------------------------
# the Trainer suite's cases: more batches, more networks, the optimizers
# --------------------------------------------------------------------------------------------------------------------

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
MIXED_PRECISIONS = ("bf16-mixed", "16-mixed")
OPTIMIZERS = ("SGD", "AdamW")

#: the batches of a Trainer run (one epoch): two more than the Fabric suite's :data:`N_BATCHES`, for the cases with a
#: second inf (:data:`LATE_INF_BATCH`) and an accumulation over pairs of batches
TRAINER_BATCHES = 8
#: a second batch with an inf, for cases with several losses per batch: there the inf goes into a later loss
LATE_INF_BATCH = 5

#: whether the recipe's autocast regions cache weight casts: the fork's policy, on where torch makes it safe (torch >=
#: 2.11, pytorch#165068); not numerically neutral (see :class:`~amp_oracle.run.RecipeRun`)
AUTOCAST_CACHE = Version(torch.__version__).release >= (2, 11)


def late_inf_batch(precision: str) -> Optional[int]:
    return LATE_INF_BATCH if uses_scaler(precision) else None


def trainer_batches(n_batches: int = TRAINER_BATCHES, **kwargs: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The shared batches (:func:`make_batches`), a Trainer run of them by default; ``y`` doubles as the generator's
    noise in the GAN."""
    return make_batches(n_batches, **kwargs)


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
        return iter(trainer_batches())

    def __len__(self) -> int:
        return TRAINER_BATCHES


class GAN(nn.Module):
    """A generator (noise [4] -> sample [8]) and a discriminator (sample [8] -> logit [1])."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gen = nn.Sequential(nn.Linear(OUT_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN_FEATURES))
        self.disc = nn.Sequential(nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

    def d_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        """Real samples are 1, generated ones (detached) 0."""
        return F.mse_loss(self.disc(real), torch.ones(4, 1)) + F.mse_loss(self.disc(fake.detach()), torch.zeros(4, 1))

    def g_loss(self, fake: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.disc(fake), torch.ones(4, 1))


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


#: the optimizers of the fused matrix and of DDP (:mod:`amp_oracle.fused`, :mod:`amp_oracle.ddp`), by name: each has a
#: fused implementation and a for-loop one (``make_optimizer(name, params, fused=...)``)
IMPL_OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    "Adam": (torch.optim.Adam, {"lr": 1e-2}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.0}),
    "SGD": (torch.optim.SGD, {"lr": 0.1}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "SGD-dampening": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.1}),
}


def make_optimizer(name: str, params: Any, fused: Optional[bool] = None) -> torch.optim.Optimizer:
    """The Trainer suite's ``SGD`` (with momentum) or ``AdamW``, torch's default implementation; with ``fused``, one of
    :data:`IMPL_OPTIMIZERS`, fused (``True``) or the for-loop implementation (``False``: ``foreach=False`` spelled out,
    the reference path)."""
    if fused is not None:
        cls, settings = IMPL_OPTIMIZERS[name]
        return optimizer(cls, params, **settings, **({"fused": True} if fused else {"fused": False, "foreach": False}))
    if name == "SGD":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-2)
    raise ValueError(name)


def trainable(net: nn.Module) -> list[torch.Tensor]:
    return [p for p in net.parameters() if p.requires_grad]


def one_optimizer(net: nn.Module, name: str, fused: Optional[bool] = None) -> list[torch.optim.Optimizer]:
    return [make_optimizer(name, trainable(net), fused)]


def two_optimizers(net: nn.Sequential, name: str, fused: Optional[bool] = None) -> list[torch.optim.Optimizer]:
    # first layer and last layer, fed by one loss and one backward
    return [make_optimizer(name, net[0].parameters(), fused), make_optimizer(name, net[2].parameters(), fused)]


def gan_optimizers(net: GAN, name: str) -> list[torch.optim.Optimizer]:
    return [make_optimizer(name, net.disc.parameters()), make_optimizer(name, net.gen.parameters())]


def chunks(x: torch.Tensor, y: torch.Tensor, n: int):
    size = len(x) // n
    return [(x[k * size : (k + 1) * size], y[k * size : (k + 1) * size]) for k in range(n)]


def fresh_autocast_forward(net: nn.Sequential, x: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``mlp``'s forward from detached copies of its current weights under a new autocast region: copies do not
    require grad, so autocast never serves them from its weight cache."""
    w0, b0, w1, b1 = (p.detach().clone() for p in (net[0].weight, net[0].bias, net[2].weight, net[2].bias))
    ctx = contextlib.nullcontext() if dtype is None else torch.autocast("cpu", dtype=dtype)
    with ctx:
        return F.linear(F.relu(F.linear(x, w0, b0)), w1, b1)
