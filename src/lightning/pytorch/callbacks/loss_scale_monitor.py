# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
r"""
Loss Scale Monitor
==================

Logs the gradient scaler's loss scale and the number of optimizer steps it skipped.

"""

from typing import TYPE_CHECKING, Any, Optional

from typing_extensions import override

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

if TYPE_CHECKING:
    from lightning.pytorch.plugins.precision.amp_recipe import _AMPRecipePrecision


class LossScaleMonitor(Callback):
    r"""Log the loss scale of ``precision="16-mixed"`` and how many optimizer steps the gradient scaler skipped.

    The scaler multiplies the loss by a scale before backward so that float16 gradients do not underflow. When the
    gradients overflow (inf/NaN) it skips that optimizer step and halves the scale; after ``growth_interval`` clean
    iterations it doubles it again. A few skipped steps at the start of training are normal; a scale that keeps falling,
    or skipped steps that keep coming, point at a model or a learning rate that produces non-finite values.

    Logged every ``log_every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``; under gradient
    accumulation, automatic or manual, once per step, not per micro-batch), after the batch's scaler update, with
    ``MixedPrecision`` and ``FSDPPrecision`` alike:

    - ``loss_scale``: the scale the next iteration will use;
    - ``skipped_steps``: optimizer steps skipped since the start of training (kept across a resume from checkpoint).

    Reading the scaler synchronises with the device, so it happens only on logging batches.

    Args:
        log_every_n_steps: How often to log, in optimizer steps. ``None`` follows ``Trainer(log_every_n_steps=...)``.

    Raises:
        MisconfigurationException:
            If the Trainer has no logger, or its precision plugin has no gradient scaler (bf16-mixed and 32-bit
            precision never scale the loss nor skip steps).

    Example::

        from lightning.pytorch import Trainer
        from lightning.pytorch.callbacks import LossScaleMonitor

        trainer = Trainer(precision="16-mixed", callbacks=[LossScaleMonitor(log_every_n_steps=10)])

    """

    def __init__(self, log_every_n_steps: Optional[int] = None) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise MisconfigurationException(
                f"`LossScaleMonitor(log_every_n_steps={log_every_n_steps!r})` must be a positive number of batches."
            )
        self.log_every_n_steps = log_every_n_steps
        self.history: dict[str, list[float]] = {"loss_scale": [], "skipped_steps": []}
        self._skipped_before_resume = 0
        # the plugin's count of skipped steps when this run started: it also holds earlier runs of the same Trainer
        # (a `fit` before, `Tuner.lr_find`)
        self._skipped_before_run = 0
        self._plugin: Optional[_AMPRecipePrecision] = None
        self._steps_before_batch = 0

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not trainer.loggers:
            raise MisconfigurationException(
                "Cannot use `LossScaleMonitor` callback with `Trainer` that has no logger: pass a logger to the"
                " Trainer."
            )
        if _scaling_plugin(trainer) is None:
            plugin = trainer.precision_plugin
            precision = getattr(plugin, "precision", "?")
            raise MisconfigurationException(
                f"`LossScaleMonitor` needs a gradient scaler, but the precision plugin {type(plugin).__name__}"
                f" (precision={precision!r}) has none: only float16 mixed precision scales the loss and skips steps."
                " Remove the callback for bf16-mixed and 32-bit training. On a CPU with torch < 2.3,"
                " `precision='16-mixed'` becomes bf16 (that torch has no CPU gradient scaler)."
            )

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        self._steps_before_batch = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if pl_module.automatic_optimization:
            if epoch_loop._should_accumulate():
                return  # under gradient accumulation, once per optimizer step: the scaler updates only then
            # the loop's own counter of stepping batches, restored on resume, keeps the cadence of an uninterrupted run
            due = (epoch_loop._batches_that_stepped + 1) % every == 0
        else:
            # manual optimization counts optimizer steps (`global_step`, restored on resume): a batch that stepped none
            # (accumulating) logs nothing; one that crossed a multiple of `every` logs
            steps = trainer.global_step
            due = steps // every > self._steps_before_batch // every
        if not due:
            return
        stats = self._stats(trainer)
        for key, value in stats.items():
            self.history[key].append(value)
        for logger in trainer.loggers:
            logger.log_metrics(stats, step=epoch_loop._batches_that_stepped)

    def _stats(self, trainer: "pl.Trainer") -> dict[str, float]:
        plugin = _scaling_plugin(trainer)
        assert plugin is not None
        assert plugin.scaler is not None
        return {"loss_scale": float(plugin.scaler.get_scale()), "skipped_steps": float(self._skipped_steps(plugin))}

    def _skipped_steps(self, plugin: Optional["_AMPRecipePrecision"]) -> int:
        skipped = self._skipped_before_resume
        if plugin is not None:
            skipped += int(plugin._recipe.skipped_steps.item()) - self._skipped_before_run
        return skipped

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self._skipped_steps(self._plugin)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._skipped_before_resume = int(state_dict["skipped_steps"])

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # each run counts from zero (a checkpoint it resumes from restores its own count after this)
        self._plugin = _scaling_plugin(trainer)
        self._skipped_before_resume = 0
        self._skipped_before_run = 0 if self._plugin is None else int(self._plugin._recipe.skipped_steps.item())


def _scaling_plugin(trainer: "pl.Trainer") -> Optional["_AMPRecipePrecision"]:
    """The precision plugin if it drives a gradient scaler through the recipe (``MixedPrecision``,
    ``FSDPPrecision``)."""
    from lightning.pytorch.plugins.precision.amp_recipe import _AMPRecipePrecision  # the plugins import the callbacks

    plugin = trainer.precision_plugin
    if isinstance(plugin, _AMPRecipePrecision) and plugin.scaler is not None:
        return plugin
    return None
