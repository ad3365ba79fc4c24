"""A LightningModule trained under Fabric and under the Trainer gives the same result.

One ``LightningModule`` (:class:`RecipeModule`), trained over the same fixed batches

* under Fabric: ``model, opt = fabric.setup(module, module.configure_optimizers())`` and a hand-written loop; in
  automatic optimization the loop calls ``model.training_step``, ``fabric.backward``, ``fabric.clip_gradients`` and
  ``opt.step()``; in manual optimization ``model.training_step`` does it all itself through ``self.optimizers()``,
  ``self.manual_backward`` (which Fabric routes to ``fabric.backward``) and ``opt.step()``;
* under the Trainer, in automatic optimization (``gradient_clip_val``) and in manual optimization
  (``self.manual_backward``, ``self.clip_gradients``);
* and, as the reference for both, the hand-written PyTorch AMP recipe (``amp_oracle/fabric.py``).

In 32-true, bf16-mixed and 16-mixed (``MixedPrecision("16-mixed", "cpu", scaler=GradScaler("cpu", ...))``, a
power-of-two initial scale, ``growth_interval=1``, an inf injected into one batch's loss), with for-loop and fused
AdamW, with and without clipping by norm, everything is compared **bitwise**, no tolerance: parameters, the scale after
every batch, and per batch whether the step was skipped (``opt.step_was_skipped`` on both sides).

Two things about Fabric shape the tests (both are stock Fabric 2.6.6 behaviour, not the fork's):

* Stock Fabric routes a LightningModule's step methods through ``forward`` (autocast, input conversion, outputs back
  to float32) only when a strategy wraps the module (DDP, FSDP); on one device ``model.training_step(...)`` ran without
  autocast. The fork (patch fabric-step-methods-under-precision) routes them through ``forward`` on one device too, so
  calling it plainly, inside ``fabric.autocast()`` or through the forward route (see :data:`ROUTES`) all train like
  the Trainer.
* Through ``forward``, Fabric casts every floating-point argument to the autocast dtype, the targets too; the Trainer
  does not. The batches are therefore on a dyadic grid (multiples of 1/64 in [-2, 2)), which fp16 and bf16 represent
  exactly, so that cast changes nothing (:func:`test_why_the_batches_are_dyadic`).
"""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from amp_oracle.fabric import NET_SEED, Cell, assert_cell_is_sharp, make_fabric, recipe_run
from amp_oracle.run import Run, assert_same_run
from amp_oracle.torch_features import autocast_enabled
from amp_oracle.trainer import lightning_api, make_trainer
from amp_oracle.world import (
    BATCH_SIZE,
    CLIP_NORM,
    IN_FEATURES,
    INF_BATCH,
    N_BATCHES,
    OUT_FEATURES,
    PRECISIONS,
    inject_inf,
    make_optimizer,
    mlp,
    new_scaler,
    params_differ,
    uses_scaler,
)

import lightning.pytorch as pl

MODES = ("automatic", "manual")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        # the Trainer's chatter about the tiny dataloader, missing workers, logging intervals
        warnings.filterwarnings("ignore", message=".*(num_workers|does not have many workers|log_every_n_steps).*")
        yield


@functools.cache
def _data(dyadic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(31)
    shapes = ((N_BATCHES, BATCH_SIZE, IN_FEATURES), (N_BATCHES, BATCH_SIZE, OUT_FEATURES))
    if dyadic:
        return tuple(torch.randint(-128, 128, shape, generator=gen).float() / 64 for shape in shapes)
    return tuple(torch.randn(shape, generator=gen) for shape in shapes)


def make_batches(dyadic: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data(dyadic)
    return [(x[i].clone(), y[i].clone()) for i in range(N_BATCHES)]


class Batches:
    """The batches as a plain iterable for the Trainer (a ``list`` would be taken as a list of dataloaders)."""

    def __init__(self, dyadic: bool = True) -> None:
        self.dyadic = dyadic

    def __iter__(self):
        return iter(make_batches(self.dyadic))

    def __len__(self) -> int:
        return N_BATCHES


class RecipeModule(pl.LightningModule):
    """The user's module: the same code runs under Fabric and under the Trainer.

    ``scales`` records the scale that scaled each batch's loss and ``skipped`` whether each step was skipped, where
    the module can see it: in manual optimization in ``training_step`` on both sides; in automatic optimization the
    Trainer side records in hooks (Fabric does not call the module's hooks; its loop records instead).
    """

    def __init__(self, cell: Cell, automatic: bool, scaler=None) -> None:
        super().__init__()
        self.net = mlp(NET_SEED)
        self.cell = cell
        self.automatic_optimization = automatic
        self.scaler = scaler
        self.scales: list[float] = []
        self.skipped: list[bool] = []

    def configure_optimizers(self):
        return make_optimizer(self.cell.optimizer, self.parameters(), self.cell.fused)

    def _record_scale(self) -> None:
        if self.scaler is not None:
            self.scales.append(self.scaler.get_scale())

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = inject_inf(F.mse_loss(self.net(x), y), batch_idx, self.cell.inf_batches)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self._fabric is not None:  # the Trainer records in on_after_backward
            self._record_scale()
        if self.cell.clip == "norm":
            if self._fabric is not None:
                # norm clipping under Fabric: error_if_nonfinite=False, as the Trainer's clipping does (Fabric's default
                # raises on the overflow step that the scaler is about to skip)
                self.fabric.clip_gradients(self, opt, max_norm=CLIP_NORM, error_if_nonfinite=False)
            else:
                self.clip_gradients(opt, gradient_clip_val=CLIP_NORM, gradient_clip_algorithm="norm")
        opt.step()
        self.skipped.append(opt.step_was_skipped)
        return loss.detach()

    def on_after_backward(self) -> None:
        self._record_scale()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.automatic_optimization:
            self.skipped.append(self.optimizers().step_was_skipped)


def _result(module: RecipeModule, final_scale) -> Run:
    """The run of ``module``: the scale after each batch is the one that scaled the next, then ``final_scale``."""
    return Run(
        params={name: p.detach().clone() for name, p in module.net.named_parameters()},
        scales=module.scales[1:] + [final_scale] if module.scaler is not None else None,
        skipped=[(flag,) for flag in module.skipped],
        # a step changes the weights exactly when it is not skipped (asserted on the recipe side)
        changed=[(not flag,) for flag in module.skipped],
    )


#: How the Fabric loop calls ``training_step``:
#:
#: * ``"autocast"``: ``with fabric.autocast(): model.training_step(...)``, what Fabric's docs ask for methods other
#:   than ``forward``;
#: * ``"forward"``: through the ``_FabricModule``'s ``forward`` (``convert_input``, then ``forward_context``), the route
#:   Fabric itself takes when a strategy wraps the module (DDP, FSDP), emulated here on one device with the wrapper's
#:   redirection helper;
#: * ``"plain"``: ``model.training_step(...)`` as is; on one device Fabric 2.6.6 (stock and fork) applies no precision
#:   to it (see :func:`test_training_step_under_fabric_runs_under_autocast`).
ROUTES = ("autocast", "forward", "plain")


def fabric_run(cell: Cell, automatic: bool, route: str = "autocast", dyadic: bool = True) -> Run:
    scaler = new_scaler() if uses_scaler(cell.precision) else None
    fabric = make_fabric(cell.precision, scaler=scaler)
    module = RecipeModule(cell, automatic, scaler)
    model, opt = fabric.setup(module, module.configure_optimizers())

    def training_step(batch, batch_idx):
        if route == "autocast":
            with fabric.autocast():
                return model.training_step(batch, batch_idx)
        if route == "forward":
            return model._redirection_through_forward("training_step")(batch, batch_idx)
        assert route == "plain"
        return model.training_step(batch, batch_idx)

    for batch_idx, batch in enumerate(make_batches(dyadic)):
        if not automatic:
            training_step(batch, batch_idx)
            continue
        opt.zero_grad()
        loss = training_step(batch, batch_idx)
        fabric.backward(loss)
        module._record_scale()
        if cell.clip == "norm":
            fabric.clip_gradients(model, opt, max_norm=CLIP_NORM, error_if_nonfinite=False)  # see training_step
        opt.step()
        module.skipped.append(opt.step_was_skipped)
    # the plugin's state_dict applies the update pending since the last step (Fabric applies it lazily)
    final_scale = float(fabric.strategy.precision.state_dict()["scale"]) if scaler is not None else None
    return _result(module, final_scale)


@functools.cache
def trainer_run(cell: Cell, automatic: bool, dyadic: bool = True) -> Run:
    scaler = new_scaler() if uses_scaler(cell.precision) else None
    clip = {"gradient_clip_val": CLIP_NORM, "gradient_clip_algorithm": "norm"} if cell.clip == "norm" else {}
    trainer = make_trainer(lightning_api("lightning"), cell.precision, scaler=scaler, **(clip if automatic else {}))
    module = RecipeModule(cell, automatic, scaler)
    trainer.fit(module, train_dataloaders=Batches(dyadic))
    assert len(module.skipped) == N_BATCHES
    return _result(module, scaler.get_scale() if scaler is not None else None)


CELLS = [
    Cell(precision, "AdamW", fused, clip)
    for precision in PRECISIONS
    for fused in (False, True)
    for clip in ("none", "norm")
]


@pytest.mark.parametrize("route", ["autocast", "forward"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_fabric_and_trainer_agree(cell, mode, route):
    """Bitwise: the LightningModule under Fabric, under the Trainer, and the hand-written recipe. In manual
    optimization Fabric runs ``manual_backward``, clipping and the step inside the autocast region of the call (the
    Trainer leaves autocast for them); with these ops on CPU that makes no numerical difference."""
    automatic = mode == "automatic"
    recipe = recipe_run(cell, make_batches())
    assert_cell_is_sharp(recipe, cell)
    under_trainer = trainer_run(cell, automatic)
    assert_same_run(under_trainer, recipe)
    assert_same_run(fabric_run(cell, automatic, route), under_trainer)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_training_step_under_fabric_runs_under_autocast(precision):
    seen = []

    class Probe(RecipeModule):
        def training_step(self, batch, batch_idx):
            seen.append(autocast_enabled("cpu"))
            return super().training_step(batch, batch_idx)

    fabric = make_fabric(precision, scaler=new_scaler() if uses_scaler(precision) else None)
    model = fabric.setup(Probe(Cell(precision), automatic=True))
    model.training_step(make_batches()[0], 0)
    assert seen == [precision != "32"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("mode", MODES)
def test_fabric_and_trainer_agree_calling_training_step_plainly(precision, mode):
    cell = Cell(precision, "AdamW", False, "norm")
    assert_same_run(fabric_run(cell, mode == "automatic", "plain"), trainer_run(cell, mode == "automatic"))


def test_the_comparison_is_sharp():
    """A change a user could make by mistake shows: clipping on one side only moves the weights."""
    clipped = fabric_run(Cell("16-mixed", "AdamW", True, "norm"), automatic=False)
    unclipped = trainer_run(Cell("16-mixed", "AdamW", True, "none"), automatic=False)
    assert clipped.scales == unclipped.scales
    assert params_differ(clipped.params, unclipped.params)


def test_why_the_batches_are_dyadic():
    """Through ``forward`` Fabric casts the targets to the autocast dtype, the Trainer does not: with targets that fp16
    cannot represent the runs differ (by a few units of fp16's resolution in the weights), with dyadic ones they are
    bitwise equal (above). On one device every route of ``training_step`` goes through ``forward``, as under DDP."""
    cell = Cell("16-mixed", "AdamW", False, "none")
    under_fabric = fabric_run(cell, automatic=True, route="forward", dyadic=False)
    under_trainer = trainer_run(cell, automatic=True, dyadic=False)
    assert under_fabric.scales == under_trainer.scales
    assert under_fabric.skipped == under_trainer.skipped == [((i == INF_BATCH),) for i in range(N_BATCHES)]
    differ = params_differ(under_fabric.params, under_trainer.params)
    assert differ
    assert max(differ.values()) < 1e-3
    # on one device `model.training_step` takes the same route through `forward`, inside `fabric.autocast()` too
    under_autocast = fabric_run(cell, automatic=True, route="autocast", dyadic=False)
    assert not params_differ(under_autocast.params, under_fabric.params)


def test_a_method_the_module_lacks_still_raises():
    """Only the step methods the module defines are routed: ``hasattr`` keeps working on one device."""
    fabric = make_fabric("bf16-mixed", scaler=None)
    model = fabric.setup(torch.nn.Linear(2, 2))
    assert not hasattr(model, "training_step")
    with pytest.raises(AttributeError):
        model.validation_step


def test_stock_fabric_runs_training_step_without_autocast_on_one_device():
    """Negative control: stock Fabric 2.6.6 calls the method as is on one device."""
    pytest.importorskip("stock_lightning_fabric", reason="the negative control needs the unpatched Fabric 2.6.6")
    pytest.importorskip("stock_pytorch_lightning", reason="the negative control needs the unpatched Lightning 2.6.6")
    from stock_lightning_fabric import Fabric as StockFabric
    from stock_pytorch_lightning import LightningModule as StockModule

    seen = []

    class Probe(StockModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            seen.append(autocast_enabled("cpu"))
            return self.layer(batch).sum()

    fabric = StockFabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = fabric.setup(Probe())
    model.training_step(torch.ones(1, 2), 0)
    assert seen == [False]
