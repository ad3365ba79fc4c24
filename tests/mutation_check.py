"""Remove each mechanism of the fork and watch a test fail: ``make mutation-check``.

A test that cannot fail is a defect. Each :class:`Mutation` below takes one mechanism out of the fork as installed
(one exact text replacement in one file of the installed ``lightning``) and runs the tests that must catch it. The
mutated copy of the package goes into a temporary folder put first on ``PYTHONPATH``, so the installed fork is never
touched. A mutation whose tests still pass *survived*: the mechanism is untested, and the run fails.

A mutation whose text no longer occurs exactly once is *stale* (the code moved on): the run fails too, and
``tests/tests_forkbuild/test_mutation_check.py`` checks that none is, on every ``make test``.

Example::

    make mutation-check                                  # every mutation (about 6 minutes on 2 cores)
    .venv/bin/python tests/mutation_check.py --only fabric-watch --only carry-of-unscaled-gradients
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
TORCH_ADAPTER = "fabric/plugins/precision/amp_torch_scaler.py"
PRECISION_TESTS = "tests/tests_pytorch/plugins/precision"
FABRIC_TESTS = "tests/tests_fabric/plugins/precision"


@dataclass(frozen=True)
class Mutation:
    """One exact replacement of ``old`` by ``new`` in ``path`` (relative to the installed ``lightning`` package), and
    ``tests``, the pytest arguments that must then fail; ``removes`` says which mechanism goes, and what must fail."""

    name: str
    path: str
    tests: tuple[str, ...]
    removes: str
    old: str
    new: str


MUTATIONS = (
    # ---- autocast, the Trainer's plugin ----------------------------------------------------------------------------
    Mutation("cache-clear-after-backward", PYTORCH_RECIPE, (f"{PRECISION_TESTS}/test_amp_autocast_cache.py",),
        "autocast's cache is freed after every backward",
        "        if self.cache_enabled:\n"
        "            # the graph that needed the cached casts is gone: free them now, as a run without the cache "
        "would\n"
        "            torch.clear_autocast_cache()\n", ""),
    Mutation("cache-clear-after-step", PYTORCH_RECIPE, (f"{PRECISION_TESTS}/test_amp_autocast_cache.py",),
        "autocast's cache is cleared after every optimizer step: no stale casts after `opt.step()`",
        "        if self.cache_enabled:\n"
        "            # the step changed the weights in place: casts cached before it are stale\n"
        "            torch.clear_autocast_cache()\n", ""),
    Mutation("cache-off-in-manual-optimization", "pytorch/plugins/precision/amp.py",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and inplace"),
        "the cache stays off in manual optimization, where weights may change in place between forwards",
        "self.cache_enabled = _AUTOCAST_CACHE_IS_SAFE and not manual", "self.cache_enabled = _AUTOCAST_CACHE_IS_SAFE"),
    Mutation("dtype-mismatch-advice", "pytorch/plugins/precision/amp.py",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and dtype_mismatch"),
        "the autocast cache's dtype mismatch gets the `cache_enabled=False` advice",
        "                if self.cache_enabled and _is_autocast_cache_dtype_mismatch(err):\n",
        "                if False:\n"),
    Mutation("autocast-off-outside-forward", TORCH_ADAPTER,
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py", "-k", "autocast_off"),
        "`manual_backward`, clipping and the step run with autocast off (torch's own guard) in manual optimization",
        "_autocast_off = torch._C._DisableAutocast\n", "_autocast_off = __import__('contextlib').nullcontext\n"),
    Mutation("closure-forward-under-autocast", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and closure"),
        "a closure passed to `opt.step(closure)` in manual optimization runs its forward under autocast again",
        "            closure = partial(self._in_forward_context, closure)\n", "            pass\n"),
    Mutation("a-replaced-scaler-gets-its-recipe", FABRIC_PLUGIN,
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "replaced"),
        "a scaler replaced after the fit's setup (a callback's `on_train_start`) is the one the fit drives",
        "its recipe comes next\n"
        "                self._scaler_recipe = None\n",
        "its recipe comes next\n"
        "                pass\n"),
    # ---- the Trainer's plugin around the recipe --------------------------------------------------------------------
    Mutation("clip-unscales-first", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py", "-k", "matches_the_pytorch_amp_recipe and clip"),
        "`self.clip_gradients` unscales before clipping",
        "                recipe.unscale(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else "
        "optimizer)\n", "                pass\n"),
    Mutation("trainer-step-unscales-before-the-hooks", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "matrix and AdamW"),
        "the Trainer unscales before `on_before_optimizer_step` and its clipping, so they see true gradients",
        "            recipe.unscale(optimizer, before_step=True)\n", "            pass\n"),
    Mutation("closure-run-by-the-user-steps", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "runs_the_closure_itself"),
        "automatic optimization: an `optimizer_step` override that runs the closure and then calls "
        "`optimizer.step()` steps",
        "        steps = not (automatic and loss is None and closure is not do_nothing_closure)\n",
        "        steps = not (automatic and loss is None)\n"),
    Mutation("trainer-tracks-its-optimizers", FABRIC_PLUGIN,
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and two_optimizers_one_backward"),
        "the Trainer's and Fabric's optimizer wrappers declare the fit's optimizers to the recipe: several "
        "optimizers fed by one backward get one update, after the last step",
        "            self._recipe.track(wrapper.optimizer, wrapper)\n", "            pass\n"),
    Mutation("trainer-compares-reach-marks-after-backward", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "backward_onto_gradients_unscaled"),
        "the Trainer's backward asks the recipe which unscaled gradients it reached (mixed scales)",
        "        if recipe is not None and recipe.reach_marks:\n"
        "            recipe.after_backward()\n", ""),
    Mutation("fabric-compares-reach-marks-after-backward", FABRIC_PLUGIN,
        (f"{FABRIC_TESTS}/test_amp_fabric_cases.py", "-k", "clipped_gradients_that_did_not_step"),
        "Fabric's backward asks the recipe which unscaled gradients it reached (mixed scales)",
        "        if recipe.reach_marks:\n"
        "            recipe.after_backward()\n", ""),
    Mutation("fabric-clip-unscales-first", FABRIC_PLUGIN, (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "clip"),
        "`fabric.clip_gradients` unscales before clipping", "        recipe.unscale(optimizer)\n", "        pass\n"),
    # ---- the update rule -------------------------------------------------------------------------------------------
    Mutation("rule-a-update-after-every-fit-optimizer-stepped", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k",
            "says_whether_it_was_skipped or second_step_cycle or stepped_twice_per_batch"),
        "rule (a): once every optimizer of the fit has stepped since the last update, the update follows at once "
        "(the scale read after the step shows a skip; a critic stepped several times updates after each step)",
        "                if other.stepped_in != self._cycle and other.optimizer() is not None:\n"
        "                    return output\n", "                return output\n"),
    Mutation("rule-a-waits-for-every-fit-optimizer", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "fed_by_one_backward"),
        "rule (a): the update waits for the last optimizer of the fit to step: several optimizers fed by one "
        "backward get one update, after the last step",
        "                if other.stepped_in != self._cycle and other.optimizer() is not None:\n",
        "                if False:\n"),
    Mutation("empty-fit-updates-after-each-step", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "without_declared_optimizers"),
        "with no optimizer declared for the fit, each step gets its update right after it, as in stock Lightning",
        "        elif self._fit:\n"
        "            return output\n",
        "        else:\n"
        "            return output\n"),
    Mutation("rule-b-update-before-the-next-backward", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "interleaved or update_count"),
        "rule (b): the owed update is applied before the next scaled backward, always (Fabric's loop, an interleaved "
        "GAN, a critic stepped n times)",
        "        if self._owed:\n"
        "            self.settle()\n"
        "        elif self._torch.recorded():",
        "        if False:\n"
        "            self.settle()\n"
        "        elif self._torch.recorded() and not self._owed:"),
    Mutation("rule-b-a-clip-alone-owes-no-update", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_fabric_cases.py", "-k", "clip_without_a_step_does_not_update"),
        "rule (b): gradients unscaled and not stepped (a clip without a step) wait for their step: no update before "
        "the next backward, one update per iteration as in torch's loop",
        "            if marks:\n"
        "                self._cycle += 1\n",
        "            if False:\n"
        "                self._cycle += 1\n"),
    Mutation("rule-b-cleared-unscaled-gradients-update", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "unscaled_then_cleared"),
        "rule (b): an optimizer unscaled and not stepped whose gradients were cleared gets the update before the "
        "next backward, as torch's loop (`unscale_`, `zero_grad`, `update`)",
        "                    if not _has_gradients(optimizer):\n"
        "                        marks = []\n",
        "                    if False:\n"
        "                        marks = []\n"),
    Mutation("cycle-starts-at-a-backward-owing-nothing", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "earlier_stepped_optimizer_holds_new_gradients"),
        "a backward that owes no update starts a new cycle: an optimizer that stepped without gradients before it (a "
        "plain step, owing nothing) has not stepped in the cycle its gradients start",
        "            self._cycle += 1  # steps without gradients owe nothing",
        "            pass  # steps without gradients owe nothing"),
    Mutation("cycle-starts-at-a-backward-after-a-clip", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_recipe_mechanisms.py", "-k", "plain_step_before_a_backward_after_a_clip"),
        "a backward after a clip without a step (no update owed) starts a new cycle too: an optimizer that stepped "
        "without gradients before it has not stepped in the cycle its gradients start",
        "            if marks:\n"
        "                self._cycle += 1\n",
        "            if marks:\n"
        "                pass\n"),
    Mutation("rule-c-iteration-end-settles", FABRIC_PLUGIN,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", f"{PRECISION_TESTS}/test_amp_skipped_steps.py"),
        "rule (c): the iteration's end applies the owed update (an iteration that unscaled but did not step backs "
        "off)", "            recipe.settle()\n", "            pass\n"),
    Mutation("iteration-start-counts-a-backward", FABRIC_PLUGIN,
        (f"{PRECISION_TESTS}/test_amp_user_loops.py", "-k", "plugins_scaler"),
        "a Trainer's iteration start counts as a backward the recipe cannot see (the user's own "
        "`scaler.scale(loss).backward()`): a clip after it is not \"right after the last step\", it unscales",
        "                recipe.backwards += 1\n", "                pass\n"),
    Mutation("trainer-teardown-applies-the-owed-update", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "on_train_epoch_end"),
        "the end of the fit applies the owed update (a step in `on_train_epoch_end`)",
        "        self.settle()\n"
        "        for record in list(self._records.values()):\n",
        "        for record in list(self._records.values()):\n"),
    Mutation("fit-forgets-its-optimizers", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "reused_by_a_second_trainer"),
        "a fit's optimizers are dropped when it ends: a second fit with the same plugin updates after its own "
        "optimizer's step",
        "        self._fit = []\n"
        "\n"
        "    def scale(",
        "        pass\n"
        "\n"
        "    def scale("),
    Mutation("users-own-inf-check-owes-an-update", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "users_own_unscale_owes"),
        "an inf check recorded by the user's own `scaler.unscale_` (or a clip without a step) calls for the update "
        "at a settle",
        "        if self._torch.recorded():\n"
        "            self._update()\n",
        "        if self._owed:\n"
        "            self._update()\n"),
    Mutation("collected-optimizer-leaves-the-fit", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "collected_optimizer_leaves_the_fit"),
        "a collected optimizer of the fit is not waited for: the others still update after their steps",
        "                if other.stepped_in != self._cycle and other.optimizer() is not None:\n",
        "                if other.stepped_in != self._cycle:\n"),
    Mutation("records-go-with-their-optimizers", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "records_go_with_their_optimizers"),
        "an optimizer's record (its skip signal, its hook's handle) goes when the optimizer is collected: a new "
        "optimizer that CPython gives the same `id()` starts afresh",
        "    records.pop(ref, None)  # the optimizer went", "    pass  # the optimizer went"),
    Mutation("fit-drops-collected-records", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "records_go_with_their_optimizers"),
        "a fit's list of optimizers drops the collected ones when another is tracked: k-fold with one Fabric keeps "
        "one", "self._fit = [r for r in self._fit if r.optimizer() is not None] + [record]",
        "self._fit = self._fit + [record]"),
    # ---- unscale and step ------------------------------------------------------------------------------------------
    Mutation("users-own-unscale-is-read", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "idempotent or wrapper_is_read"),
        "the user's own `scaler.unscale_(opt)` (or a step since the update) is torch's stage, read: no second unscale",
        "        if self._torch.stage(optimizer, record.wrappers)[0] is not OptState.READY:\n"
        "            return",
        "        if False:\n"
        "            return"),
    Mutation("clip-after-step-changes-nothing", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "clip_after_the_step"),
        "a clip or unscale of an optimizer right after its step (no scaled backward since) changes nothing: no "
        "second unscale, no second update, the true norm",
        "        if record.stepped_at == self.backwards or record.unscaled_in == self._cycle:\n",
        "        if record.unscaled_in == self._cycle:\n"),
    Mutation("unscaled-in-this-cycle-only", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "one_optimizer_updates_right_after_each_step"),
        "the recipe's own unscale is taken as done only within its update cycle: a clip in a later cycle unscales "
        "again",
        " or record.unscaled_in == self._cycle:\n"
        "            return",
        " or record.unscaled_in >= 0:\n"
        "            return"),
    Mutation("step-reads-the-recipes-unscale-of-this-cycle", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "applied_before_a_backward_when_no_gradients_wait"),
        "a step takes the recipe's own unscale as done only within its update cycle: a later step without gradients "
        "is a plain step, a sharded scaler's rank unscales", "                if record.unscaled_in == self._cycle\n",
        "                if record.unscaled_in >= 0\n"),
    Mutation("a-second-step-on-the-same-gradients", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "second_step_on_the_gradients"),
        "a step right after the optimizer's step (no scaled backward since) steps again on the same true gradients, "
        "skipped if the first was: no second unscale, no torch error",
        "        if record.stepped_at == self.backwards:  # again", "        if False:  # again"),
    Mutation("no-unscale-without-gradients", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "optimizer_without_gradients"),
        "an unscale of an optimizer without gradients (clipping on a batch without backward) leaves torch no entry",
        "        if self._torch.sharded or _has_gradients(optimizer):\n"
        "            self._unscale(optimizer)\n",
        "        if True:\n"
        "            self._unscale(optimizer)\n"),
    Mutation("sharded-scaler-always-unscales", FABRIC_RECIPE, (f"{FABRIC_TESTS}/test_fsdp_precision_ranks.py",),
        "under `ShardedGradScaler` every rank unscales, with gradients or without: its all-reduces stay paired",
        "        if self._torch.sharded or _has_gradients(optimizer):\n"
        "            self._unscale(optimizer)\n",
        "        if _has_gradients(optimizer):\n"
        "            self._unscale(optimizer)\n"),
    Mutation("sharded-scaler-always-steps-through-the-scaler", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_fsdp_precision_ranks.py",),
        "under `ShardedGradScaler` a rank without gradients still unscales before its step: the all-reduces stay "
        "paired", "                if self._torch.sharded:  # every rank unscales",
        "                if False:  # every rank unscales"),
    Mutation("plain-step-without-gradients", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and (without_gradients or zeroed_grads)"),
        "a step with no gradients is a plain step, not torch's bare AssertionError",
        "                elif not _has_gradients(optimizer):\n"
        "                    holder = None",
        "                elif False:\n"
        "                    holder = None"),
    Mutation("nothing-scaled-error-at-unscale", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_users_own_scale.py", "-k", "raises_by_default"),
        "a clip (an unscale) before the scaler scaled any loss raises, naming the backward to call (torch's "
        "AssertionError turned into the recipe's error)",
        "error:\n"
        "            if not self._torch.has_scaled():\n",
        "error:\n"
        "            if False:\n"),
    Mutation("nothing-scaled-error", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "nothing_scaled_raises_by_default and step"),
        "a step before the scaler scaled any loss raises, naming the backward to call (torch's AssertionError turned "
        "into the recipe's error)",
        "error:\n"
        "                        if not self._torch.has_scaled():\n",
        "error:\n"
        "                        if False:\n"),
    Mutation("closures-refused-under-the-scaler", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "closure"),
        "`opt.step(closure)` under an enabled scaler raises as torch does, instead of stepping on scaled gradients",
        "        if kwargs.get(\"closure\") is not None:\n", "        if False:\n"),
    Mutation("fused-sgd-momentum", FABRIC_RECIPE, (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "momentum"),
        "fused SGD gets zero momentum buffers before a first step the scaler may skip",
        "                if in_kernel and isinstance(optimizer, SGD):\n"
        "                    _protect_fused_sgd_momentum(optimizer)\n", ""),
    Mutation("fused-sgd-dampening-refused", TORCH_ADAPTER, (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "dampening"),
        "fused SGD with dampening, which zero buffers cannot make exact, is refused before any step",
        "        if group[\"dampening\"] != 0:\n", "        if False:\n"),
    Mutation("unscales-itself-refused-at-clip", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "cannot_be_clipped"),
        "clipping an optimizer that unscales inside its own `step()` (a `grad_scaler` argument) raises instead of "
        "unscaling its gradients twice",
        "            if not before_step:\n"
        "                raise _unscales_itself_error(optimizer)\n",
        "            if False:\n"
        "                raise _unscales_itself_error(optimizer)\n"),
    Mutation("fused-with-sharded-scaler-steps-on-the-host", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_fsdp_amp_recipe.py", "-k", "fused"),
        "a fused optimizer under `ShardedGradScaler` (1-element inf checks its kernel cannot take) steps as "
        "`scaler.step` would, decided on the host",
        "        if holder is optimizer and not (in_kernel and self._torch.sharded):\n",
        "        if holder is optimizer:\n"),
    # ---- the user's own unscale through a wrapper -------------------------------------------------------------------
    Mutation("wrapper-step-without-scaler-step", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "wrapper"),
        "a step after the user's `scaler.unscale_(wrapper)` steps as `scaler.step` would, on the wrapper's entry: no "
        "second unscale", "        if holder is optimizer and not (in_kernel and self._torch.sharded):\n",
        "        if not (in_kernel and self._torch.sharded):\n"),
    Mutation("wrappers-tracked", FABRIC_RECIPE, (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "wrapper"),
        "the recipe keeps each tracked optimizer's wrappers, which a user may hand to `scaler.unscale_`",
        "            record.wrappers.append(weakref.ref(wrapper))\n", "            pass\n"),
    Mutation("adapter-reads-the-wrappers-entry", TORCH_ADAPTER,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "wrapper"),
        "the adapter reads torch's stage under a wrapper's id when the user unscaled through it",
        "                if wrapper is not None and (state := states.get(id(wrapper))) is not None:\n",
        "                if False:\n"),
    # ---- gradients that would mix two scales ------------------------------------------------------------------------
    Mutation("mark-unscaled-before-a-backward", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "refused_at_that_backward"),
        "before a scaled backward, the gradients of optimizers unscaled and not stepped are marked (their versions)",
        "                self.reach_marks = marks\n", "                pass\n"),
    Mutation("reach-marks-read-versions", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "two_networks_each_clipped or refused_at_that_backward"),
        "the reach marks hold each gradient's version counter: a backward that accumulates into unscaled gradients "
        "in place is seen", "(weakref.ref(p.grad), p.grad._version)", "(weakref.ref(p.grad), 0)"),
    Mutation("mixed-scales-detected", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "backward_onto_gradients_unscaled"),
        "a scaled backward that wrote into gradients unscaled and not stepped (two scales mixed) is refused after it",
        " and _written(optimizer, versions):\n", " and False:\n"),
    Mutation("reach-marks-compare-identity", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "identity_not_by_value"),
        "a gradient tensor a backward replaced (out of place) counts as written, compared by identity, never by value",
        "        elif mark[0]() is not p.grad or mark[1] != p.grad._version:\n",
        "        elif mark[1] != p.grad._version:\n"),
    Mutation("trainer-unscale-gradients", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "unscale_gradients_unscales_once"),
        "the Trainer's `unscale_gradients` unscales (once per update, whoever asks first)",
        "            self._recipe.unscale(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else "
        "optimizer)\n"
        "\n"
        "    @override\n"
        "    def optimizer_step_was_skipped",
        "            pass\n"
        "\n"
        "    @override\n"
        "    def optimizer_step_was_skipped"),
    Mutation("unscaled-out-of-reach-steps", FABRIC_RECIPE, (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "gan"),
        "unscaled gradients a backward did not reach (their versions unchanged) may still step: a GAN that clips "
        "each network after its own backward", " and _written(optimizer, versions):\n", " and True:\n"),
    # ---- the carry: gradients that wait move into the new scale ----------------------------------------------------
    Mutation("carry-of-waiting-gradients", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "gradients_that_wait_are_carried"),
        "the carry: at an update, gradients that wait for their step (`READY`) are multiplied by new/old scale",
        "self._torch.scale() if unscaled else self._torch.scale() / old_scale)",
        "self._torch.scale() if unscaled else old_scale / old_scale)"),
    Mutation("carry-of-unscaled-gradients", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "carried_to_its_end"),
        "the carry: at an update, gradients unscaled and not stepped (`UNSCALED`, which the update makes `READY`) "
        "are multiplied by the new scale", "self._torch.scale() if unscaled else self._torch.scale() / old_scale)",
        "old_scale / old_scale if unscaled else self._torch.scale() / old_scale)"),
    Mutation("carry-skips-optimizers-that-stepped", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_recipe_mechanisms.py", "-k", "optimizer_that_stepped"),
        "the carry leaves the gradients of optimizers that stepped in the cycle alone: they are true gradients",
        "            if optimizer is not None and record.stepped_in != self._cycle:\n",
        "            if optimizer is not None:\n"),
    # ---- the skip signal -------------------------------------------------------------------------------------------
    Mutation("skip-signal-step-hook", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_skipped_steps.py", "-k", "exactly_on_forced_overflows"),
        "a non-fused step's skip is whether its `step()` ran (a step post-hook): decided on the host, no device read",
        "if not in_kernel and record.step_hook is None:", "if False:"),
    Mutation("skip-signal-of-fused-optimizers", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "skip"),
        "a fused optimizer's `step()` always runs: its skip is its inf check",
        "skipped = self._torch.found_inf(holder) if in_kernel else not self._step_ran", "skipped = not self._step_ran"),
    Mutation("fused-skip-read-only-when-asked", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "host_reads"),
        "a fused optimizer's inf check is read from the device only when someone asks: no host read per step",
        "        if isinstance(skipped, Tensor):\n",
        "        if isinstance(skipped, Tensor) and skipped.item() >= 0:\n"),
    Mutation("fused-skips-counted-on-the-device", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "skip_count"),
        "the fused optimizers' skips add up in one running count on the device",
        "self._fused_skipped = skipped.gt(0).int() + self._fused_skipped", "self._fused_skipped = skipped.gt(0).int()"),
    Mutation("inf-checks-copied", TORCH_ADAPTER,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "survives_the_update"),
        "the skip signal keeps its own copy of a fused optimizer's inf check: torch's update sums into the first "
        "optimizer's, in place", "found_inf = found_infs[0].clone()\n", "found_inf = found_infs[0]\n"),
    Mutation("skip-signal-hooks-released", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "end_fit"),
        "the step hooks of the skip signal go when the fit ends: a raw optimizer kept after the fit pays nothing",
        "            if record.step_hook is not None:\n"
        "                record.step_hook.remove()\n",
        "            if False:\n"
        "                record.step_hook.remove()\n"),
    Mutation("schedulers-hold-on-skipped-steps", "pytorch/loops/training_epoch_loop.py",
        (f"{PRECISION_TESTS}/test_amp_skipped_steps.py",),
        "a step-interval LR scheduler does not advance on a skipped step, fused optimizers included",
        "                    and trainer.precision_plugin.optimizer_step_was_skipped(optimizer)\n",
        "                    and False\n"),
    Mutation("a-batch-without-a-step-was-not-skipped", FABRIC_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_skipped_steps.py", "-k", "batch_without_step"),
        "a batch of automatic optimization that does not step (`training_step` returned None) forgets the last "
        "step's skip: a step-interval scheduler does not depend on the batch before",
        "        if record is not None:\n"
        "            record.last_skip = False\n",
        "        if record is not None:\n"
        "            pass\n"),
    Mutation("loss-scale-monitor-per-optimizer-step", "pytorch/callbacks/loss_scale_monitor.py",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and loss_scale_monitor"),
        "`LossScaleMonitor` logs once per optimizer step under gradient accumulation",
        "            if epoch_loop._should_accumulate():\n"
        "                return  #",
        "            if False:\n"
        "                return  #"),
    Mutation("loss-scale-monitor-manual-per-optimizer-step", "pytorch/callbacks/loss_scale_monitor.py",
        ("tests/tests_pytorch/callbacks/test_loss_scale_monitor.py", "-k", "manual_accumulation"),
        "`LossScaleMonitor` logs once per optimizer step in manual optimization too, where a batch that accumulates "
        "steps none", "            due = steps // every > self._steps_before_batch // every\n",
        "            due = (epoch_loop._batches_that_stepped + 1) % every == 0\n"),
    Mutation("loss-scale-monitor-counts-this-run", "pytorch/callbacks/loss_scale_monitor.py",
        ("tests/tests_pytorch/callbacks/test_loss_scale_monitor.py", "-k", "second_fit or lr_find"),
        "`LossScaleMonitor` counts the skips of its own run: not those of an earlier fit or `lr_find` of the same "
        "Trainer",
        "        self._skipped_before_run = 0 if self._plugin is None else "
        "int(self._plugin._recipe.skipped_steps.item())\n", "        self._skipped_before_run = 0\n"),
    # ---- checkpoints -----------------------------------------------------------------------------------------------
    Mutation("checkpoint-mid-iteration", FABRIC_PLUGIN,
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and checkpoint"),
        "a checkpoint saved mid-iteration holds the scale the iteration used and leaves the live run alone",
        "include_owed_update=not self._in_iteration", "include_owed_update=True"),
    Mutation("state-dict-is-pure", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "a_save_changes_nothing"),
        "the scaler's state for a checkpoint holds the owed update without applying it: a save changes nothing",
        "            self._torch.project_owed_update(state)\n",
        "            self.settle()\n"
        "            state = self.scaler.state_dict()\n"),
    Mutation("load-consumes-the-owed-update", FABRIC_RECIPE,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "consumes"),
        "a load applies the update owed so far through torch's own `update()` first",
        "        self.settle()\n"
        "        self.scaler.load_state_dict(state_dict)\n", "        self.scaler.load_state_dict(state_dict)\n"),
    Mutation("recipe-pickles-without-the-fit", FABRIC_RECIPE, (f"{FABRIC_TESTS}/test_amp_recipe_pickle.py",),
        "a pickled plugin (launchers, `ddp_spawn`) leaves the fit, hooks and weak references behind",
        "\"_records\": {}, \"_fit\": [], ", "\"_records\": {}, "),
    Mutation("disabled-scaler-refused", TORCH_ADAPTER,
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and (scaler_disabled or cuda_scaler)"),
        "a scaler torch disabled is refused before training",
        "    if scaler is None or scaler.is_enabled():\n"
        "        return\n", "    return\n"),
    # ---- the opt-in misuse watch -----------------------------------------------------------------------------------
    Mutation("watch-is-opt-in", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_users_own_scale.py", "-k", "registers_no_hook or one_scaler_for_two"),
        "the misuse watch runs only when the plugin is asked to (`watch_misuse=True`): the default path puts no hook "
        "on the parameters", "        if manual and self.scaler is not None and self.watch_misuse:\n",
        "        if manual and self.scaler is not None:\n"),
    Mutation("trainer-watch", PYTORCH_RECIPE,
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and (misuse or raw_optimizer)"),
        "with the watch on, `loss.backward()` and raw optimizer steps under 16-mixed raise in manual optimization",
        "            self._recipe.watch_unscaled_backward(optimizers)\n", "            pass\n"),
    Mutation("fabric-watch", FABRIC_PLUGIN, (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "backward or raw"),
        "the same under Fabric, for the optimizers `fabric.setup` wraps",
        "            self._recipe.watch_unscaled_backward([wrapper.optimizer])\n", "            pass\n"),
    Mutation("fabric-teardown-unwatches", FABRIC_WATCH, (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "teardown"),
        "the end of the fit takes the watch's hooks off the parameters",
        "        super().end_fit()\n"
        "        self.unwatch()\n", "        super().end_fit()\n"),
    Mutation("watch-refuses-at-unscale", FABRIC_WATCH,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "loss_backward_instead"),
        "with the watch on, an unscale (a clip) of an optimizer holding gradients of a backward without the scale "
        "raises",
        "        self.refuse(f\"`{type(optimizer).__name__}`'s unscale or step\", optimizer)\n"
        "        super().unscale(optimizer, before_step)\n", "        super().unscale(optimizer, before_step)\n"),
    Mutation("watch-refuses-at-step", FABRIC_WATCH,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "loss_backward_instead"),
        "with the watch on, a step of an optimizer holding gradients of a backward without the scale raises",
        "        self.refuse(f\"`{type(optimizer).__name__}`'s unscale or step\", optimizer)\n"
        "        return super().step(optimizer, **kwargs)\n", "        return super().step(optimizer, **kwargs)\n"),
    Mutation("watch-window", FABRIC_WATCH, (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "watch_ends"),
        "the watch switches itself off after its first updates: no cost per step afterwards",
        "        if self.watch is not None and self.updates >= self.ends_at_update and not self.accumulations:\n"
        "            self.unwatch()\n", ""),
    Mutation("watch-knows-the-recipes-own-steps", FABRIC_WATCH,
        (f"{FABRIC_TESTS}/test_amp_recipe_mechanisms.py", "-k", "second_step_on_the_same_gradients"),
        "with the watch on, the recipe's own `optimizer.step()` (a step again on true gradients, a step after the "
        "user's unscale through a wrapper) is not taken for a raw step",
        "        self._recipe_steps.add(id(optimizer))  # the recipe's own step",
        "        pass  # the recipe's own step"),
    Mutation("watch-goes-with-its-parameters", FABRIC_WATCH,
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "collected_model"),
        "the watch holds its optimizers, parameters and their hooks weakly: a collected model takes its hooks along",
        "            if optimizer not in self._watched:\n",
        "            self.__dict__.setdefault('_kept', []).append(optimizer)\n"
        "            if optimizer not in self._watched:\n"),
    Mutation("watch-counts-scaled-backwards", FABRIC_WATCH,
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "watch"),
        "the misuse watch takes what accumulates while a scaled backward of its run is in flight for scaled gradients",
        "    if watch is not None and not watch._in_flight:\n", "    if watch is not None:\n"),
    # ---- Fabric -----------------------------------------------------------------------------------------------------
    Mutation("fabric-save-carries-the-scale", "fabric/fabric.py",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "resume"),
        "`fabric.save` stores the scaler's state for a state without the plugin",
        "        if precision_state and not self._holds_precision_state(unwrapped_state):\n", "        if False:\n"),
    Mutation("fabric-save-bare-scaler", "fabric/fabric.py",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "bare_scaler and owed_update"),
        "a bare `GradScaler` in `fabric.save`'s state is saved as the plugin's state, the owed update included",
        "            unwrapped_state = {k: precision_state if v is scaler else v for k, v in "
        "unwrapped_state.items()}\n", "            pass\n"),
    Mutation("fabric-clip-tolerates-overflow", "fabric/fabric.py",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "clip"),
        "`fabric.clip_gradients` under a scaler does not raise on an overflow step by default",
        "                error_if_nonfinite = getattr(self._precision, \"scaler\", None) is None\n",
        "                error_if_nonfinite = True\n"),
    Mutation("trainer-iteration-ends-on-exception", "pytorch/loops/training_epoch_loop.py",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "exception_leaving"),
        "an exception leaving a training batch ends its iteration: the owed update is kept",
        "                    finally:\n"
        "                        # an exception ends the iteration too: the update its steps owe is not lost\n"
        "                        precision_plugin.training_iteration_end()\n",
        "                    except BaseException:\n"
        "                        raise\n"
        "                    else:\n"
        "                        precision_plugin.training_iteration_end()\n"),
    Mutation("fabric-step-methods-in-precision", "fabric/wrappers.py",
        ("tests/tests_fabric/test_fabric_lightning_module.py",),
        "a LightningModule's step methods go through `forward` (under the precision's autocast) on one device too",
        "            and (self._forward_module != self._original_module or hasattr(self._original_module, item))\n",
        "            and self._forward_module != self._original_module\n"),
    Mutation("fabric-step-methods-keep-hasattr", "fabric/wrappers.py",
        ("tests/tests_fabric/test_fabric_lightning_module.py", "-k", "lacks_still_raises"),
        "on one device only the step methods the module has are redirected: `hasattr` stays as on stock for the "
        "others",
        "            and (self._forward_module != self._original_module or hasattr(self._original_module, item))\n",
        "            and (self._forward_module != self._original_module or True)\n"),
    # ---- other patches ---------------------------------------------------------------------------------------------
    Mutation("trainer-clip-returns-the-norm", "pytorch/core/module.py",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and returns_the_unscaled_norm"),
        "`self.clip_gradients` returns the total norm of the unscaled gradients",
        "        return self.trainer.precision_plugin.clip_gradients(",
        "        self.trainer.precision_plugin.clip_gradients("),
    Mutation("pytree-leaf-spec", "pytorch/utilities/_pytree.py",
        ("tests/tests_pytorch/utilities/test_pytree_leaf_spec.py",),
        "a leaf's tree spec comes from `treespec_leaf()`, without torch's deprecation warning",
        "        return [pytree], treespec_leaf()\n", "        return [pytree], LeafSpec()\n"),
    Mutation("cpu-16-mixed-is-float16", "fabric/connector.py",
        (f"{PRECISION_TESTS}/test_cpu_16_mixed.py", f"{FABRIC_TESTS}/test_cpu_16_mixed.py"),
        "`precision='16-mixed'` on a CPU gets a CPU gradient scaler where torch has one",
        "    if _TORCH_GREATER_EQUAL_2_3:\n"
        "        rank_zero_info(",
        "    if False:\n"
        "        rank_zero_info("),

)


def installed_package() -> Path:
    spec = importlib.util.find_spec("lightning")
    if spec is None or spec.origin is None:
        raise SystemExit("mutation-check: `lightning` is not installed in this Python (run `make setup` first)")
    return Path(spec.origin).parent


def stale(package: Path, mutations: tuple[Mutation, ...] = MUTATIONS) -> list[str]:
    """The mutations whose text does not occur exactly once in the installed package."""
    counts = ((m, (package / m.path).read_text(encoding="utf-8").count(m.old)) for m in mutations)
    return [f"{m.name}: its text occurs {n} times in lightning/{m.path}" for m, n in counts if n != 1]


def _pytest(tests: tuple[str, ...], pythonpath: str = "") -> tuple[int, str]:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests,
               "-o", "addopts=--strict-markers --import-mode=importlib"]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    return result.returncode, "\n".join((result.stdout + result.stderr).strip().splitlines()[-3:])


def union(mutations: tuple[Mutation, ...]) -> tuple[str, ...]:
    """One pytest selection of every test the mutations run, and no other: each selection's ``-k`` expression applies
    to its own files, named by their module's file name (a keyword of each test in it)."""
    paths: dict[str, None] = {}
    terms: dict[str, None] = {}
    for m in mutations:
        args, expression = list(m.tests), None
        if "-k" in args:
            at = args.index("-k")
            expression = args[at + 1]
            del args[at : at + 2]
        for path in args:
            paths[path] = None
            module = Path(path).name
            terms[module if expression is None else f"({module} and ({expression}))"] = None
    return (*paths, "-k", " or ".join(terms))


def baseline(mutations: tuple[Mutation, ...]) -> None:
    """The tests pass on the fork as installed, so a failure under a mutation is the mutation's: all of them in one run
    (a pytest start per selection would cost as much as the mutations), each selection on its own only to name the
    mutation whose tests fail."""
    if _pytest(union(mutations))[0] == 0:
        return
    for mutation in mutations:
        returncode, tail = _pytest(mutation.tests)
        if returncode != 0:
            raise SystemExit(f"mutation-check: the tests of {mutation.name} fail without the mutation:\n{tail}")
    raise SystemExit("mutation-check: the tests fail without a mutation when run together (not one by one)")


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
        print("stale mutations (update tests/mutation_check.py):", *problems, sep="\n  ")
        return 1
    if not args.no_baseline:
        baseline(selected)
    survived = []
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as scratch:
        for m in selected:
            killed, seconds, tail = run(m, package, Path(scratch))
            print(f"{'killed  ' if killed else 'SURVIVED'} {m.name:40} {seconds:6.1f} s  {m.removes}", flush=True)
            if not killed:
                survived.append(m.name)
                print("    " + tail.replace("\n", "\n    "))
    print(f"{len(selected) - len(survived)} of {len(selected)} mutations killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
