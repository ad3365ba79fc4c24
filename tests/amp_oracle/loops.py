"""The recipe loops as data: each case of the Trainer suite written twice, as PyTorch's AMP recipe and as the
``training_step`` a Lightning user writes.

A recipe loop is ``(RecipeRun, optimizers) -> None`` (:class:`amp_oracle.run.RecipeRun`); a ``training_step`` body is
``(module, batch, batch_idx)``, where the module has ``net``, ``inf_at``, ``late_inf_at`` and ``records`` (as
:func:`amp_oracle.trainer.lightning_api`'s ``RecipeModule`` has). The two are written apart, so that a Lightning bug
cannot cancel out against the reference.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from amp_oracle.run import RecipeRun
from amp_oracle.world import CLIP_NORM, CLIP_VALUE, chunks, clip_args, inject_inf, mlp_loss, optimizer_params


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


def recipe_one_optimizer(
    loss: Callable = mlp_loss,
    *,
    set_to_none: bool = True,
    before: Optional[Callable] = None,
    backward_at: Callable[[int], bool] = lambda batch_idx: True,
    before_step: Optional[Callable] = None,
    after_update: Optional[Callable] = None,
) -> Callable:
    """The single-optimizer recipe with a user's variations in their places, per batch: ``before(rc, x, y)`` (a
    forward or a weight edit of its own), ``opt.zero_grad(set_to_none=...)``, ``loss(net, x, y)`` under autocast with
    the inf injected and its scaled backward (only where ``backward_at(batch_idx)``), ``before_step(rc, opt) -> bool``
    (unscale, clip, a guard: ``False`` skips the step, the update runs all the same), the step, the update,
    ``after_update(rc)``."""

    def recipe(rc: RecipeRun, opts: list) -> None:
        (opt,) = opts
        for i, (x, y) in rc.batches():
            if before is not None:
                before(rc, x, y)
            opt.zero_grad(set_to_none=set_to_none)
            if backward_at(i):
                with rc.autocast():
                    loss_i = rc.inject(loss(rc.net, x, y), i)
                rc.scaler.scale(loss_i).backward()
            if before_step is None or before_step(rc, opt):
                rc.scaler.step(opt)
            rc.scaler.update()
            if after_update is not None:
                after_update(rc)

    return recipe


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
            loss_d = rc.inject(net.d_loss(real, fake), i)
        rc.scaler.scale(loss_d).backward()
        rc.scaler.step(opt_d)
        rc.save_point(i, opts)
        rc.scaler.update()
        opt_d.zero_grad()
        with rc.autocast():
            loss_g = rc.inject_late(net.g_loss(fake), i)
        opt_g.zero_grad()
        rc.scaler.scale(loss_g).backward()
        rc.scaler.step(opt_g)
        rc.scaler.update()


def manual_one_optimizer(
    loss: Callable = mlp_loss,
    *,
    inject: bool = True,
    raw: bool = False,
    set_to_none: bool = True,
    before: Optional[Callable] = None,
    backward_at: Callable[[int], bool] = lambda batch_idx: True,
    before_step: Optional[Callable] = None,
) -> Callable:
    """The ``training_step`` of :func:`recipe_one_optimizer`, its variations in the same places: ``before(module, x,
    y)``, ``opt.zero_grad(set_to_none=...)``, ``self.manual_backward`` of ``loss(net, x, y)`` (the inf injected unless
    not ``inject``) where ``backward_at(batch_idx)``, ``before_step(module, opt) -> bool`` (``False``: no step), the
    step; ``raw``: on the torch optimizer itself (``use_pl_optimizer=False``)."""

    def training_step(self, batch, batch_idx):
        opt = self.optimizers(use_pl_optimizer=not raw)
        x, y = batch
        if before is not None:
            before(self, x, y)
        opt.zero_grad(set_to_none=set_to_none)
        if backward_at(batch_idx):
            loss_i = loss(self.net, x, y)
            self.manual_backward(inject_inf(loss_i, batch_idx, self.inf_at) if inject else loss_i)
        if before_step is None or before_step(self, opt):
            opt.step()

    return training_step


manual_plain = manual_one_optimizer()


def manual_clip(algorithm: str) -> Callable:
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
        self.manual_backward(loss)
        norm = self.clip_gradients(opt, **clip_args(algorithm))
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
        loss_d = inject_inf(net.d_loss(real, fake), batch_idx, self.inf_at)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        opt_d.step()
        opt_d.zero_grad()
        if between is not None:
            between(self, batch_idx)
        loss_g = inject_inf(net.g_loss(fake), batch_idx, self.late_inf_at)  # through the updated discriminator
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
