"""The benchmarks' models and data, shared by the Lightning runs and the hand-written PyTorch loop of ``make bench``
(``worker.py``), ``count_calls.py`` and the cost part of ``make gpu-check`` (``gpu_check_parts.py``).

Only torch is imported here, so the module loads the same in the fork's and in the stock virtual environment (which
hold neither pytest nor the tests' oracle). Each workload is a small ``nn.Module`` whose ``loss(x, y)`` is the whole
forward pass (what runs under autocast), plus a builder for its batches. Sizes come from a plain dict (see
``sizes.DEFAULT_SIZES`` and ``benchmarks/run.py --help``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn


class MLP(nn.Module):
    """``depth`` Linear layers of ``width`` with ReLU between them, regressing a ``width``-wide target."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(width, width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x).float(), y)


class TiedBlock(nn.Module):
    """One ``Linear(width, width)`` applied ``repeats`` times (a weight-tied, universal-transformer-like stack).

    Autocast casts the fp32 weight to bf16 at every use unless its weight cache is on, and each cast copy is kept for
    the backward pass: with the cache off the step does ``repeats`` casts and holds ``repeats`` copies, with it one.
    """

    def __init__(self, width: int, repeats: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.tied = nn.Linear(width, width)
        self.repeats = repeats

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.repeats):
            h = h + torch.tanh(self.tied(h))
        return nn.functional.mse_loss(h.float(), y)


class UnrolledRNN(nn.Module):
    """An ``RNNCell`` unrolled over the ``steps`` time steps of the input, then a linear head on the last state.

    Both of the cell's weights are used once per time step, so with autocast's cache off they are cast ``2 * steps``
    times per forward, and every copy is saved for the backward pass.
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.cell = nn.RNNCell(hidden, hidden)
        self.head = nn.Linear(hidden, hidden)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[1], self.cell.hidden_size)
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
        return nn.functional.mse_loss(self.head(h).float(), y)


class ManyLayers(nn.Module):
    """``layers`` tiny ``Linear(width, width)`` layers (weight and bias: ``2 * layers`` parameter tensors), each
    followed by ``tanh``: a model with many small parameter tensors, where anything done per parameter per step (a
    hook, a Python loop over the parameters) is a visible share of the step instead of vanishing behind the matmuls.
    """

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return nn.functional.mse_loss(h.float(), y)


class Transformer(nn.Module):
    """``layers`` pre-norm encoder layers (``d`` wide, 4 heads) over ``[batch, seq, d]``, regressing the last token."""

    def __init__(self, d: int, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, d)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.encoder(x)[:, -1]).float(), y)


def build_model(workload: str, sizes: dict) -> nn.Module:
    if workload == "mlp":
        return MLP(sizes["mlp_width"], sizes["mlp_depth"])
    if workload == "fused":
        return MLP(sizes["fused_width"], sizes["fused_depth"])
    if workload == "tied":
        return TiedBlock(sizes["tied_width"], sizes["tied_repeats"])
    if workload == "rnn":
        return UnrolledRNN(sizes["rnn_hidden"])
    if workload == "many":
        return ManyLayers(sizes["many_width"], sizes["many_layers"])
    if workload == "transformer":
        return Transformer(sizes["transformer_d"], sizes["transformer_layers"])
    raise ValueError(f"unknown workload {workload!r}")


def build_batches(workload: str, sizes: dict, device: str, count: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` distinct (input, target) batches, already on ``device``, in float32."""
    gen = torch.Generator().manual_seed(1234)
    if workload in ("mlp", "fused", "many"):
        width, batch = sizes[f"{workload}_width"], sizes[f"{workload}_batch"]
        x_shape, y_shape = (batch, width), (batch, width)
    elif workload == "tied":
        width, batch = sizes["tied_width"], sizes["tied_batch"]
        x_shape, y_shape = (batch, width), (batch, width)
    elif workload == "rnn":
        hidden, batch = sizes["rnn_hidden"], sizes["rnn_batch"]
        x_shape, y_shape = (sizes["rnn_steps"], batch, hidden), (batch, hidden)
    elif workload == "transformer":
        d, batch = sizes["transformer_d"], sizes["transformer_batch"]
        x_shape, y_shape = (batch, sizes["transformer_seq"], d), (batch, d)
    else:
        raise ValueError(f"unknown workload {workload!r}")
    return [
        (torch.randn(x_shape, generator=gen).to(device), torch.randn(y_shape, generator=gen).to(device))
        for _ in range(count)
    ]


def build_optimizer(params, fused: bool, foreach: bool | None = None) -> torch.optim.Optimizer:
    """AdamW for every workload; ``fused=False`` leaves the implementation to torch (for-loop on CPU, foreach on CUDA)
    unless ``foreach`` says otherwise."""
    if fused:
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=foreach)


def build_scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """The step-interval scheduler of the runs that have one (``count_calls.py``, the GPU check's cost rows)."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.99)


def recipe_step(model: nn.Module, opt: torch.optim.Optimizer, scaler, x: torch.Tensor, y: torch.Tensor,
                device: str, dtype, clip: float) -> None:
    """One iteration of PyTorch's AMP recipe, written out: autocast around the forward pass and loss only (``dtype``
    None: no autocast); with a ``scaler`` (16-mixed) ``scaler.scale(loss).backward()``, ``scaler.unscale_`` before
    clipping, ``scaler.step``, ``scaler.update``. Lean on purpose, for timing and counting: the oracle's
    ``RecipeRun`` (``tests/amp_oracle``) records every batch, which would be measured with it."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=dtype) if dtype is not None else nullcontext():
        loss = model.loss(x, y)
    if scaler is not None:
        scaler.scale(loss).backward()
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()


def make_fabric(fabric_pkg, precision: str, device: str, scaler):
    """A one-device ``Fabric`` of ``fabric_pkg`` (the fork's ``lightning.fabric`` or stock's); 16-mixed through an
    explicit ``MixedPrecision`` with ``scaler`` (on a CPU the ``precision`` flag alone would become bf16)."""
    kwargs: dict = {"precision": "32-true" if precision == "32" else precision}
    if precision == "16-mixed":
        plugins = __import__(f"{fabric_pkg.__name__}.plugins.precision", fromlist=["MixedPrecision"])
        kwargs = {"plugins": [plugins.MixedPrecision("16-mixed", device, scaler=scaler)]}
    return fabric_pkg.Fabric(accelerator="gpu" if device == "cuda" else "cpu", devices=1, **kwargs)


def fabric_step(fabric, model, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, clip: float) -> None:
    """One iteration of a hand-written Fabric loop: the workload's ``loss`` under ``fabric.autocast()`` (as a forward
    would be), ``fabric.backward(loss)``, ``fabric.clip_gradients`` by norm (``clip`` > 0), ``optimizer.step()``."""
    opt.zero_grad(set_to_none=True)
    with fabric.autocast():
        loss = model.module.loss(x, y)
    fabric.backward(loss)
    if clip:
        fabric.clip_gradients(model, opt, max_norm=clip)
    opt.step()


def lightning_module(pl, model: nn.Module, mode: str, fused: bool, foreach: bool | None = None, clip: float = 0.0,
                     scheduler: bool = False):
    """A ``LightningModule`` of ``pl`` (the fork's ``lightning.pytorch`` or stock's) training the workload ``model``
    with :func:`build_optimizer`: ``mode`` ``"auto"`` returns the loss (clipping, if any, is the Trainer's
    ``gradient_clip_val``), ``"manual"`` zeroes, ``manual_backward`` s, clips by norm (``clip`` > 0) and steps; with
    ``scheduler`` a step-interval :func:`build_scheduler` (stepped by Lightning in automatic optimization, by the
    ``training_step`` in manual)."""

    class Workload(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.automatic_optimization = mode == "auto"

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.automatic_optimization:
                return self.model.loss(x, y)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.model.loss(x, y))
            if clip:
                self.clip_gradients(opt, gradient_clip_val=clip, gradient_clip_algorithm="norm")
            opt.step()
            if scheduler:
                self.lr_schedulers().step()
            return None

        def configure_optimizers(self):
            opt = build_optimizer(self.parameters(), fused, foreach)
            if not scheduler:
                return opt
            return {"optimizer": opt, "lr_scheduler": {"scheduler": build_scheduler(opt), "interval": "step"}}

    return Workload()
