"""Remove each mechanism of the fork and watch a test fail: ``make mutation-check``.

A test that cannot fail is a defect. Each :class:`Mutation` below takes one mechanism out of the fork as installed
(one exact text replacement in one file of the installed ``lightning``) and runs the tests that must catch it. The
mutated copy of the package goes into a temporary folder put first on ``PYTHONPATH``, so the installed fork is never
touched. A mutation whose tests still pass *survived*: the mechanism is untested, and the run fails.

A mutation whose text no longer occurs exactly once is *stale* (the code moved on): the run fails too, and
``tests/tests_forkbuild/test_mutation_check.py`` checks that none is, on every ``make test``.

Example::

    make mutation-check                                  # every mutation (about 8 minutes on 2 cores)
    .venv/bin/python tools/mutation_check.py --only fabric-watch --only cache-clear-after-step
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTORCH_RECIPE = "pytorch/plugins/precision/amp_recipe.py"
FABRIC_RECIPE = "fabric/plugins/precision/amp_recipe.py"
FABRIC_PLUGIN = "fabric/plugins/precision/amp_recipe_precision.py"
FABRIC_WATCH = "fabric/plugins/precision/amp_misuse_watch.py"
PRECISION_TESTS = "tests/tests_pytorch/plugins/precision"
FABRIC_TESTS = "tests/tests_fabric/plugins/precision"


@dataclass(frozen=True)
class Mutation:
    name: str
    #: the mechanism the mutation removes, and the behaviour that must then fail
    removes: str
    #: the file, relative to the installed ``lightning`` package
    path: str
    old: str
    new: str
    #: pytest arguments: the tests that must catch it
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "cache-clear-after-backward",
        "autocast's cache is freed after every backward (patch 0012)",
        PYTORCH_RECIPE,
        "        if self.cache_enabled:\n"
        "            # the graph that needed the cached casts is gone: free them now, as a run without the cache"
        " would\n            torch.clear_autocast_cache()\n",
        "",
        (f"{PRECISION_TESTS}/test_amp_autocast_cache.py",),
    ),
    Mutation(
        "cache-clear-after-step",
        "autocast's cache is cleared after every optimizer step: no stale casts after `opt.step()` (patch 0012)",
        PYTORCH_RECIPE,
        "        if self.cache_enabled:\n"
        "            # the step changed the weights in place: casts cached before it are stale\n"
        "            torch.clear_autocast_cache()\n",
        "",
        (f"{PRECISION_TESTS}/test_amp_autocast_cache.py",),
    ),
    Mutation(
        "cache-off-in-manual-optimization",
        "the cache stays off in manual optimization, where weights may change in place between forwards",
        "pytorch/plugins/precision/amp.py",
        "self.cache_enabled = _AUTOCAST_CACHE_IS_SAFE and not manual",
        "self.cache_enabled = _AUTOCAST_CACHE_IS_SAFE",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and inplace"),
    ),
    Mutation(
        "clip-unscales-first",
        "`self.clip_gradients` unscales before clipping (promise 3)",
        PYTORCH_RECIPE,
        "                self._recipe.unscale(*self._unwrap(optimizer))\n",
        "                pass\n",
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py",),
    ),
    Mutation(
        "unscale-once",
        "unscaling is idempotent: a second unscale in a step cycle does nothing (promise 4)",
        FABRIC_RECIPE,
        "        if stage is OptState.READY:\n            self._torch.unscale_(optimizer)\n",
        "        if True:\n            self._torch.unscale_(optimizer)\n",
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py", f"{FABRIC_TESTS}/test_amp_fabric_recipe.py"),
    ),
    Mutation(
        "update-once-per-iteration",
        "one `scaler.update()` per iteration, after its last step, not after every step (promise 5)",
        FABRIC_RECIPE,
        "        self._skips.record(optimizer, self._torch.found_inf(optimizer), ran=bool(ran))\n",
        "        self._skips.record(optimizer, self._torch.found_inf(optimizer), ran=bool(ran))\n        self._settle()\n",
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py", f"{PRECISION_TESTS}/test_amp_iteration.py"),
    ),
    Mutation(
        "update-after-unscale-without-step",
        "an iteration that unscaled but did not step still updates, so the scale backs off",
        FABRIC_RECIPE,
        "        if self._torch.has_inf_checks():\n            for optimizer in self._candidates():\n",
        "        if self._skips._pending:\n            for optimizer in self._candidates():\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py",),
    ),
    Mutation(
        "checkpoint-mid-iteration",
        "a checkpoint saved mid-iteration leaves the live run alone",
        FABRIC_RECIPE,
        "            include_owed_update = self.phase is IterationPhase.OUTSIDE\n",
        "            include_owed_update = True\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "tests/tests_pytorch/checkpointing/test_amp_resume.py"),
    ),
    Mutation(
        "refuse-mixed-scales",
        "gradients unscaled without a step and then reached by a scaled backward are refused at the step and at"
        " clipping (the accumulation pitfall)",
        FABRIC_RECIPE,
        "            if record.mixed_scales:\n                raise _mixed_scales_error(optimizer)\n",
        "            if False:\n                raise _mixed_scales_error(optimizer)\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and stepped_every_second"),
    ),
    Mutation(
        "watch-unscaled-during-backward",
        "a scaled backward that reaches an optimizer's unscaled, not yet stepped gradients flags them; one that does"
        " not reach them leaves them to step",
        FABRIC_RECIPE,
        "    cleared = not _holds_live_gradients(optimizer)\n",
        "    cleared = True\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "refused_at_the_step"),
    ),
    Mutation(
        "trainer-watch",
        "`loss.backward()` and raw optimizer steps under 16-mixed raise in manual optimization (promise 8)",
        PYTORCH_RECIPE,
        "            self._recipe.watch_unscaled_backward(optimizers)\n",
        "            pass\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and (misuse or raw_optimizer)"),
    ),
    Mutation(
        "fabric-watch",
        "the same under Fabric, for the optimizers `fabric.setup` wraps",
        FABRIC_PLUGIN,
        "            self._recipe.watch_unscaled_backward([wrapper.optimizer])\n",
        "            pass\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "backward or raw"),
    ),
    Mutation(
        "fabric-teardown-unwatches",
        "Fabric's teardown takes the watch's hooks off the parameters",
        FABRIC_RECIPE,
        "            self._scaler_recipe.finish()\n            self._scaler_recipe.unwatch()\n",
        "            self._scaler_recipe.finish()\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "teardown"),
    ),
    Mutation(
        "disabled-scaler-refused",
        "a scaler torch disabled is refused before training",
        FABRIC_RECIPE,
        "    if scaler is None or scaler.is_enabled():\n        return\n",
        "    return\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and (scaler_disabled or cuda_scaler)"),
    ),
    Mutation(
        "zero-dim-inf-checks",
        "fused optimizers get 0-dim inf checks from `ShardedGradScaler` (FSDP + fused)",
        FABRIC_RECIPE,
        "            self._torch.zero_dim_inf_checks(optimizer)\n",
        "            pass\n",
        (f"{PRECISION_TESTS}/test_fsdp_amp_recipe.py",),
    ),
    Mutation(
        "fused-sgd-momentum",
        "fused SGD gets zero momentum buffers before a first step the scaler may skip",
        FABRIC_RECIPE,
        "        _protect_fused_sgd_momentum(optimizer)\n",
        "",
        (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "momentum"),
    ),
    Mutation(
        "no-step-without-gradients",
        "a step with no gradients is a plain step, not torch's bare AssertionError",
        FABRIC_RECIPE,
        "        if not unscales_itself and not self._torch.has_inf_check(optimizer):\n",
        "        if False:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py",),
    ),
    Mutation(
        "collected-optimizer-released",
        "a collected optimizer's torch scaler state leaves its id() at once",
        FABRIC_RECIPE,
        "            self._torch.set_aside_when_collected(optimizer)\n",
        "",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py",),
    ),
    Mutation(
        "autocast-off-outside-forward",
        "`manual_backward`, clipping and the step run with autocast off in manual optimization (promise 1)",
        PYTORCH_RECIPE,
        "        if not _autocast_enabled(self._autocast_device):\n            yield\n            return\n",
        "        yield\n        return\n",
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py",),
    ),
    Mutation(
        "update-when-an-iteration-opens",
        "an update owed by a step outside an iteration is applied when the next one opens",
        FABRIC_RECIPE,
        "        self._settle()\n        self.phase = IterationPhase.INSIDE\n",
        "        self.phase = IterationPhase.INSIDE\n",
        (
            f"{FABRIC_TESTS}/test_grad_scaler_recipe.py",
            f"{PRECISION_TESTS}/test_amp_differential.py",
            "-k",
            "test_fork and on_train_epoch_end or settled_when_the_next_one_starts",
        ),
    ),
    Mutation(
        "fabric-update-before-the-next-backward",
        "outside a marked iteration (Fabric's loop), the owed update is applied before the next loss is scaled",
        FABRIC_RECIPE,
        "        if self.phase is IterationPhase.OUTSIDE and not self._gradients_wait_for_a_step():\n"
        "            self._settle()\n",
        "",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py",),
    ),
    Mutation(
        "users-unscale-through-a-wrapper",
        "`scaler.unscale_(lightning_optimizer)` by the user is read from the scaler: no second unscale (promise 4)",
        FABRIC_RECIPE,
        "        self._torch.adopt(optimizer, aliases)\n",
        "",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "wrapper"),
    ),
    Mutation(
        "dtype-mismatch-advice",
        "the autocast cache's dtype mismatch gets the `cache_enabled=False` advice",
        "pytorch/plugins/precision/amp.py",
        "                if self.cache_enabled and _is_autocast_cache_dtype_mismatch(err):\n",
        "                if False:\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and dtype_mismatch"),
    ),
    Mutation(
        "loss-scale-monitor-per-optimizer-step",
        "`LossScaleMonitor` logs once per optimizer step under gradient accumulation",
        "pytorch/callbacks/loss_scale_monitor.py",
        "        if epoch_loop._should_accumulate():\n            return  #",
        "        if False:\n            return  #",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and loss_scale_monitor"),
    ),
    Mutation(
        "trainer-clip-returns-the-norm",
        "`self.clip_gradients` returns the total norm of the unscaled gradients (patch 0021)",
        "pytorch/core/module.py",
        "        return self.trainer.precision_plugin.clip_gradients(",
        "        self.trainer.precision_plugin.clip_gradients(",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and returns_the_unscaled_norm"),
    ),
    Mutation(
        "schedulers-hold-on-skipped-steps",
        "a step-interval LR scheduler does not advance on a skipped step (patch 0009)",
        "pytorch/loops/training_epoch_loop.py",
        "                    and trainer.precision_plugin.optimizer_step_was_skipped(optimizer, sync=False)\n",
        "                    and False\n",
        (f"{PRECISION_TESTS}/test_amp_skipped_steps.py",),
    ),
    Mutation(
        "fabric-save-carries-the-scale",
        "`fabric.save` stores the scaler's state for a state without the plugin (patch 0019)",
        "fabric/fabric.py",
        "        if precision_state and not self._holds_precision_state(unwrapped_state):\n",
        "        if False:\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "resume"),
    ),
    Mutation(
        "fabric-clip-tolerates-overflow",
        "`fabric.clip_gradients` under a scaler does not raise on an overflow step by default (patch 0020)",
        "fabric/fabric.py",
        '                error_if_nonfinite = getattr(self._precision, "scaler", None) is None\n',
        "                error_if_nonfinite = True\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "clip"),
    ),
    Mutation(
        "fabric-training-iteration",
        "`fabric.training_iteration()` opens an iteration: one update per iteration in a GAN loop (patch 0022)",
        "fabric/fabric.py",
        "        self._precision.training_iteration_start()\n",
        "",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "interleaved"),
    ),
    Mutation(
        "fabric-step-methods-in-precision",
        "a LightningModule's step methods go through `forward` (under the precision's autocast) on one device too",
        "fabric/wrappers.py",
        "            and (self._forward_module != self._original_module or hasattr(self._original_module, item))\n",
        "            and self._forward_module != self._original_module\n",
        ("tests/tests_fabric/test_fabric_lightning_module.py",),
    ),
    Mutation(
        "fabric-step-methods-keep-hasattr",
        "on one device only the step methods the module has are redirected: `hasattr` stays as on stock for the others",
        "fabric/wrappers.py",
        "            and (self._forward_module != self._original_module or hasattr(self._original_module, item))\n",
        "            and (self._forward_module != self._original_module or True)\n",
        ("tests/tests_fabric/test_fabric_lightning_module.py", "-k", "lacks_still_raises"),
    ),
    Mutation(
        "update-after-the-last-optimizer-steps",
        "once every optimizer of the run has stepped, the update follows at once: the scale read after the step shows"
        " a skip, and a second step cycle of one optimizer unscales afresh",
        FABRIC_RECIPE,
        "        if any(o is optimizer for o in optimizers) and all(self.stage(o) is OptState.STEPPED for o in optimizers):\n",
        "        if False:\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "says_whether_it_was_skipped or second_step_cycle"),
    ),
    Mutation(
        "watch-window",
        "the watch for backwards without the scale switches itself off after its first updates: no cost per step"
        " afterwards",
        FABRIC_RECIPE,
        "            if watch is not None and self._updates >= watch.ends_at_update and not watch.accumulations:\n"
        "                self.unwatch()\n",
        "",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "watch_ends"),
    ),
    Mutation(
        "inf-checks-copied",
        "the skip signal and the skip count keep their own copy of each inf check: torch's update sums them into the"
        " first optimizer's, in place (found by the random event sequences)",
        FABRIC_RECIPE,
        "        return sum((f.to(found_infs[0].device) for f in found_infs[1:]), found_infs[0].clone())\n",
        "        return sum((f.to(found_infs[0].device) for f in found_infs[1:]), found_infs[0])\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "survives_the_update"),
    ),
    Mutation(
        "cleared-unscaled-keeps-its-inf-check",
        "an optimizer unscaled and cleared stays unscaled, with its inf check, until a backward reaches it",
        FABRIC_RECIPE,
        "            self._watch_unscaled(optimizer)\n",
        "            if _holds_live_gradients(optimizer):\n                self._watch_unscaled(optimizer)\n"
        "            else:\n                self._restart_step_cycle(optimizer)\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "keep_their_inf_check"),
    ),
    Mutation(
        "refusal-before-any-transition",
        "a scaled backward refused for gradients without the scale is refused before any optimizer changes stage"
        "",
        FABRIC_RECIPE,
        '            self._watch.refuse("the next scaled backward")\n',
        "            pass\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "refused_backward"),
    ),
    Mutation(
        "closures-refused-under-the-scaler",
        "`opt.step(closure)` under an enabled scaler raises as torch does, instead of stepping on scaled gradients"
        "",
        FABRIC_RECIPE,
        '        if kwargs.get("closure") is not None:\n',
        "        if False:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "closure"),
    ),
    Mutation(
        "every-step-unscales",
        "every step goes through the scaler's `unscale_`, whatever the gradients hold (FSDP's all-reduces pair,"
        " the skip of a step whose clip found an inf)",
        FABRIC_RECIPE,
        "        if stage is OptState.READY and self._torch.has_scaled() and not unscales_itself:\n",
        "        if False:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "through_the_scalers_unscale or recorded_by_clipping or shard"),
    ),
    Mutation(
        "zeroed-gradients-of-an-earlier-iteration-step",
        "gradients unscaled in an earlier iteration and zeroed since step as torch steps them",
        FABRIC_RECIPE,
        "            if not _holds_live_gradients(optimizer):\n                # zeroed since",
        "            if False:\n                # zeroed since",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "earlier_iteration_and_zeroed"),
    ),
    Mutation(
        "state-dict-is-pure",
        "the scaler's state for a checkpoint holds the owed update without applying it: a save changes nothing"
        "",
        FABRIC_RECIPE,
        "            self._torch.project_owed_update(state)\n",
        "            self._settle()\n            state = self.scaler.state_dict()\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "a_save_changes_nothing"),
    ),
    Mutation(
        "fabric-save-bare-scaler",
        "a bare `GradScaler` in `fabric.save`'s state is saved as the plugin's state, the owed update included"
        "",
        "fabric/fabric.py",
        "            unwrapped_state = {k: precision_state if v is scaler else v for k, v in unwrapped_state.items()}\n",
        "            pass\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "bare_scaler and owed_update"),
    ),
    Mutation(
        "trainer-teardown-applies-the-owed-update",
        "an update owed by a step in `on_train_epoch_end` is applied when training ends",
        FABRIC_RECIPE,
        "            self._scaler_recipe.finish()\n",
        "",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "on_train_epoch_end"),
    ),
    Mutation(
        "trainer-iteration-ends-on-exception",
        "an exception leaving a training batch ends its iteration: the owed update is kept",
        "pytorch/loops/training_epoch_loop.py",
        "                    finally:\n"
        "                        # an exception ends the iteration too: the update its steps owe is not lost\n"
        "                        trainer.precision_plugin.training_iteration_end()\n",
        "                    except BaseException:\n                        raise\n"
        "                    else:\n                        trainer.precision_plugin.training_iteration_end()\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "exception"),
    ),
    Mutation(
        "fabric-iteration-ends-on-exception",
        "an exception raised in the body of `fabric.training_iteration()` ends the iteration",
        "fabric/fabric.py",
        "        finally:\n"
        "            # an exception raised in the body ends the iteration too: the update its steps owe is not lost\n"
        "            self._precision.training_iteration_end()\n",
        "        except BaseException:\n            raise\n        else:\n            self._precision.training_iteration_end()\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "exception_caught"),
    ),
    Mutation(
        "closure-run-by-the-user-steps",
        "automatic optimization: an `optimizer_step` override that runs the closure and then calls `optimizer.step()`"
        " steps",
        PYTORCH_RECIPE,
        "        steps = not (automatic and loss is None and closure is not do_nothing_closure)\n",
        "        steps = not (automatic and loss is None)\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "runs_the_closure_itself"),
    ),
    Mutation(
        "loss-scale-monitor-counts-this-run",
        "`LossScaleMonitor` counts the skips of its own run: not those of an earlier fit or `lr_find` of the same"
        " Trainer",
        "pytorch/callbacks/loss_scale_monitor.py",
        "        self._skipped_before_run = 0 if self._plugin is None else int(self._plugin._recipe.skipped_steps.item())\n",
        "        self._skipped_before_run = 0\n",
        ("tests/tests_pytorch/callbacks/test_loss_scale_monitor.py", "-k", "second_fit or lr_find"),
    ),
    Mutation(
        "watch-goes-with-its-parameters",
        "the watch holds its optimizers, parameters and their hooks weakly: a collected model takes its hooks along"
        "",
        FABRIC_WATCH,
        "            if optimizer not in self._watched:\n",
        "            self.__dict__.setdefault('_kept', []).append(optimizer)\n            if optimizer not in self._watched:\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "collected_model"),
    ),
    Mutation(
        "pytree-leaf-spec",
        "a leaf's tree spec comes from `treespec_leaf()`, without torch's deprecation warning (patch 0007)",
        "pytorch/utilities/_pytree.py",
        "        return [pytree], treespec_leaf()\n",
        "        return [pytree], LeafSpec()\n",
        ("tests/tests_pytorch/utilities/test_pytree_leaf_spec.py",),
    ),
    Mutation(
        "cpu-16-mixed-is-float16",
        "`precision='16-mixed'` on a CPU gets a CPU gradient scaler where torch has one (patch 0023)",
        "fabric/connector.py",
        "    if _TORCH_GREATER_EQUAL_2_3:\n        rank_zero_info(",
        "    if False:\n        rank_zero_info(",
        (f"{PRECISION_TESTS}/test_cpu_16_mixed.py", f"{FABRIC_TESTS}/test_cpu_16_mixed.py"),
    ),
    Mutation(
        "skip-signal-without-sync",
        "a step whose own `step()` ran was not skipped: telling so reads nothing from the device",
        FABRIC_RECIPE,
        "        if ran and not in_kernel:\n            self._last[optimizer] = False  # not skipped, and nothing to count\n",
        "        if False:\n            self._last[optimizer] = False  # not skipped, and nothing to count\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "device_only"),
    ),
    Mutation(
        "skip-signal-of-fused-optimizers",
        "a fused optimizer's `step()` always runs: its skip is its inf check",
        FABRIC_RECIPE,
        "        if ran and not in_kernel:\n",
        "        if ran:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "device_only"),
    ),
    Mutation(
        "load-consumes-the-owed-update",
        "a load consumes the update owed so far through torch's own `update()`, instead of clearing torch's state",
        FABRIC_RECIPE,
        "        self._settle()\n        self._torch.scaler.load_state_dict(state_dict)\n",
        "        self._torch.scaler.load_state_dict(state_dict)\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "consumes"),
    ),
    Mutation(
        "empty-entries-dropped",
        "an unscale without gradients leaves no entry behind at the iteration's end (torch would refuse the next"
        " unscale, and the recipe would step on scaled gradients)",
        FABRIC_RECIPE,
        "        self._torch.drop_empty()\n",
        "",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "without_gradients_leaves"),
    ),
    Mutation(
        "unscaled-out-of-reach-steps",
        "an optimizer unscaled and not yet stepped may wait while a backward that does not reach it runs (a GAN that"
        " clips each network after its own backward)",
        FABRIC_RECIPE,
        "            self._watch_unscaled(optimizer)\n",
        '            raise RuntimeError("unscaled but did not step")\n',
        ("tests/tests_pytorch/plugins/precision/test_amp_iteration.py", "-k", "gan"),
    ),
    Mutation(
        "skip-signal-hooks-released",
        "the step hooks of the skip signal go when training ends: a raw optimizer kept after the fit pays nothing",
        FABRIC_RECIPE,
        "        self._skips.release()\n        self._records.clear()",
        "        self._records.clear()",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "goes_when_training_ends"),
    ),
    Mutation(
        "watch-per-thread",
        "the misuse watch counts scaled backwards by the Python thread that runs them: a backward without the scale in"
        " another thread of the same run is seen",
        FABRIC_WATCH,
        "        return threading.get_ident() in self._in_flight_per_thread\n",
        "        return self._in_flight > 0\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "same_run"),
    ),
    Mutation(
        "watch-engine-thread-scaled-backward",
        "while a scaled backward runs on an engine thread (a CUDA loss's node), every hook goes by the run's count: no"
        " false error for the CPU parameters of that backward",
        FABRIC_WATCH,
        "        if self._in_flight_on_engine_threads or _on_an_engine_thread():\n",
        "        if _on_an_engine_thread():\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "engines_threads"),
    ),
    Mutation(
        "watch-engine-thread-hook",
        "a hook on an engine thread (CUDA's device threads) goes by the run's count: no false error for a scaled"
        " backward's CUDA parameters",
        FABRIC_WATCH,
        "        if self._in_flight_on_engine_threads or _on_an_engine_thread():\n",
        "        if self._in_flight_on_engine_threads:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "engines_threads"),
    ),
    Mutation(
        "free-check-nothing-scaled",
        "by default, a step or clipping before the scaler scaled any loss raises, naming the backward to call (issue"
        " 27, the free checks)",
        FABRIC_RECIPE,
        "            raise _nothing_scaled_error(optimizer, self._api)\n",
        "            pass\n",
        (f"{PRECISION_TESTS}/test_amp_users_own_scale.py", "-k", "raises_by_default"),
    ),
    Mutation(
        "watch-is-opt-in",
        "the misuse watch runs only when the plugin is asked to (`watch_misuse=True`): the default path puts no hook on"
        " the parameters",
        PYTORCH_RECIPE,
        "        if manual and self.scaler is not None and self.watch_misuse:\n",
        "        if manual and self.scaler is not None:\n",
        (f"{PRECISION_TESTS}/test_amp_users_own_scale.py", "-k", "registers_no_hook or one_scaler_for_two"),
    ),
    Mutation(
        "fit-forgets-its-optimizers",
        "a fit's optimizers are dropped when it ends: a second fit with the same plugin updates after its own"
        " optimizer's step",
        FABRIC_RECIPE,
        "        self._optimizer_wrappers = weakref.WeakSet()\n\n    def training_iteration_start",
        "\n    def training_iteration_start",
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "reused_by_a_second_trainer"),
    ),
    Mutation(
        "clip-after-step-changes-nothing",
        "a clip or unscale of an optimizer that stepped, with no backward since, changes nothing: no second unscale, no"
        " second update",
        FABRIC_RECIPE,
        "        return record.stepped_gradient() is _first_gradient(optimizer)\n",
        "        return False\n",
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "clip_after_the_step"),
    ),
    Mutation(
        "owed-update-waits-for-gradients-of-this-cycle",
        "Fabric's owed update waits while an optimizer that has not stepped holds gradients of this cycle: they never"
        " meet a second scale",
        FABRIC_RECIPE,
        "            if _has_gradients(optimizer):\n                return True\n        return False\n",
        "            pass\n        return False\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_cases.py", "-k", "own_backward or waits_for_its_step or clip_without_a_step"),
    ),
    Mutation(
        "skip-decided-on-the-host",
        "a non-fused step that did not run was skipped: telling so reads nothing from the device",
        FABRIC_RECIPE,
        "        self._last[optimizer] = found_inf if in_kernel else True\n",
        "        self._last[optimizer] = found_inf\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "reads_the_device_only"),
    ),
    Mutation(
        "watch-leaves-no-dummy-thread",
        "the watch tells an engine thread without registering it with `threading` (upstream's zombie-thread check)",
        FABRIC_WATCH,
        "    thread = threading._active.get(threading.get_ident())  # type: ignore[attr-defined]\n",
        "    thread = threading.current_thread()\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "engine"),
    ),
)


def installed_package() -> Path:
    spec = importlib.util.find_spec("lightning")
    if spec is None or spec.origin is None:
        raise SystemExit("mutation-check: `lightning` is not installed in this Python (run `make setup` first)")
    return Path(spec.origin).parent


def stale(package: Path, mutations: tuple[Mutation, ...] = MUTATIONS) -> list[str]:
    """The mutations whose text does not occur exactly once in the installed package."""
    problems = []
    for m in mutations:
        count = (package / m.path).read_text(encoding="utf-8").count(m.old)
        if count != 1:
            problems.append(f"{m.name}: its text occurs {count} times in lightning/{m.path}")
    return problems


def _pytest(tests: tuple[str, ...], pythonpath: str = "") -> tuple[int, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            *tests,
            "-o",
            "addopts=--strict-markers --import-mode=importlib",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    return result.returncode, "\n".join((result.stdout + result.stderr).strip().splitlines()[-3:])


def baseline(mutation: Mutation) -> None:
    """The tests pass on the fork as installed, so a failure under the mutation is the mutation's."""
    returncode, tail = _pytest(mutation.tests)
    if returncode != 0:
        raise SystemExit(f"mutation-check: the tests of {mutation.name} fail without the mutation:\n{tail}")


def run(mutation: Mutation, package: Path, scratch: Path) -> tuple[bool, float, str]:
    """(killed, seconds, the tests' last lines) of one mutation, on a mutated copy of ``package``."""
    copy = scratch / mutation.name / "lightning"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / mutation.path
    target.write_text(target.read_text(encoding="utf-8").replace(mutation.old, mutation.new), encoding="utf-8")
    started = time.perf_counter()
    returncode, tail = _pytest(mutation.tests, pythonpath=str(copy.parent))
    shutil.rmtree(copy.parent)
    if returncode not in (0, 1):
        raise SystemExit(f"mutation-check: the tests of {mutation.name} did not run (exit {returncode}):\n{tail}")
    return returncode == 1, time.perf_counter() - started, tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run this mutation only (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--no-baseline", action="store_true", help="do not first check that each selection passes")
    args = parser.parse_args(argv)
    selected = tuple(m for m in MUTATIONS if not args.only or m.name in args.only)
    if args.list or not selected:
        for m in MUTATIONS:
            print(f"{m.name:40} {m.removes}")
        return 0 if selected else 2
    package = installed_package()
    problems = stale(package, selected)
    if problems:
        print("stale mutations (update tools/mutation_check.py):", *problems, sep="\n  ")
        return 1
    survived, passing = [], set()
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as scratch:
        for m in selected:
            if not args.no_baseline and m.tests not in passing:  # several mutations share a selection: run it once
                baseline(m)
                passing.add(m.tests)
            killed, seconds, tail = run(m, package, Path(scratch))
            print(f"{'killed  ' if killed else 'SURVIVED'} {m.name:40} {seconds:6.1f} s  {m.removes}", flush=True)
            if not killed:
                survived.append(m.name)
                print("    " + tail.replace("\n", "\n    "))
    print(f"{len(selected) - len(survived)} of {len(selected)} mutations killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
