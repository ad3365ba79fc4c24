"""Manual (and automatic) optimization under mixed precision behaves exactly like PyTorch's AMP recipe, bitwise.

Each cell ``mode:case:precision:optimizer`` trains through the Trainer and through a hand-written AMP loop
(``amp_oracle``); autocast is off in backward, clipping and the step; ``loss.backward()`` instead of
``manual_backward`` raises; the unpatched ``stock_pytorch_lightning`` 2.6.6 fails exactly the cells of
``STOCK_FAILURES`` and passes the others.
"""

import copy
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from amp_oracle.loops import (
    auto_plain,
    manual_accumulate,
    manual_clip,
    manual_closure,
    manual_gan,
    manual_multi_step,
    manual_plain,
    manual_two_optimizers,
    recipe_accumulate,
    recipe_clip,
    recipe_gan,
    recipe_multi_step,
    recipe_one_optimizer,
    recipe_plain,
    recipe_two_optimizers,
)
from amp_oracle.run import RecipeRun, Run, assert_recipe_is_sharp, assert_same_run
from amp_oracle.torch_features import (
    GradScaler,
    autocast_enabled,
    require_cpu_fp16_autocast,
    requires_cpu_fp16_autocast,
)
from amp_oracle.trainer import FORK, STOCK, fit_lightning, lightning_api, stock_is_unpatched
from amp_oracle.world import (
    AUTOCAST_CACHE,
    CLIP_NORM,
    CLIP_VALUE,
    GAN,
    MIXED_PRECISIONS,
    OPTIMIZERS,
    PRECISIONS,
    TRAINER_BATCHES,
    NestedAutocastNet,
    TeacherStudent,
    autocast_dtype,
    fresh_autocast_forward,
    gan_optimizers,
    inject_inf,
    make_optimizer,
    mlp,
    mlp_loss,
    new_scaler,
    one_optimizer,
    optimizer_params,
    two_optimizers,
)
from amp_oracle.world import (
    trainer_batches as make_batches,
)
from torch import nn

# --------------------------------------------------------------------------------------------------------------------
# networks and optimizers per case
# --------------------------------------------------------------------------------------------------------------------


def _mlp(precision: str) -> nn.Module:
    return mlp()


def _nested_net(precision: str) -> nn.Module:
    require_cpu_fp16_autocast()  # a nested region of the other dtype: float16 under bf16-mixed
    outer = autocast_dtype(precision)
    other = torch.float16 if outer == torch.bfloat16 else torch.bfloat16
    return NestedAutocastNet(outer, other)


def _assert_clipping_happened(rc: Run, precision: str) -> None:
    for kind, limit in (("norm", CLIP_NORM), ("value", CLIP_VALUE)):
        sizes = [size for k, size in rc.records if k == kind]
        assert not sizes or any(math.isfinite(s) and s > limit for s in sizes), f"{kind} never clipped: {sizes}"
    assert rc.records


# --------------------------------------------------------------------------------------------------------------------
# the recipe side: hand-written PyTorch AMP loops
# --------------------------------------------------------------------------------------------------------------------


# unscale once, then both clips
recipe_clip_value_then_norm = recipe_clip("value", "norm")


def _teacher_student_loss(net: TeacherStudent, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        target = net.teacher(x)
        # a no_grad pass through the student's own (grad-requiring) weights too: with autocast's weight cache on, this
        # is where a cast without autograd history could get cached and then reused by the forward below
        net.student(x)
    out = net.student(x)
    return F.mse_loss(out, y) + F.mse_loss(out, target)


recipe_teacher = recipe_one_optimizer(_teacher_student_loss, after_update=lambda rc: rc.net.update_teacher())


# --------------------------------------------------------------------------------------------------------------------
# the Lightning side: training_step bodies (``self`` is the LightningModule)
# --------------------------------------------------------------------------------------------------------------------


def manual_clip_value_then_norm(self, batch, batch_idx):
    # two clip_gradients calls in one step: unscaling must happen once
    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
    self.manual_backward(loss)
    self.clip_gradients(opt, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value")
    self.clip_gradients(opt, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
    opt.step()


def manual_teacher(self, batch, batch_idx):
    opt = self.optimizers()
    x, y = batch
    opt.zero_grad()
    loss = inject_inf(_teacher_student_loss(self.net, x, y), batch_idx, self.inf_at)
    self.manual_backward(loss)
    opt.step()
    self.net.update_teacher()


def manual_user_unscale(raw: bool) -> Callable:
    # the PyTorch recipe written by the user: unscale_ themselves, clip with torch, then step
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.inf_at)
        self.manual_backward(loss)
        scaler = self.trainer.precision_plugin.scaler
        scaler.unscale_(opt.optimizer if raw else opt)
        torch.nn.utils.clip_grad_norm_(optimizer_params(opt), CLIP_NORM)
        opt.step()

    return training_step


def manual_step_then_forward(self, batch, batch_idx):
    # the forward after opt.step() must see the updated weights (a stale autocast weight cache would not)
    manual_plain(self, batch, batch_idx)
    x, _ = batch
    out = self.net(x)
    expected = fresh_autocast_forward(self.net, x, self.amp_dtype)
    self.records.append(torch.equal(out, expected))


# --------------------------------------------------------------------------------------------------------------------
# the matrix
# --------------------------------------------------------------------------------------------------------------------


def _closure_ran_under_autocast(records: list, precision: str) -> None:
    assert records == [autocast_dtype(precision) or torch.float32] * len(records)
    assert records


def _saw_updated_weights(records: list, precision: str) -> None:
    assert records == [True] * TRAINER_BATCHES, f"a forward after opt.step() computed with stale weights: {records}"


def _nested_dtypes(net: NestedAutocastNet) -> Callable:
    def check(records: list, precision: str) -> None:
        assert net.seen_dtypes == [torch.float32, net.other]

    return check


@dataclass(frozen=True)
class Case:
    manual: Callable  # training_step body in manual optimization
    recipe: Callable  # (RecipeRun, optimizers) -> None
    net: Callable[[str], nn.Module] = _mlp
    configure: Callable = one_optimizer
    #: Trainer kwargs of the automatic-optimization cell (training_step ``auto_plain``); None: manual only
    automatic: Optional[dict] = None
    precisions: tuple = PRECISIONS
    optimizers: tuple = OPTIMIZERS
    #: checks of what the Lightning run recorded, ``(records, precision)``
    check_records: Optional[Callable] = None
    check_recipe: Optional[Callable] = None


CASES = {
    "plain": Case(manual_plain, recipe_plain, automatic={}),
    **{
        f"clip_{kind}": Case(
            manual_clip(kind),
            recipe_clip(kind),
            automatic={"gradient_clip_val": limit, "gradient_clip_algorithm": kind},
            check_recipe=_assert_clipping_happened,
        )
        for kind, limit in (("norm", CLIP_NORM), ("value", CLIP_VALUE))
    },
    "clip_value_then_norm": Case(
        manual_clip_value_then_norm, recipe_clip_value_then_norm, check_recipe=_assert_clipping_happened
    ),
    "accumulate": Case(manual_accumulate, recipe_accumulate, automatic={"accumulate_grad_batches": 2}),
    "two_optimizers": Case(manual_two_optimizers, recipe_two_optimizers, configure=two_optimizers),
    "multi_step": Case(manual_multi_step, recipe_multi_step),
    "gan": Case(manual_gan, recipe_gan, net=lambda precision: GAN(), configure=gan_optimizers),
    "no_grad_teacher": Case(manual_teacher, recipe_teacher, net=lambda precision: TeacherStudent()),
    "closure": Case(manual_closure, recipe_plain, check_records=_closure_ran_under_autocast),
    **{
        f"user_unscale_{which}_optimizer": Case(
            manual_user_unscale(raw=which == "raw"),
            recipe_clip("norm"),
            precisions=("16-mixed",),
            check_recipe=_assert_clipping_happened,
        )
        for which in ("lightning", "raw")
    },
    "nested_autocast": Case(manual_plain, recipe_plain, net=_nested_net, precisions=MIXED_PRECISIONS),
    "step_then_forward": Case(manual_step_then_forward, recipe_plain, check_records=_saw_updated_weights),
}


def check_equivalence(package: str, mode: str, case_name: str, precision: str, optimizer: str) -> None:
    case = CASES[case_name]
    net = case.net(precision)
    configure = functools.partial(case.configure, name=optimizer)

    recipe_net = copy.deepcopy(net)
    rc = RecipeRun(recipe_net, precision, autocast_cache=AUTOCAST_CACHE and mode == "automatic")
    case.recipe(rc, configure(recipe_net))
    expected = rc.result()
    assert_recipe_is_sharp(expected, precision)
    if case.check_recipe:
        case.check_recipe(expected, precision)

    lightning_net = copy.deepcopy(net)
    if mode == "manual":
        actual = fit_lightning(package, precision, lightning_net, configure, case.manual)
    else:
        actual = fit_lightning(
            package, precision, lightning_net, configure, auto_plain, automatic=True, **case.automatic
        )
    if case.check_records:
        case.check_records(actual.records, precision)
    if isinstance(net, NestedAutocastNet):
        assert lightning_net.seen_dtypes == [torch.float32, lightning_net.other]
    assert_same_run(actual, expected)


def _cells() -> list:
    cells = []
    for name, case in CASES.items():
        modes = ("manual", "automatic") if case.automatic is not None else ("manual",)
        for mode in modes:
            for precision in case.precisions:
                for optimizer in case.optimizers:
                    cells.append(f"{mode}:{name}:{precision}:{optimizer}")
    return cells


MATRIX = _cells()


@pytest.mark.parametrize("cell", MATRIX)
def test_matches_the_pytorch_amp_recipe(cell):
    check_equivalence(FORK, *cell.split(":"))


# --------------------------------------------------------------------------------------------------------------------
# autocast is off in backward, clipping, the optimizer step and scaler bookkeeping
# --------------------------------------------------------------------------------------------------------------------


def _autocast_on() -> bool:
    return autocast_enabled("cpu")


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params, records: list) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.records = records

    def step(self, closure=None):
        self.records.append(("optimizer.step", _autocast_on()))
        return super().step(closure)


def _recording(name: str) -> Callable:
    def method(self, *args, **kwargs):
        self.records.append((f"scaler.{name}", _autocast_on()))
        return getattr(GradScaler, name)(self, *args, **kwargs)

    return method


class _RecordingScaler(GradScaler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.records: list = []

    scale, unscale_, step, update = (_recording(name) for name in ("scale", "unscale_", "step", "update"))


def check_autocast_off(package: str, precision: str, variant: str) -> None:
    """Record ``torch.is_autocast_enabled("cpu")`` everywhere from the forward to the end of the step, in the
    ``training_step`` body (``variant="step"``) or in a closure passed to ``opt.step`` (``"closure"``)."""
    api = lightning_api(package)
    records: list = []

    def hook(name: str) -> Callable:
        return lambda *_: records.append((name, _autocast_on()))

    hooks = ("on_before_backward", "on_after_backward", "on_before_optimizer_step")
    Module = type("Module", (api.RecipeModule,), {name: hook(name) for name in hooks})

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch

        def forward_backward_clip():
            records.append(("forward", _autocast_on()))
            out = self.net(x)
            out.register_hook(lambda grad: records.append(("backward", _autocast_on())))
            loss = inject_inf(F.mse_loss(out, y), batch_idx, self.inf_at)
            opt.zero_grad()
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
            return loss

        records.append(("training_step", _autocast_on()))
        if variant == "closure":
            opt.step(closure=forward_backward_clip)
        else:
            forward_backward_clip()
            opt.step()
        records.append(("training_step", _autocast_on()))

    clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(*args, **kwargs):
        records.append(("clip_grad_norm_", _autocast_on()))
        return clip(*args, **kwargs)

    scaler = new_scaler(cls=_RecordingScaler) if precision == "16-mixed" else None
    net = mlp()
    expected_net = copy.deepcopy(net)
    with (
        mock.patch.object(torch.nn.utils, "clip_grad_norm_", recording_clip),
        mock.patch.object(torch.nn.utils.clip_grad, "clip_grad_norm_", recording_clip),
    ):
        actual = fit_lightning(
            package,
            precision,
            net,
            lambda net: [_RecordingSGD(net.parameters(), records)],
            training_step,
            module_cls=Module,
            scaler=scaler,
        )
    if scaler is not None:
        records += scaler.records
    seen: dict = {}
    for where, enabled in records:
        seen.setdefault(where, set()).add(enabled)
    expected_places = {"training_step", "forward", "backward", "clip_grad_norm_", "optimizer.step", *hooks}
    if scaler is not None:
        expected_places |= {"scaler.scale", "scaler.unscale_", "scaler.step", "scaler.update"}
    assert expected_places <= seen.keys(), f"never observed: {expected_places - seen.keys()}"
    assert seen.pop("training_step") == {True}, "the training_step body must run under autocast"
    assert seen.pop("forward") == {True}, "the forward must run under autocast"
    under_autocast = sorted(where for where, states in seen.items() if True in states)
    assert not under_autocast, f"ran under autocast: {under_autocast}"

    # and the run is still the recipe's
    rc = RecipeRun(expected_net, precision)
    recipe_clip("norm")(rc, [make_optimizer("SGD", expected_net.parameters())])
    assert_same_run(actual, rc.result())


@pytest.mark.parametrize("variant", ["step", "closure"])
@pytest.mark.parametrize("precision", MIXED_PRECISIONS)
def test_autocast_off_in_backward_clipping_and_step(precision, variant):
    check_autocast_off(FORK, precision, variant)


# --------------------------------------------------------------------------------------------------------------------
# misuse
# --------------------------------------------------------------------------------------------------------------------


def manual_plain_backward_from(misuse_at: int) -> Callable:
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        loss = mlp_loss(self.net, x, y)
        if batch_idx < misuse_at:
            self.manual_backward(loss)
        else:
            loss.backward()  # misuse: bypasses the loss scaling of self.manual_backward
            self.records.append([p.detach().clone() for p in self.net.parameters()])
        opt.step()

    return training_step


def check_misuse_plain_backward(package: str, misuse_at: str) -> None:
    """``loss.backward()`` instead of ``self.manual_backward(loss)`` under 16-mixed: ``opt.step()`` raises and says what
    to call instead; the step leaves the weights untouched. From the first batch (the scaler has never scaled anything
    yet: the free check, by default) and after a few correct batches (the opt-in misuse watch)."""
    api = lightning_api(package)
    seen: list = []

    class Module(api.RecipeModule):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.records = seen

    net = mlp()
    configure = functools.partial(one_optimizer, name="SGD")
    with pytest.raises(RuntimeError, match="manual_backward"):
        fit_lightning(
            package,
            "16-mixed",
            net,
            configure,
            manual_plain_backward_from(int(misuse_at)),
            module_cls=Module,
            watch_misuse=int(misuse_at) > 0,
        )
    assert len(seen) == 1, "training went on after the misuse"
    for before, after in zip(seen[0], net.parameters()):
        assert torch.equal(before, after), "the misused step changed the weights"


@pytest.mark.parametrize("misuse_at", ["0", "3"])
def test_loss_backward_instead_of_manual_backward_raises(misuse_at):
    check_misuse_plain_backward(FORK, misuse_at)


# --------------------------------------------------------------------------------------------------------------------
# negative control: the unpatched stock_pytorch_lightning 2.6.6 fails these cells
# --------------------------------------------------------------------------------------------------------------------


def check_cell(package: str, cell: str) -> None:
    kind, *args = cell.split(":")
    if kind in ("manual", "automatic"):
        check_equivalence(package, kind, *args)
    elif kind == "autocast_off":
        check_autocast_off(package, *args)
    elif kind == "misuse_plain_backward":
        check_misuse_plain_backward(package, *args)
    else:
        raise ValueError(cell)


_DIFFERS = (AssertionError, "parameters differ from the recipe")
_TRAJECTORY = (AssertionError, "scale trajectory")

#: ``cell -> (exception, message pattern)``: how stock 2.6.6 fails each cell, found by running every cell against it.
#: Every other cell of the matrix passes on stock (automatic optimization, and manual plain, accumulation, closure,
#: no_grad teacher and step-then-forward, as well as everything that does not involve a scaler or a nested region).
STOCK_FAILURES = {
    # clip_gradients clips the gradients while they are still multiplied by the loss scale (upstream #18089)
    **{
        f"manual:{clip}:16-mixed:{opt}": _DIFFERS
        for clip in ("clip_norm", "clip_value", "clip_value_then_norm")
        for opt in OPTIMIZERS
    },
    # scaler.update() after every optimizer step: the second optimizer is unscaled with a scale that did not scale its
    # gradients, and the scale moves twice per batch
    **{f"manual:two_optimizers:16-mixed:{opt}": _TRAJECTORY for opt in OPTIMIZERS},
    # the user's scaler.unscale_(lightning_optimizer) is keyed by the wrapper; the step unscales the raw optimizer again
    **{f"manual:user_unscale_lightning_optimizer:16-mixed:{opt}": _DIFFERS for opt in OPTIMIZERS},
    # ... and with the raw optimizer, the step's own unscale_ raises
    **{
        f"manual:user_unscale_raw_optimizer:16-mixed:{opt}": (RuntimeError, r"unscale_\(\) has already been called")
        for opt in OPTIMIZERS
    },
    # manual_backward runs under autocast: the backward of the fp32 island is computed in low precision
    **{f"manual:nested_autocast:{prec}:{opt}": _DIFFERS for prec in MIXED_PRECISIONS for opt in OPTIMIZERS},
    **{
        f"autocast_off:{prec}:{variant}": (AssertionError, "ran under autocast")
        for prec in MIXED_PRECISIONS
        for variant in ("step", "closure")
    },
    # loss.backward() in the first batch trips over torch's internal assertion (the scaler never scaled anything) ...
    "misuse_plain_backward:0": (AssertionError, "_scale is None"),
    # ... and after correct batches goes unnoticed: the unscaled gradients are divided by the scale
    "misuse_plain_backward:3": (pytest.fail.Exception, "DID NOT RAISE"),
}


needs_stock = pytest.mark.skipif(
    not stock_is_unpatched(), reason=f"the negative control needs the unpatched `{STOCK}` 2.6.6"
)


@needs_stock
@pytest.mark.parametrize("cell", sorted(STOCK_FAILURES))
def test_stock_lightning_fails_the_recipe(cell):
    exception, match = STOCK_FAILURES[cell]
    with pytest.raises(exception, match=match):
        check_cell(STOCK, cell)


@needs_stock
@pytest.mark.parametrize("cell", [cell for cell in MATRIX if cell not in STOCK_FAILURES])
def test_stock_lightning_passes_the_other_cells(cell):
    """The recipe is no strawman: where stock 2.6.6 is right (automatic optimization above all, whose code path the
    fork leaves alone), it agrees with it bitwise. Together with the test above, this partitions the matrix."""
    check_cell(STOCK, cell)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, pytest.param(torch.float16, marks=requires_cpu_fp16_autocast)], ids=["bf16", "fp16"]
)
def test_stale_weight_check_can_fail(dtype):
    """The check of ``step_then_forward`` (stock passes it: its autocast cache is off) catches a stale cache: one
    autocast region with the cache on around forward, step and a second forward, as upstream master has it."""
    net = mlp()
    opt = make_optimizer("SGD", net.parameters())
    x, y = make_batches()[0]
    with torch.autocast("cpu", dtype=dtype, cache_enabled=True):
        mlp_loss(net, x, y).backward()
        opt.step()
        stale = net(x)
    assert not torch.equal(stale, fresh_autocast_forward(net, x, dtype))
