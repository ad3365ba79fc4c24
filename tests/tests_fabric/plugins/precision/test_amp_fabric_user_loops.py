"""Fabric loops written as users write them, that an earlier recipe got wrong by guessing (the review of 2026-12-04):
a frozen first layer, a warm-up that steps one of two optimizers, accumulation at two rates, k-fold with one Fabric.

Each runs through Fabric and through PyTorch's recipe written by hand with torch's ``GradScaler`` and compares weights
bitwise; where stock 2.6.6 equals the recipe, stock Fabric runs too. The Trainer's forms are in
``tests_pytorch/plugins/precision/test_amp_user_loops.py``.
"""

import gc

import pytest
import torch
from amp_oracle.fabric import make_fabric
from amp_oracle.torch_features import requires_cpu_16_mixed, requires_cpu_fused
from amp_oracle.world import ThroughScaler, new_scaler
from torch import nn

pytestmark = requires_cpu_16_mixed

BATCHES = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(6)]


def _autocast():
    return torch.autocast("cpu", dtype=torch.float16, cache_enabled=False)


def _loss(out: torch.Tensor, inf: bool = False) -> torch.Tensor:
    loss = out.float().pow(2).mean()
    return loss * float("inf") if inf else loss


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name}: max abs diff {(p - q).abs().max().item()}"


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=requires_cpu_fused("AdamW"))])
def test_clip_gradients_with_a_frozen_first_parameter(fused):
    """``fabric.clip_gradients`` on a model whose first parameter is frozen: the norm it returns and the clip are the
    true gradients' on every step (an earlier recipe saw the scaled ones from the second step on)."""

    def net() -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        model[0].weight.requires_grad_(False)
        return model

    twin = net()
    opt, scaler, norms = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=fused), new_scaler(), []
    for i, batch in enumerate(BATCHES):
        opt.zero_grad()
        with _autocast():
            loss = _loss(twin(batch), inf=i == 2)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)))
        scaler.step(opt)
        scaler.update()

    fabric = make_fabric("16-mixed", scaler=new_scaler())
    model = net()
    model, fabric_opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused))
    seen = []
    for i, batch in enumerate(BATCHES):
        fabric_opt.zero_grad()
        with fabric.autocast():
            loss = _loss(model(batch), inf=i == 2)
        fabric.backward(loss)
        seen.append(float(fabric.clip_gradients(model, fabric_opt, max_norm=0.05, error_if_nonfinite=False)))
        fabric_opt.step()
    assert seen == pytest.approx(norms, nan_ok=True)
    _assert_same(model.module, twin)


@pytest.mark.parametrize("growth_interval", [1, 2000])
def test_a_warm_up_that_steps_one_of_two_optimizers(growth_interval):
    """Two optimizers set up (encoder, head); the first iterations zero and step only the head while the encoder still
    receives gradients (discarded by its ``zero_grad`` when the warm-up ends): torch's loop, ``scaler.update()`` once
    per iteration after the steps,
    trains; so does the fork, and stock's weights where the scale does not move within an iteration (stock updates
    after each step, which unscales the encoder with a scale that did not scale it once both step)."""

    def nets() -> tuple:
        torch.manual_seed(1)
        return nn.Linear(8, 16), nn.Linear(16, 4)

    def run(backward, autocast, encoder, head, enc_opt, head_opt, end_iteration) -> None:
        for i, batch in enumerate(BATCHES):
            active = [head_opt] if i < 3 else [enc_opt, head_opt]  # the warm-up steps (and zeroes) the head only
            for opt in active:
                opt.zero_grad()
            with autocast():
                loss = _loss(head(torch.relu(encoder(batch))), inf=i == 4)
            backward(loss)
            for opt in active:
                opt.step()
            end_iteration()

    encoder, head = nets()
    enc_opt, head_opt = torch.optim.SGD(encoder.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    scaler = new_scaler(growth_interval=growth_interval)
    run(
        lambda loss: scaler.scale(loss).backward(),
        _autocast,
        encoder,
        head,
        ThroughScaler(enc_opt, scaler),
        ThroughScaler(head_opt, scaler),
        scaler.update,
    )
    packages = ("lightning", "stock_lightning_fabric") if growth_interval > 1 else ("lightning",)
    for package in packages:
        fabric = make_fabric("16-mixed", package=package, scaler=new_scaler(growth_interval=growth_interval))
        f_enc, f_head = nets()
        f_enc, f_enc_opt = fabric.setup(f_enc, torch.optim.SGD(f_enc.parameters(), lr=0.1))
        f_head, f_head_opt = fabric.setup(f_head, torch.optim.SGD(f_head.parameters(), lr=0.1))
        run(fabric.backward, fabric.autocast, f_enc, f_head, f_enc_opt, f_head_opt, lambda: None)
        _assert_same(nn.ModuleList([f_enc.module, f_head.module]), nn.ModuleList([encoder, head]))
        if package == "lightning":  # stock backs off once per overflowing step, twice in an iteration
            fabric.strategy.precision._recipe.settle()  # the loop's end: the update the last steps owe
            assert fabric.strategy.precision.scaler.get_scale() == scaler.get_scale()


@pytest.mark.parametrize("growth_interval", [1, 2000])
def test_accumulation_at_two_rates_under_no_backward_sync(growth_interval):
    """One backward feeds a head stepped every iteration and an encoder accumulating over two (under
    ``fabric.no_backward_sync``): the update before each next backward carries the encoder's waiting gradients into the
    new scale (written by hand on torch's side; with ``growth_interval=2000`` the scale does not move and torch's plain
    loop is right)."""

    def nets() -> tuple:
        torch.manual_seed(2)
        return nn.Linear(8, 16), nn.Linear(16, 4)

    encoder, head = nets()
    enc_opt, head_opt = torch.optim.SGD(encoder.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)
    scaler = new_scaler(growth_interval=growth_interval, init_scale=2.0**4)
    for i, batch in enumerate(BATCHES):
        with _autocast():
            loss = _loss(head(torch.relu(encoder(batch))), inf=i == 2)
        scaler.scale(loss).backward()
        scaler.step(head_opt)
        head_opt.zero_grad()
        if i % 2:
            scaler.step(enc_opt)
            enc_opt.zero_grad()
        old = scaler.get_scale()
        scaler.update()
        if i % 2 == 0:
            for p in encoder.parameters():
                p.grad.mul_(scaler.get_scale() / old)

    fabric = make_fabric("16-mixed", scaler=new_scaler(growth_interval=growth_interval, init_scale=2.0**4))
    f_enc, f_head = nets()
    f_enc, f_enc_opt = fabric.setup(f_enc, torch.optim.SGD(f_enc.parameters(), lr=0.1))
    f_head, f_head_opt = fabric.setup(f_head, torch.optim.SGD(f_head.parameters(), lr=0.1))
    for i, batch in enumerate(BATCHES):
        with fabric.no_backward_sync(f_enc, enabled=i % 2 == 0), fabric.autocast():
            loss = _loss(f_head(torch.relu(f_enc(batch))), inf=i == 2)
        with fabric.no_backward_sync(f_enc, enabled=i % 2 == 0):
            fabric.backward(loss)
        f_head_opt.step()
        f_head_opt.zero_grad()
        if i % 2:
            f_enc_opt.step()
            f_enc_opt.zero_grad()
    fabric.strategy.precision._recipe.settle()  # the loop's end: the update the last steps owe
    _assert_same(nn.ModuleList([f_enc.module, f_head.module]), nn.ModuleList([encoder, head]))
    assert fabric.strategy.precision.scaler.get_scale() == scaler.get_scale()


def test_k_fold_with_one_fabric_reads_each_folds_own_skips():
    """One Fabric, a new model and optimizer per fold, no overflow: no step reads as skipped, whatever address
    CPython gives the next fold's optimizer, and no hook of a collected fold's optimizer is kept."""
    fabric = make_fabric("16-mixed", scaler=new_scaler(growth_interval=1000))
    for fold in range(4):
        torch.manual_seed(fold)
        net = nn.Linear(8, 4)
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        skipped = []
        for batch in BATCHES[:3]:
            opt.zero_grad()
            with fabric.autocast():
                loss = _loss(model(batch))
            fabric.backward(loss)
            opt.step()
            skipped.append(opt.step_was_skipped)
        assert skipped == [False, False, False], fold
        del model, opt, net
        gc.collect()
    recipe = fabric.strategy.precision._recipe
    assert len(recipe._records) <= 1 and int(recipe.skipped_steps) == 0
