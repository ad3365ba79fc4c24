"""``LossScaleMonitor`` logs the gradient scaler's loss scale and the number of skipped optimizer steps.

Under 16-mixed with ``inf`` forced into chosen batches, the logged values must equal what PyTorch's AMP recipe shows
after the same batches; ``growth_interval=1`` moves the scale every batch, so a value logged one batch off cannot pass.
The data is a function of ``batch_idx`` (the loader yields positions) so that a run resumed mid-epoch trains on the
uninterrupted run's batches (see ``tests_pytorch/checkpointing/test_amp_resume.py``).
"""

import csv
import functools
from typing import Any, Optional

import pytest
import torch
from amp_oracle.trainer import FORK, lightning_api, make_trainer, quiet_trainer
from amp_oracle.world import (
    AUTOCAST_CACHE,
    LOW_INIT_SCALE,
    TRAINER_BATCHES,
    Positions,
    inject_inf,
    mlp,
    mlp_loss,
    new_scaler,
)
from amp_oracle.world import trainer_batches as make_batches
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning.fabric import connector as fabric_connector
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import LossScaleMonitor, ModelCheckpoint

FORCED = (0, 3, 4)


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


@functools.cache
def recipe(forced=FORCED, optimizers: int = 1, accumulate: int = 1, cache: bool = AUTOCAST_CACHE) -> dict:
    """PyTorch's AMP recipe: ``batch -> (scale, skipped steps of all optimizers so far)`` after each batch that steps
    (every ``accumulate``-th). With two optimizers each owns one layer of the MLP, both fed by one backward."""
    net = mlp()
    groups = [list(net.parameters())] if optimizers == 1 else [list(net[0].parameters()), list(net[2].parameters())]
    opts = [torch.optim.AdamW(params, lr=1e-2) for params in groups]
    scaler = new_scaler(init_scale=LOW_INIT_SCALE)
    out, total = {}, 0
    for i, (x, y) in enumerate(make_batches()):
        with torch.autocast("cpu", dtype=torch.float16, cache_enabled=cache):
            loss = inject_inf(mlp_loss(net, x, y), i, forced)
        scaler.scale(loss).backward()
        if (i + 1) % accumulate:
            continue
        for opt in opts:
            before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
            scaler.step(opt)
            total += all(torch.equal(b, p) for b, p in zip(before, opt.param_groups[0]["params"]))
            opt.zero_grad(set_to_none=True)
        scaler.update()
        out[i] = (scaler.get_scale(), float(total))
    if accumulate == 1:  # the recipe is sharp: exactly the forced steps were skipped
        assert total == optimizers * len(forced)
    return out


class Model(LightningModule):
    def __init__(self, forced=FORCED, optimizers: int = 1) -> None:
        super().__init__()
        self.net = mlp()
        self.forced = forced
        self.n_optimizers = optimizers
        self.automatic_optimization = optimizers == 1
        self.lr = 1e-2

    def training_step(self, batch, batch_idx):
        x, y = make_batches()[batch_idx]
        loss = inject_inf(mlp_loss(self.net, x, y), batch_idx, self.forced)
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        return None

    def configure_optimizers(self):
        if self.n_optimizers == 1:
            return torch.optim.AdamW(self.net.parameters(), lr=self.lr)
        return [torch.optim.AdamW(layer.parameters(), lr=self.lr) for layer in (self.net[0], self.net[2])]


class CaptureLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def scale_log(self) -> dict[int, tuple[float, float]]:
        """``step -> (loss_scale, skipped_steps)`` as logged."""
        return {s: (m["loss_scale"], m["skipped_steps"]) for s, m in self.calls if "loss_scale" in m}


def trainer(precision: str = "16-mixed", **kwargs: Any):
    scaler = new_scaler(init_scale=LOW_INIT_SCALE) if precision == "16-mixed" else None
    # Lightning's default logger unless a test passes one
    return make_trainer(lightning_api(FORK), precision, scaler=scaler, **{"logger": None, **kwargs})


def expected_log(steps, forced=FORCED, optimizers: int = 1) -> dict[int, tuple[float, float]]:
    """The recipe's scale and skip count after the batches with the given indices (= the logged ``step``)."""
    return {s: recipe(forced, optimizers)[s] for s in steps}


def test_exported_from_callbacks():
    import lightning.pytorch.callbacks as callbacks

    assert callbacks.LossScaleMonitor is LossScaleMonitor
    assert "LossScaleMonitor" in callbacks.__all__


def test_csv_logger_gets_the_recipes_scale_and_skip_count(tmp_path):
    monitor = LossScaleMonitor()
    trainer(logger=CSVLogger(tmp_path, name="run"), callbacks=[monitor], log_every_n_steps=1).fit(Model(), Positions())
    [metrics_file] = tmp_path.glob("run/*/metrics.csv")
    with open(metrics_file) as f:
        rows = [row for row in csv.DictReader(f) if row.get("loss_scale")]
    logged = {int(row["step"]): (float(row["loss_scale"]), float(row["skipped_steps"])) for row in rows}
    # the logged step is the batch's, as for `self.log` in the training_step: 0..N-1 with log_every_n_steps=1
    assert logged == expected_log(range(TRAINER_BATCHES))
    scales, skipped = zip(*recipe().values())
    assert monitor.history == {"loss_scale": list(scales), "skipped_steps": list(skipped)}
    assert scales[:5] == (8.0, 16.0, 32.0, 16.0, 8.0)  # the forced skips of batches 0, 3 and 4 show


@pytest.mark.parametrize(
    ("monitor_every", "trainer_every", "logged_batches"),
    [(3, 1, (3, 6)), (None, 3, (3, 6)), (None, 4, (4, 8)), (2, 50, (2, 4, 6, 8))],
    ids=["monitor-3", "trainer-3", "trainer-4", "monitor-2-trainer-50"],
)
def test_log_every_n_steps(monitor_every, trainer_every, logged_batches):
    logger = CaptureLogger()
    monitor = LossScaleMonitor(log_every_n_steps=monitor_every)
    trainer(logger=logger, callbacks=[monitor], log_every_n_steps=trainer_every).fit(Model(), Positions())
    # after the k-th batch (1-based), logged at the step Lightning's own logging uses for that batch: k - 1
    assert logger.scale_log() == expected_log([k - 1 for k in logged_batches])


def test_counts_skipped_steps_of_every_optimizer():
    """Two optimizers fed by one backward (manual optimization): an overflow skips both, and both count."""
    logger = CaptureLogger()
    trainer(logger=logger, callbacks=[LossScaleMonitor(log_every_n_steps=1)]).fit(Model(optimizers=2), Positions())
    assert logger.scale_log() == expected_log(range(TRAINER_BATCHES), optimizers=2)
    assert logger.scale_log()[TRAINER_BATCHES - 1][1] == 2 * len(FORCED)


class ManualAccumulation(Model):
    """Manual optimization accumulating over two batches: one optimizer step every second batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = make_batches()[batch_idx]
        self.manual_backward(inject_inf(mlp_loss(self.net, x, y), batch_idx, self.forced))
        if batch_idx % 2:
            opt = self.optimizers()
            opt.step()
            opt.zero_grad()


def test_manual_accumulation_logs_once_per_optimizer_step():
    """As automatic accumulation does: after each batch that stepped, the scale that batch's update left."""
    logger = CaptureLogger()
    trainer(logger=logger, callbacks=[LossScaleMonitor(log_every_n_steps=1)]).fit(ManualAccumulation(), Positions())
    assert logger.scale_log() == recipe(accumulate=2, cache=False)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_raises_without_a_gradient_scaler(precision):
    with pytest.raises(MisconfigurationException, match=r"`LossScaleMonitor` needs a gradient scaler.*16-mixed"):
        trainer(precision, logger=CaptureLogger(), callbacks=[LossScaleMonitor()]).fit(Model(forced=()), Positions())


def test_raises_for_16_mixed_that_became_bf16_on_cpu(monkeypatch):
    """``Trainer(accelerator="cpu", precision="16-mixed")`` on torch < 2.3 (faked here) trains in bf16 (no scaler): the
    monitor says so. (From torch 2.3 the flag gets a CPU scaler: tests_pytorch/plugins/precision/test_cpu_16_mixed.)"""
    # `raising=False`: the flag exists only from the patch cpu-16-mixed-is-float16 on
    monkeypatch.setattr(fabric_connector, "_TORCH_GREATER_EQUAL_2_3", False, raising=False)
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        cpu_16 = make_trainer(
            lightning_api(FORK), "16-mixed", scaler="lightning", logger=CaptureLogger(), callbacks=[LossScaleMonitor()]
        )
    with pytest.raises(MisconfigurationException, match="`LossScaleMonitor` needs a gradient scaler"):
        cpu_16.fit(Model(forced=()), Positions())


def test_raises_without_a_logger():
    with pytest.raises(MisconfigurationException, match="`LossScaleMonitor`.*has no logger"):
        trainer(logger=False, callbacks=[LossScaleMonitor()]).fit(Model(), Positions())


@pytest.mark.parametrize("every", [0, -1])
def test_raises_for_a_nonpositive_interval(every):
    with pytest.raises(MisconfigurationException, match="must be a positive number"):
        LossScaleMonitor(log_every_n_steps=every)


def _uninterrupted_with_checkpoints(dirpath: str, every: int) -> dict[int, tuple[float, float]]:
    logger = CaptureLogger()
    checkpoints = ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer(
        logger=logger, callbacks=[LossScaleMonitor(log_every_n_steps=every), checkpoints], enable_checkpointing=True
    ).fit(Model(), Positions())
    return logger.scale_log()


RESUME_AT = 4  # after batches 0..3 (skips at 0 and 3); batch 4 overflows right after the resume


def _resume(dirpath, every: int) -> tuple[dict[int, tuple[float, float]], LossScaleMonitor]:
    logger = CaptureLogger()
    monitor = LossScaleMonitor(log_every_n_steps=every)
    trainer(logger=logger, callbacks=[monitor]).fit(Model(), Positions(), ckpt_path=dirpath / f"step={RESUME_AT}.ckpt")
    return logger.scale_log(), monitor


def test_skipped_steps_survive_a_resume(tmp_path):
    uninterrupted = _uninterrupted_with_checkpoints(str(tmp_path), 1)
    assert uninterrupted == expected_log(range(TRAINER_BATCHES))
    state = torch.load(tmp_path / f"step={RESUME_AT}.ckpt", weights_only=False)["callbacks"]["LossScaleMonitor"]
    assert state == {"skipped_steps": recipe()[RESUME_AT - 1][1]} == {"skipped_steps": 2}

    resumed, monitor = _resume(tmp_path, 1)
    # the resumed run logs the same values as the uninterrupted one, the count carried on from the checkpoint
    assert resumed == {s: v for s, v in uninterrupted.items() if s >= RESUME_AT}
    assert monitor.state_dict() == {"skipped_steps": len(FORCED)}


def test_logging_cadence_survives_a_resume(tmp_path):
    """With ``log_every_n_steps=3`` the uninterrupted run logs after batches 3 and 6 (steps 2 and 5); resumed after 4
    batches it must log at step 5 as well, like Lightning's own logging does (measured: it logs at step 6)."""
    uninterrupted = _uninterrupted_with_checkpoints(str(tmp_path), 3)
    assert sorted(uninterrupted) == [2, 5]
    resumed, _ = _resume(tmp_path, 3)
    assert resumed == {s: v for s, v in uninterrupted.items() if s >= RESUME_AT}


def test_a_second_fit_on_the_same_trainer_counts_the_checkpoints_skips_once(tmp_path):
    """``fit(ckpt_path="last")`` on the Trainer that wrote the checkpoint: the count goes on from the checkpoint's,
    without the first fit's skips a second time."""
    monitor = LossScaleMonitor(log_every_n_steps=1)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit = trainer(logger=CaptureLogger(), callbacks=[monitor, checkpoints], enable_checkpointing=True, max_epochs=1)
    model = Model()
    fit.fit(model, Positions())
    assert monitor.state_dict() == {"skipped_steps": len(FORCED)}
    fit.fit_loop.max_epochs = 2
    fit.fit(model, Positions(), ckpt_path="last")
    assert monitor.state_dict() == {"skipped_steps": 2 * len(FORCED)}


def test_the_skips_of_lr_find_do_not_carry_into_the_fit_that_follows():
    """``Tuner.lr_find`` trains (and skips steps) on the same Trainer before the fit: the fit's count starts at zero,
    and its scale at the one lr_find restored."""
    from lightning.pytorch.tuner import Tuner

    logger, monitor = CaptureLogger(), LossScaleMonitor(log_every_n_steps=1)
    fit = trainer(logger=logger, callbacks=[monitor], log_every_n_steps=1, max_epochs=1)
    model = Model()
    Tuner(fit).lr_find(model, train_dataloaders=Positions(), num_training=TRAINER_BATCHES, update_attr=False)
    assert int(fit.precision_plugin._recipe.skipped_steps) >= len(FORCED)  # lr_find's own skips
    logger.calls.clear()
    fit.fit(model, Positions())
    assert logger.scale_log() == expected_log(range(TRAINER_BATCHES))
    assert monitor.state_dict() == {"skipped_steps": len(FORCED)}
