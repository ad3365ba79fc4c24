"""The Trainer's side of the oracle: the Lightning classes of the fork or of stock 2.6.6, a Trainer, a fit that
returns a :class:`~amp_oracle.run.Run`.

The Lightning side is built through :func:`lightning_api`, parametrized by the package, so that the very same cells
run against the fork (``lightning``) and against the unpatched ``stock_pytorch_lightning`` 2.6.6 (the negative
control). On ``device="cuda"`` the same fit runs on a GPU (``make gpu-check``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import warnings
from types import SimpleNamespace
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from amp_oracle.run import Run
from amp_oracle.world import (
    Batches,
    autocast_dtype,
    changed_since,
    inf_batch,
    late_inf_batch,
    new_scaler,
    snapshot,
    trainable,
)

#: what the Trainer says about these tiny CPU runs (no workers, few batches, non-resumable loaders, checkpoints loaded
#: with ``weights_only=False``, a CUDA scaler on CPU...), none of it what the tests are about
TRAINER_CHATTER = (
    r".*(num_workers|does not have many workers|log_every_n_steps|dataloader is not resumable"
    r"|callbacks used to create the checkpoint|`weights_only` was not set|CUDA is not available"
    r"|`training_step` returned `None`|Found .* module\(s\) in eval mode).*"
)


@contextlib.contextmanager
def quiet_trainer():
    """Silence :data:`TRAINER_CHATTER` (use it in an autouse fixture)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRAINER_CHATTER)
        yield


#: the fork under test
FORK = "lightning"
#: the unpatched Lightning 2.6.6, the negative control: the import name of its ``lightning.pytorch`` counterpart. Every
#: test of this package reaches stock through this constant, so a rename of the stock package is a one-line change.
STOCK = "stock_pytorch_lightning"
PACKAGES = (FORK, STOCK)


#: why a negative control skips where the stock copy is absent (upstream's own CI, which tests one Lightning)
NO_STOCK = f"the negative control needs the unpatched Lightning 2.6.6 as `{STOCK}` (the fork's `make setup`)"


def _pytorch_package(package: str) -> str:
    if package == FORK:
        return "lightning.pytorch"
    if package == STOCK:
        pytest.importorskip(STOCK, reason=NO_STOCK)
        return STOCK
    raise ValueError(package)


def stock_is_unpatched() -> bool:
    """Whether the negative control is there: the unpatched 2.6.6 under :data:`STOCK`."""
    try:
        stock = importlib.import_module(STOCK)
    except ImportError:
        return False
    return stock.__version__ == "2.6.6"


@functools.cache
def lightning_api(package: str) -> SimpleNamespace:
    """The Lightning classes from ``package``: the fork (:data:`FORK`) or the unpatched copy (:data:`STOCK`)."""
    name = _pytorch_package(package)
    pl = importlib.import_module(name)
    MixedPrecision = importlib.import_module(f"{name}.plugins.precision").MixedPrecision

    class RecipeModule(pl.LightningModule):
        """Holds ``net``; ``configure(net)`` builds the optimizers, ``step(module, batch, batch_idx)`` is the
        ``training_step``; ``inf_at`` / ``late_inf_at`` the batches that inject an inf into their first / a later loss;
        ``amp_dtype`` the autocast dtype the Trainer should use (``None``: none); ``records`` what the step saw."""

        def __init__(
            self, net: nn.Module, configure: Callable, step: Callable, automatic: bool, precision: str
        ) -> None:
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
        """Records the scaler's scale after every batch and whether the trainable parameters changed; :meth:`run`
        makes them a :class:`Run`."""

        def __init__(self) -> None:
            self.scales: list[Optional[float]] = []
            self.changed: list[bool] = []
            self._before: list[torch.Tensor] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self._before = snapshot(trainable(pl_module))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.changed.append(changed_since(self._before, trainable(pl_module)))
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            self.scales.append(None if scaler is None else scaler.get_scale())

        def run(self, net: nn.Module, records: list = (), **fields: Any) -> Run:
            return Run(
                params={name: p.detach().cpu().clone() for name, p in net.named_parameters()},
                scales=None if all(s is None for s in self.scales) else self.scales,
                changed=self.changed,
                records=[r.detach().cpu() if isinstance(r, torch.Tensor) else r for r in records],
                **fields,
            )

    return SimpleNamespace(
        fork=package == FORK,
        pl=pl,
        Trainer=pl.Trainer,
        LightningModule=pl.LightningModule,
        Callback=pl.Callback,
        MixedPrecision=MixedPrecision,
        RecipeModule=RecipeModule,
        Recorder=Recorder,
    )


def make_trainer(
    api: SimpleNamespace,
    precision: str,
    scaler=None,
    callbacks=(),
    watch_misuse: bool = False,
    plugin: Any = None,
    device: str = "cpu",
    **kwargs: Any,
):
    """A one-device trainer (``device``: ``"cpu"`` or ``"cuda"``) for one epoch over the fixed batches. 16-mixed goes
    through an explicit ``MixedPrecision`` with a ``GradScaler`` of the test's own settings (initial scale,
    ``growth_interval``); with ``scaler="lightning"`` through the ``precision`` flag, so that Lightning creates the
    scaler (on a CPU from torch 2.3). ``watch_misuse`` switches the fork's opt-in misuse watch on (stock has none: it
    is not passed there); ``plugin`` reuses a ``MixedPrecision`` another Trainer has."""
    kwargs = {
        "accelerator": "gpu" if device == "cuda" else "cpu",
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
    watch = {"watch_misuse": True} if watch_misuse and api.fork else {}
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    elif precision == "16-mixed" and (scaler != "lightning" or watch):
        scaler = new_scaler(device) if scaler is None else None if scaler == "lightning" else scaler
        kwargs["plugins"] = [api.MixedPrecision("16-mixed", device, scaler=scaler, **watch)]
    else:
        assert scaler in (None, "lightning")
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
    loader: Any = None,
    callbacks: tuple = (),
    **trainer_kwargs: Any,
) -> Run:
    """Train ``net`` for one epoch over ``loader`` (default: the fixed batches) through the Trainer of ``package``
    and return what happened."""
    api = lightning_api(package)
    module_cls = module_cls or api.RecipeModule
    module = module_cls(net, configure, step, automatic, precision)
    recorder = api.Recorder()
    trainer = make_trainer(api, precision, scaler=scaler, callbacks=[recorder, *callbacks], **trainer_kwargs)
    loader = Batches() if loader is None else loader
    trainer.fit(module, train_dataloaders=loader)
    assert len(recorder.changed) == len(loader), "the trainer did not run every batch"
    return recorder.run(module.net, module.records)
