"""Training loops written as users write them, that an earlier recipe got wrong by guessing (the review of 2026-12-04:
a frozen first layer, an empty param group, the recipe written with the plugin's scaler, GAN critics that do not
detach, ``zero_grad(set_to_none=False)``, accumulation at two rates, an exception caught inside ``training_step``).

Each runs through the fork's Trainer and through PyTorch's recipe written by hand with torch's ``GradScaler``, and
compares parameters bitwise; where stock 2.6.6 equals the recipe, stock runs too and must equal it (never worse than
stock). Fabric's forms are in ``tests_fabric/plugins/precision/test_amp_fabric_user_loops.py``.
"""

from typing import Callable

import pytest
import torch
from amp_oracle.torch_features import requires_cpu_16_mixed, requires_cpu_fused
from amp_oracle.trainer import FORK, STOCK, lightning_api, make_trainer, quiet_trainer
from amp_oracle.world import ThroughScaler, new_scaler
from torch import nn

pytestmark = requires_cpu_16_mixed

N = 6


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


def _batches(n: int = N) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(4, 8, generator=gen) for _ in range(n)]


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loss(out: torch.Tensor, inf: bool = False) -> torch.Tensor:
    loss = out.float().pow(2).mean()
    return loss * float("inf") if inf else loss


def _autocast():
    return torch.autocast("cpu", dtype=torch.float16, cache_enabled=False)


def _module(api, net: nn.Module, configure: Callable, step: Callable, automatic: bool = False):
    """The oracle's ``RecipeModule`` of ``api``: ``configure(net)`` gives the optimizer or a list of them."""

    def optimizers(net):
        opts = configure(net)
        return opts if isinstance(opts, list) else [opts]

    return api.RecipeModule(net, optimizers, step, automatic, "16-mixed")


def _fit(package: str, make_module: Callable, scaler_kwargs: dict, **trainer_kwargs) -> tuple:
    """Fit the module ``make_module(api)`` builds with ``package``'s Trainer; the module and the final scale."""
    api = lightning_api(package)
    module = make_module(api)
    trainer = make_trainer(api, "16-mixed", scaler=new_scaler(**scaler_kwargs), **trainer_kwargs)
    trainer.fit(module, torch.utils.data.DataLoader(torch.cat(_batches()), batch_size=4))
    return module, trainer.precision_plugin.scaler.get_scale()


def _assert_same(a: nn.Module, b: nn.Module, package: str = FORK) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{package}: {name}: max abs diff {(p - q).abs().max().item()}"


# ---- 1. a frozen first layer, clipped in automatic optimization ---------------------------------------------------


def _frozen_net() -> nn.Sequential:
    net = _net()
    net[0].weight.requires_grad_(False)  # fine-tuning: the first parameter's `.grad` stays None
    return net


def _true_norm(params) -> float:
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def _automatic(api, net: nn.Module, configure: Callable):
    """Automatic optimization of ``net`` (an inf in batch 2); its ``on_before_optimizer_step`` records the norm of the
    gradients, what clipping sees."""

    def step(module, batch, batch_idx):
        return _loss(module.net(batch), inf=batch_idx == 2)

    module = _module(api, net, configure, step, automatic=True)
    module.on_before_optimizer_step = lambda optimizer: module.records.append(_true_norm(module.parameters()))
    return module


def _automatic_clip_recipe(net: nn.Module, opt: torch.optim.Optimizer) -> tuple:
    """torch's recipe for :func:`_automatic` with ``gradient_clip_val=0.05``: what clipping saw, the final scale."""
    scaler, norms = new_scaler(), []
    for i, batch in enumerate(_batches()):
        opt.zero_grad()
        with _autocast():
            loss = _loss(net(batch), inf=i == 2)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(_true_norm(net.parameters()))
        torch.nn.utils.clip_grad_norm_([p for p in net.parameters() if p.grad is not None], 0.05)
        scaler.step(opt)
        scaler.update()
    return norms, scaler.get_scale()


def _check_automatic_clip(packages: tuple, net_fn: Callable, configure: Callable) -> None:
    net = net_fn()
    norms, scale = _automatic_clip_recipe(net, configure(net))
    for package in packages:
        module, final = _fit(package, lambda api: _automatic(api, net_fn(), configure), {}, gradient_clip_val=0.05)
        assert module.records == pytest.approx(norms, nan_ok=True), package
        _assert_same(module.net, net, package)
        assert final == scale, package


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=requires_cpu_fused("AdamW"))])
def test_automatic_clipping_with_a_frozen_first_parameter(fused):
    """The hook and the clip see the true gradients on every step, not only the first: bitwise the recipe's. Stock
    equals the recipe for the for-loop optimizer (it refuses to clip a fused one). The frozen weight is in the
    optimizer too."""
    configure = lambda net: torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused)  # noqa: E731
    _check_automatic_clip((FORK,) if fused else (FORK, STOCK), _frozen_net, configure)


# ---- 2. an empty first param group ------------------------------------------------------------------------------


def test_an_empty_first_param_group_trains():
    configure = lambda net: torch.optim.SGD([{"params": []}, {"params": net.parameters()}], lr=0.1)  # noqa: E731
    _check_automatic_clip((FORK, STOCK), _net, configure)


# ---- 3. the recipe written with the plugin's own scaler ---------------------------------------------------------


def test_the_recipe_written_with_the_plugins_scaler_clips_true_gradients():
    """``scaler.scale(loss).backward()`` (a backward the plugin does not see), ``zero_grad(set_to_none=False)``,
    ``self.clip_gradients``: every step clips the true gradients (stock clips scaled ones)."""

    def step(module, batch, batch_idx):
        opt = module.optimizers()
        opt.zero_grad(set_to_none=False)
        module.trainer.precision_plugin.scaler.scale(_loss(module.net(batch))).backward()
        module.records.append(float(module.clip_gradients(opt, 0.05, "norm")))
        opt.step()

    def make(api):
        return _module(api, _net(), _sgd, step)

    net = _net()
    opt, scaler, norms = torch.optim.SGD(net.parameters(), lr=0.1), new_scaler(), []
    for batch in _batches():
        opt.zero_grad(set_to_none=False)
        with _autocast():
            loss = _loss(net(batch))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)))
        scaler.step(opt)
        scaler.update()
    module, final = _fit(FORK, make, {})
    assert module.records == pytest.approx(norms)
    _assert_same(module.net, net)
    assert final == scaler.get_scale()


# ---- 4, 5. GANs: a critic that does not detach, zeros written in place ------------------------------------------


class _GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.g = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.d = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def _gan_step(gan: _GAN, batch: torch.Tensor, loop: str, backward: Callable, opts: list, step: Callable) -> None:
    """One batch of ``loop``. ``wgan``: the critic D stepped twice, its loss not detached from G (so D's backward also
    fills G's gradients, which G zeroes before its own backward); ``critic-zeros``: D twice on detached fakes, both
    zeroed in place at the batch's start; ``gan-zeros``: D, then G through D, zeroed in place."""
    d_opt, g_opt = opts
    zeros = loop != "wgan"
    if zeros:
        d_opt.zero_grad(set_to_none=False)
        g_opt.zero_grad(set_to_none=False)
    for _ in range(1 if loop == "gan-zeros" else 2):
        if not zeros:
            d_opt.zero_grad()
        with _autocast():
            fake = gan.g(batch)
            loss_d = gan.d(batch).float().mean() - gan.d(fake if loop == "wgan" else fake.detach()).float().mean()
        backward(loss_d)
        step(d_opt)
    if not zeros:
        g_opt.zero_grad()
    with _autocast():
        loss_g = -gan.d(gan.g(batch)).float().mean()
    backward(loss_g)
    step(g_opt)


def _sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1)


def _gan_opts(gan: _GAN) -> list:
    return [torch.optim.SGD(gan.d.parameters(), lr=0.01), torch.optim.SGD(gan.g.parameters(), lr=0.01)]


@pytest.mark.parametrize("loop", ["wgan", "critic-zeros", "gan-zeros"])
def test_gan_loops_train_as_torchs_per_step_loop(loop):
    """torch's loop for these: ``scaler.update()`` after each step (the only legal placement for the critic loops).
    The fork updates before each next backward instead, carrying G's waiting gradients: the same weights and scales,
    and stock's."""

    def make(api):
        return _module(
            api,
            _GAN(),
            _gan_opts,
            lambda module, batch, batch_idx: _gan_step(
                module.net, batch, loop, module.manual_backward, module.optimizers(), lambda opt: opt.step()
            ),
        )

    gan = _GAN()
    opts, scaler = _gan_opts(gan), new_scaler(init_scale=2.0**4)

    def step(opt):
        opt.step()
        scaler.update()

    for batch in _batches():
        _gan_step(
            gan, batch, loop, lambda loss: scaler.scale(loss).backward(), [ThroughScaler(o, scaler) for o in opts], step
        )
    for package in (FORK, STOCK):
        module, final = _fit(package, make, {"init_scale": 2.0**4})
        _assert_same(module.net, gan, package)
        assert final == scaler.get_scale(), package


# ---- 7. accumulation at two rates ---------------------------------------------------------------------------------


class _EncoderHead(nn.Module):
    def __init__(self, seed: int = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 4)


def _pair_opts(pair: _EncoderHead) -> list:
    return [torch.optim.SGD(pair.encoder.parameters(), lr=0.1), torch.optim.SGD(pair.head.parameters(), lr=0.1)]


def _two_rates_step(
    net: _EncoderHead,
    batch: torch.Tensor,
    batch_idx: int,
    backward: Callable,
    opts: list,
    step: Callable,
    clip: Callable,
) -> None:
    """One backward feeds the head (stepped every batch) and the encoder (every second batch: accumulating)."""
    enc_opt, head_opt = opts
    with _autocast():
        loss = _loss(net.head(torch.relu(net.encoder(batch))), inf=batch_idx == 2)
    backward(loss)
    clip(head_opt)
    step(head_opt)
    head_opt.zero_grad()
    if batch_idx % 2 == 1:
        step(enc_opt)
        enc_opt.zero_grad()


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip-head"])
@pytest.mark.parametrize("growth_interval", [1, 2000])
def test_accumulation_at_two_rates(growth_interval, clip):
    """With the default scaler (``growth_interval=2000``) the scale does not move within two batches, and torch's loop
    (one update per batch) is right, as stock is without clipping (stock clips scaled gradients). With
    ``growth_interval=1`` the scale moves at every update and torch's loop would unscale the encoder's two batches
    with one scale: the fork carries the encoder's waiting gradients into the new scale at each update (written here by
    hand on torch's side: ``grad *= new / old``)."""

    def step(module, batch, batch_idx):
        def clip_head(opt):
            if clip:
                module.clip_gradients(opt, 0.05, "norm")

        _two_rates_step(
            module.net, batch, batch_idx, module.manual_backward, module.optimizers(), lambda opt: opt.step(), clip_head
        )

    def make(api):
        return _module(api, _EncoderHead(), _pair_opts, step)

    net = _EncoderHead()
    opts = _pair_opts(net)
    scaler = new_scaler(growth_interval=growth_interval, init_scale=2.0**4)

    def clip_head(opt):
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.head.parameters(), 0.05)

    for i, batch in enumerate(_batches()):
        _two_rates_step(net, batch, i, lambda loss: scaler.scale(loss).backward(), opts, scaler.step, clip_head)
        old = scaler.get_scale()
        scaler.update()
        if i % 2 == 0:  # the encoder's gradients wait for its step: the carry
            for p in net.encoder.parameters():
                p.grad.mul_(scaler.get_scale() / old)
    packages = (FORK, STOCK) if growth_interval > 1 and not clip else (FORK,)
    for package in packages:
        module, final = _fit(package, make, {"growth_interval": growth_interval, "init_scale": 2.0**4})
        _assert_same(module.net, net, package)
        assert final == scaler.get_scale(), package


# ---- 8. an exception caught inside training_step ------------------------------------------------------------------


def test_an_exception_caught_around_a_backward_leaves_nothing_behind():
    """Loss 1 reaches A and B, A steps; loss 2 reaches B, B steps. At batch 1 loss 2's backward raises (as an
    out-of-memory error would) and ``training_step`` catches it and zeroes both: the next batches train. torch's loop:
    one update per batch, after the ``try``; the fork's update before loss 2 carries B's gradients exactly."""

    def run_batch(pair, opts, batch, batch_idx, backward) -> None:
        a, b = pair.encoder, pair.head
        with _autocast():
            loss1 = _loss(b(torch.relu(a(batch))))
        backward(loss1)
        opts[0].step()
        try:
            with _autocast():
                loss2 = _loss(b(torch.relu(a(batch)).detach()))
            if batch_idx == 1:
                loss2.register_hook(_raise_oom)
            backward(loss2)
            opts[1].step()
        except RuntimeError as error:
            assert "out of memory" in str(error)
        for opt in opts:
            opt.zero_grad()

    def make(api):
        return _module(
            api,
            _EncoderHead(seed=3),
            _pair_opts,
            lambda module, batch, batch_idx: run_batch(
                module.net, module.optimizers(), batch, batch_idx, module.manual_backward
            ),
        )

    pair = _EncoderHead(seed=3)
    opts, scaler = _pair_opts(pair), new_scaler(growth_interval=1000)
    for i, batch in enumerate(_batches()):  # torch's loop: one update per batch, after the `try`
        run_batch(pair, [ThroughScaler(o, scaler) for o in opts], batch, i, lambda loss: scaler.scale(loss).backward())
        scaler.update()
    module, final = _fit(FORK, make, {"growth_interval": 1000})
    _assert_same(module.net, pair)
    assert final == scaler.get_scale()


def _raise_oom(grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("CPU out of memory (injected)")
