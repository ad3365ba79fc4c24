"""Resuming from a checkpoint under 16-mixed continues exactly like the uninterrupted run (promise 9).

Each case trains ``TOTAL`` batches saving a checkpoint after every batch, resumes from chosen ones with
``trainer.fit(model, ckpt_path=...)`` in a fresh ``Trainer`` and model, and requires the end bitwise the uninterrupted
run's (parameters, optimizer, LR scheduler and scaler state) and, batch by batch after the resume, the same scale,
skips and learning rate. A lost piece of state cannot hide: the scale grows every ``GROWTH_INTERVAL = 2`` clean steps
(the growth tracker matters), ``inf`` is forced around the save points, AdamW (unfused and fused) with a step-interval
``StepLR`` moves only on applied steps, in automatic and manual optimization with one or two optimizers.

Stock 2.6.6 restarts a loader without ``state_dict`` when resuming mid-epoch while ``batch_idx`` continues, so the cases
take their data from the global batch index (``trainer.fit_loop.total_batch_idx``, which the checkpoint restores) and
the loader only yields positions. A checkpoint of the unpatched ``stock_pytorch_lightning`` 2.6.6 resumes in the fork
and vice versa, scaler state included.
"""

import functools
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from amp_oracle.torch_features import optimizer
from amp_oracle.trainer import FORK, STOCK, lightning_api, quiet_trainer
from amp_oracle.trainer import make_trainer as shared_make_trainer
from amp_oracle.world import LOW_INIT_SCALE, Positions, inject_inf, mlp, mlp_loss, new_scaler

BATCHES_PER_EPOCH = 4
TOTAL = 10  # 2.5 epochs
#: the scale grows after two applied steps in a row: a resume must restore the growth tracker too
GROWTH_INTERVAL = 2
#: global batch indices whose loss is multiplied by inf
FORCED = (1, 2, 5, 8)
#: resume after this many batches (all mid-epoch but 4 and 8): between two skips in a row, right after them (the scale
#: backed off twice), at the epoch boundary with a growth tracker of 1 (the first step after the resume grows the
#: scale), right after a growth and right before a skip, at the epoch boundary right before a skip
RESUME_AFTER = (2, 3, 4, 5, 8)


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_trainer():
        yield


def batch_for(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of global batch ``index``: a deterministic function of the index alone."""
    gen = torch.Generator().manual_seed(10_000 + index)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)


class UnsizedResumableBatches:
    """Real batches with ``state_dict``/``load_state_dict``, which Lightning saves and restores; no ``__len__``."""

    def __init__(self) -> None:
        self.epoch, self.position, self._resume_at = 0, 0, None

    def __iter__(self):
        if self._resume_at is not None and self._resume_at[1] < BATCHES_PER_EPOCH:
            self.epoch, self.position = self._resume_at
        elif self._resume_at is not None:  # saved after the last batch of an epoch: the next one starts afresh
            self.epoch, self.position = self._resume_at[0] + 1, 0
        elif self.position:  # a new epoch
            self.epoch, self.position = self.epoch + 1, 0
        self._resume_at = None
        while self.position < BATCHES_PER_EPOCH:
            self.position += 1
            yield batch_for(self.epoch * BATCHES_PER_EPOCH + self.position - 1)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = (state["epoch"], state["position"])


class ResumableBatches(UnsizedResumableBatches):
    """A sized resumable loader: Lightning does not prefetch from it, so its saved state is exact."""

    def __len__(self) -> int:
        return BATCHES_PER_EPOCH


@dataclass(frozen=True)
class Case:
    mode: str  # "automatic" or "manual"
    optimizers: int = 1
    fused: bool = False
    forced: tuple[int, ...] = FORCED
    #: train on the loader's batches instead of ``batch_for(total_batch_idx)``
    loader_data: bool = False

    @property
    def automatic(self) -> bool:
        return self.mode == "automatic"

    @property
    def steps_per_batch(self) -> int:
        """``global_step`` counts optimizer step calls: one per optimizer and batch, skipped or not."""
        return self.optimizers

    def __str__(self) -> str:
        return f"{self.mode}-{self.optimizers}opt{'-fused' if self.fused else ''}"


CASES = [
    Case("automatic"),
    Case("automatic", fused=True),
    Case("manual"),
    Case("manual", optimizers=2),
]


def new_module(package: str, case: Case):
    """The oracle's ``RecipeModule`` around ``mlp()``: data by global batch index (or the loader's with
    ``loader_data``), ``inf`` in the forced batches, AdamW with a step-interval ``StepLR`` per optimizer."""

    def training_step(self, batch, batch_idx):
        index = self.trainer.fit_loop.total_batch_idx
        x, y = batch if case.loader_data else batch_for(index)
        loss = inject_inf(mlp_loss(self.net, x, y), index, case.forced)
        if self.automatic_optimization:
            return loss
        opts, schedulers = _as_list(self.optimizers()), _as_list(self.lr_schedulers())
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        for opt, scheduler in zip(opts, schedulers):
            if not opt.step_was_skipped:  # the documented pattern (the fork's signal)
                scheduler.step()
        return None

    def configure(net):
        groups = [net.parameters()] if case.optimizers == 1 else [net[0].parameters(), net[2].parameters()]
        opts = [optimizer(torch.optim.AdamW, params, lr=1e-2, fused=case.fused) for params in groups]
        schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8) for opt in opts]
        if case.automatic:
            return [{"optimizer": opts[0], "lr_scheduler": {"scheduler": schedulers[0], "interval": "step"}}]
        return [opts, schedulers]

    return lightning_api(package).RecipeModule(mlp(), configure, training_step, case.automatic, "16-mixed")


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


@functools.cache
def recorder_class(package: str) -> type:
    class Record(lightning_api(package).Callback):
        """Per batch: where it was, what the scaler and the optimizers did; the scaler's state at the start."""

        def __init__(self) -> None:
            self.rows: list[dict] = []
            self.scaler_at_start = None

        def on_train_start(self, trainer, pl_module):
            self.scaler_at_start = trainer.precision_plugin.scaler.state_dict()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            optimizers = trainer.strategy._lightning_optimizers
            self.rows.append(
                {
                    "index": trainer.fit_loop.total_batch_idx,
                    "epoch": trainer.current_epoch,
                    "batch_idx": batch_idx,
                    "loader_position": int(batch) if isinstance(batch, torch.Tensor) else None,
                    "scale": trainer.precision_plugin.scaler.get_scale(),
                    # stock 2.6.6 has no skip signal
                    "skipped": tuple(o.step_was_skipped for o in optimizers)
                    if hasattr(optimizers[0], "step_was_skipped")
                    else None,
                    "lr": tuple(opt.param_groups[0]["lr"] for opt in trainer.optimizers),
                }
            )

        def column(self, name: str) -> list:
            return [row[name] for row in self.rows]

        def after(self, index: int) -> list[dict]:
            keys = ("index", "scale", "skipped", "lr")
            return [{k: row[k] for k in keys} for row in self.rows if row["index"] >= index]

    return Record


@dataclass
class End:
    """The end of a run: everything that must be bitwise equal."""

    params: dict[str, torch.Tensor]
    optimizers: list[dict]
    schedulers: list[dict]
    scaler: dict
    global_step: int
    trajectory: Any  # the Record


def make_trainer(package: str, case: Case, callbacks=(), **kwargs: Any):
    api = lightning_api(package)
    kwargs = {
        "max_epochs": None,
        "max_steps": TOTAL * case.steps_per_batch,
        # only the ModelCheckpoint a case passes, none by default
        "enable_checkpointing": any(isinstance(cb, api.pl.callbacks.ModelCheckpoint) for cb in callbacks),
        **kwargs,
    }
    scaler = new_scaler(init_scale=LOW_INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    return shared_make_trainer(api, "16-mixed", scaler=scaler, callbacks=callbacks, **kwargs)


def fit(package: str, case: Case, ckpt_path=None, callbacks=(), loader=None, **kwargs: Any) -> End:
    record = recorder_class(package)()
    trainer = make_trainer(package, case, callbacks=[record, *callbacks], **kwargs)
    model = new_module(package, case)
    if loader is None:
        loader = ResumableBatches() if case.loader_data else Positions(BATCHES_PER_EPOCH)
    trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    return End(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        optimizers=[opt.state_dict() for opt in trainer.optimizers],
        schedulers=[config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        scaler=trainer.precision_plugin.scaler.state_dict(),
        global_step=trainer.global_step,
        trajectory=record,
    )


def checkpointing(package: str, dirpath: Path, case: Case):
    return lightning_api(package).pl.callbacks.ModelCheckpoint(
        dirpath=dirpath, filename="{step}", every_n_train_steps=case.steps_per_batch, save_top_k=-1
    )


def checkpoint_after(dirpath: Path, case: Case, batches: int) -> Path:
    return dirpath / f"step={batches * case.steps_per_batch}.ckpt"


def assert_equal_state(actual: Any, expected: Any, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, tensors bitwise (dtype included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), f"{where}: max abs diff {(actual - expected).abs().max().item()}"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            assert_equal_state(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_equal_state(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def assert_same_end(resumed: End, uninterrupted: End, resumed_after: int) -> None:
    assert resumed.global_step == uninterrupted.global_step
    assert_equal_state(resumed.params, uninterrupted.params, "params")
    assert_equal_state(resumed.optimizers, uninterrupted.optimizers, "optimizer")
    assert_equal_state(resumed.schedulers, uninterrupted.schedulers, "scheduler")
    assert resumed.scaler == uninterrupted.scaler
    # and on the way there: the resumed run did batch by batch what the uninterrupted run did
    assert resumed.trajectory.column("index") == list(range(resumed_after, TOTAL))
    assert resumed.trajectory.after(resumed_after) == uninterrupted.trajectory.after(resumed_after)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``case -> (End, checkpoint folder)`` of the uninterrupted run, computed once per case."""
    runs = {}

    def get(case: Case):
        if case not in runs:
            dirpath = tmp_path_factory.mktemp(str(case))
            runs[case] = (fit("lightning", case, callbacks=[checkpointing("lightning", dirpath, case)]), dirpath)
        return runs[case]

    return get


def _sanity(end: End, case: Case) -> None:
    """The uninterrupted run exercises what the resume cases claim to cover."""
    assert end.trajectory.column("index") == list(range(TOTAL))
    assert end.trajectory.column("skipped") == [(i in case.forced,) * case.optimizers for i in range(TOTAL)]
    assert end.scaler["growth_interval"] == GROWTH_INTERVAL


@pytest.mark.parametrize("resume_after", RESUME_AFTER)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_resume_is_bitwise_the_uninterrupted_run(case, resume_after, uninterrupted):
    reference, dirpath = uninterrupted(case)
    _sanity(reference, case)
    checkpoint = torch.load(checkpoint_after(dirpath, case, resume_after), weights_only=False)
    # the scaler state in the checkpoint is the one after the saved batch's single update
    assert checkpoint["MixedPrecision"]["scale"] == reference.trajectory.rows[resume_after - 1]["scale"]
    assert checkpoint["global_step"] == resume_after * case.steps_per_batch

    resumed = fit("lightning", case, ckpt_path=checkpoint_after(dirpath, case, resume_after))
    assert resumed.trajectory.scaler_at_start == checkpoint["MixedPrecision"]
    assert_same_end(resumed, reference, resume_after)
    if resume_after % BATCHES_PER_EPOCH:
        # mid-epoch: stock Lightning restarted the non-resumable loader from its first position;
        # only because the data is keyed by the global batch index is this the same run
        assert resumed.trajectory.rows[0]["loader_position"] == 0
        assert resumed.trajectory.rows[0]["batch_idx"] == resume_after % BATCHES_PER_EPOCH
    else:
        assert resumed.trajectory.rows[0]["epoch"] == resume_after // BATCHES_PER_EPOCH
        assert resumed.trajectory.rows[0]["batch_idx"] == 0


def test_save_points_cover_the_scaler_state(uninterrupted):
    """The checkpoints the resume cases start from hold backed-off scales and a non-zero growth tracker."""
    case = CASES[0]
    _, dirpath = uninterrupted(case)
    states = {
        k: torch.load(checkpoint_after(dirpath, case, k), weights_only=False)["MixedPrecision"] for k in RESUME_AFTER
    }
    assert states[2]["scale"] == LOW_INIT_SCALE / 2  # batch 1 skipped, batch 2 will be
    assert states[3]["scale"] == LOW_INIT_SCALE / 4  # two skips in a row
    assert states[4]["scale"] == LOW_INIT_SCALE / 4
    assert states[4]["_growth_tracker"] == 1
    assert states[5]["scale"] == LOW_INIT_SCALE / 2
    assert states[5]["_growth_tracker"] == 0
    assert {state["growth_interval"] for state in states.values()} == {GROWTH_INTERVAL}


@pytest.mark.parametrize("lost", ["growth tracker", "scaler state"])
def test_a_lost_scaler_state_would_be_caught(lost, uninterrupted):
    """Self-check of the harness: a resume that forgot the growth tracker, or the whole scaler state, fails it."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    case = CASES[0]
    reference, dirpath = uninterrupted(case)
    load = MixedPrecision.load_state_dict

    def forgetful_load(self, state):
        if lost == "growth tracker":
            load(self, {**state, "_growth_tracker": 0})

    with mock.patch.object(MixedPrecision, "load_state_dict", forgetful_load):
        resumed = fit("lightning", case, ckpt_path=checkpoint_after(dirpath, case, 4))  # tracker 1 there
    # the wrong scale shows in the scaler's state and trajectory, and already in the optimizer state: fp16 gradients
    # that are small enough to round differently at a different scale
    with pytest.raises(AssertionError):
        assert_same_end(resumed, reference, 4)
    assert resumed.scaler != reference.scaler


def test_stateful_loader_resumes_in_place(tmp_path):
    """With a sized resumable loader, the model can train on the loader's own batches and still resume bitwise."""
    case = Case("automatic", loader_data=True)
    reference = fit("lightning", case, callbacks=[checkpointing("lightning", tmp_path, case)])
    _sanity(reference, case)
    for resume_after in (2, 4):
        resumed = fit("lightning", case, ckpt_path=checkpoint_after(tmp_path, case, resume_after))
        assert_same_end(resumed, reference, resume_after)
    saved = torch.load(checkpoint_after(tmp_path, case, 2), weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 2}]


def test_unsized_resumable_loader_is_saved_one_batch_ahead(tmp_path):
    """Stock 2.6.6 prefetches one batch from a loader without ``__len__``: its state, saved after batch 2, is after
    batch 3, and a resumed run would skip batch 2 (why the sized loader above is the one that resumes in place)."""
    case = Case("automatic", loader_data=True)
    fit(
        "lightning",
        case,
        loader=UnsizedResumableBatches(),
        max_steps=3,
        callbacks=[checkpointing("lightning", tmp_path, case)],
    )
    saved = torch.load(checkpoint_after(tmp_path, case, 2), weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 3}]


@pytest.mark.parametrize(
    ("first", "resumed_at"),
    [
        ({"max_epochs": 1, "max_steps": -1}, (1, BATCHES_PER_EPOCH)),
        ({"max_steps": 4}, (1, BATCHES_PER_EPOCH)),
        ({"max_steps": 6}, (2, 2)),
    ],
    ids=["max_epochs=1", "max_steps=4", "max_steps=6"],
)
def test_save_checkpoint_after_fit(first, resumed_at, tmp_path):
    """``trainer.save_checkpoint`` after a finished ``fit``, then ``fit(ckpt_path=...)`` to ``TOTAL`` batches: stock
    2.6.6 stores the epoch as finished, continues ``batch_idx`` but numbers the epochs from the stored counter (after a
    full epoch it first runs a batch with ``batch_idx == len(loader)``); the steps are unchanged, so data keyed by the
    global batch index resumes bitwise."""
    case = CASES[0]
    reference = fit("lightning", case)
    record = recorder_class("lightning")()
    trainer = make_trainer("lightning", case, callbacks=[record], **first)
    trainer.fit(new_module("lightning", case), train_dataloaders=Positions(BATCHES_PER_EPOCH))
    trainer.save_checkpoint(tmp_path / "first.ckpt")
    done = len(record.rows)
    assert done == (BATCHES_PER_EPOCH if first["max_steps"] == -1 else first["max_steps"])

    resumed = fit("lightning", case, ckpt_path=tmp_path / "first.ckpt")
    assert_same_end(resumed, reference, done)
    # where stock 2.6.6 puts the first resumed batch, against the uninterrupted run
    first_resumed, same_in_reference = resumed.trajectory.rows[0], reference.trajectory.rows[done]
    assert (first_resumed["epoch"], first_resumed["batch_idx"]) == resumed_at
    assert (same_in_reference["epoch"], same_in_reference["batch_idx"]) == divmod(done, BATCHES_PER_EPOCH)


# ----------------------------------------------------------------------------------------------------------------------
# checkpoints of the unpatched stock_pytorch_lightning 2.6.6 and of the fork
# ----------------------------------------------------------------------------------------------------------------------

#: no skip before the save point (stock would have moved its scheduler on it), one after it
COMPAT = Case("automatic", forced=(5,))
COMPAT_SAVE_AFTER = 3  # the growth tracker is 1 there


@pytest.fixture(scope="module")
def compat_runs(tmp_path_factory):
    """Uninterrupted runs of ``COMPAT`` with per-batch checkpoints, by stock and by the fork."""
    runs = {}
    for package in (STOCK, FORK):
        dirpath = tmp_path_factory.mktemp(package)
        runs[package] = (fit(package, COMPAT, callbacks=[checkpointing(package, dirpath, COMPAT)]), dirpath)
    return runs


def test_checkpoints_of_stock_and_fork_have_the_same_layout(compat_runs):
    checkpoints = {
        package: torch.load(checkpoint_after(dirpath, COMPAT, COMPAT_SAVE_AFTER), weights_only=False)
        for package, (_, dirpath) in compat_runs.items()
    }
    stock, fork = checkpoints[STOCK], checkpoints[FORK]
    assert stock.keys() == fork.keys()
    assert stock["MixedPrecision"] == fork["MixedPrecision"]
    assert fork["MixedPrecision"]["_growth_tracker"] == 1
    # before the first skip stock and fork train alike: the saved prefix is the same
    assert_equal_state(fork["state_dict"], stock["state_dict"], "state_dict")
    assert_equal_state(fork["optimizer_states"], stock["optimizer_states"], "optimizer_states")
    assert fork["lr_schedulers"] == stock["lr_schedulers"]


@pytest.mark.parametrize(("saved_by", "resumed_by"), [(STOCK, FORK), (FORK, STOCK)])
def test_resume_across_stock_and_fork(saved_by, resumed_by, compat_runs):
    """A checkpoint of one resumes in the other, scaler state included, and continues as the resuming package's own
    uninterrupted run (they differ after the skip at batch 5: stock moves its scheduler on it)."""
    _, dirpath = compat_runs[saved_by]
    reference, _ = compat_runs[resumed_by]
    checkpoint = checkpoint_after(dirpath, COMPAT, COMPAT_SAVE_AFTER)
    resumed = fit(resumed_by, COMPAT, ckpt_path=checkpoint)
    assert resumed.trajectory.scaler_at_start == torch.load(checkpoint, weights_only=False)["MixedPrecision"]
    assert_same_end(resumed, reference, COMPAT_SAVE_AFTER)


def test_fork_checkpoint_with_loss_scale_monitor_resumes_in_stock(tmp_path):
    """The fork's ``LossScaleMonitor`` adds a callback state that stock does not know: stock warns and resumes."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning.pytorch.callbacks import LossScaleMonitor

    fork = make_trainer(
        "lightning", COMPAT, max_steps=COMPAT_SAVE_AFTER, logger=CSVLogger(tmp_path), callbacks=[LossScaleMonitor()]
    )
    fork.fit(new_module("lightning", COMPAT), train_dataloaders=Positions(BATCHES_PER_EPOCH))
    fork.save_checkpoint(tmp_path / "fork.ckpt")
    assert "LossScaleMonitor" in torch.load(tmp_path / "fork.ckpt", weights_only=False)["callbacks"]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(STOCK, COMPAT, ckpt_path=tmp_path / "fork.ckpt")
    assert any("LossScaleMonitor" in str(w.message) for w in caught)
    assert resumed.global_step == TOTAL
    assert resumed.trajectory.scaler_at_start["scale"] == LOW_INIT_SCALE * 2  # grown once in 3 clean steps
