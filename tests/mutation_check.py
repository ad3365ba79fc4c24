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
    # ---- autocast, the Trainer's plugin ----------------------------------------------------------------------------
    Mutation(
        "cache-clear-after-backward",
        "autocast's cache is freed after every backward",
        PYTORCH_RECIPE,
        "        if self.cache_enabled:\n"
        "            # the graph that needed the cached casts is gone: free them now, as a run without the cache"
        " would\n            torch.clear_autocast_cache()\n",
        "",
        (f"{PRECISION_TESTS}/test_amp_autocast_cache.py",),
    ),
    Mutation(
        "cache-clear-after-step",
        "autocast's cache is cleared after every optimizer step: no stale casts after `opt.step()`",
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
        "dtype-mismatch-advice",
        "the autocast cache's dtype mismatch gets the `cache_enabled=False` advice",
        "pytorch/plugins/precision/amp.py",
        "                if self.cache_enabled and _is_autocast_cache_dtype_mismatch(err):\n",
        "                if False:\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and dtype_mismatch"),
    ),
    Mutation(
        "autocast-off-outside-forward",
        "`manual_backward`, clipping and the step run with autocast off (torch's own guard) in manual optimization",
        TORCH_ADAPTER,
        "_autocast_off = torch._C._DisableAutocast\n",
        "_autocast_off = __import__('contextlib').nullcontext\n",
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py", "-k", "autocast_off"),
    ),
    Mutation(
        "closure-forward-under-autocast",
        "a closure passed to `opt.step(closure)` in manual optimization runs its forward under autocast again",
        PYTORCH_RECIPE,
        "            closure = partial(self._in_forward_context, closure)\n",
        "            pass\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and closure"),
    ),
    Mutation(
        "a-replaced-scaler-gets-its-recipe",
        "a scaler replaced after the fit's setup (a callback's `on_train_start`) is the one the fit drives",
        FABRIC_PLUGIN,
        "its recipe comes next\n                self._scaler_recipe = None\n",
        "its recipe comes next\n                pass\n",
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "replaced"),
    ),
    # ---- the Trainer's plugin around the recipe --------------------------------------------------------------------
    Mutation(
        "clip-unscales-first",
        "`self.clip_gradients` unscales before clipping",
        PYTORCH_RECIPE,
        "                recipe.unscale(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else"
        " optimizer)\n",
        "                pass\n",
        (f"{PRECISION_TESTS}/test_amp_manual_recipe.py", "-k", "matches_the_pytorch_amp_recipe and clip"),
    ),
    Mutation(
        "trainer-step-unscales-before-the-hooks",
        "the Trainer unscales before `on_before_optimizer_step` and its clipping, so they see true gradients",
        PYTORCH_RECIPE,
        "            recipe.unscale(optimizer, before_step=True)\n",
        "            pass\n",
        (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "matrix and AdamW"),
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
        "trainer-tracks-its-optimizers",
        "the Trainer's and Fabric's optimizer wrappers declare the fit's optimizers to the recipe: several optimizers"
        " fed by one backward get one update, after the last step",
        FABRIC_PLUGIN,
        "            self._recipe.track(wrapper.optimizer, wrapper)\n",
        "            pass\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and two_optimizers_one_backward"),
    ),
    Mutation(
        "trainer-compares-reach-marks-after-backward",
        "the Trainer's backward asks the recipe which unscaled gradients it reached (mixed scales)",
        PYTORCH_RECIPE,
        "        if recipe is not None and recipe.reach_marks:\n            recipe.after_backward()\n",
        "",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "backward_onto_gradients_unscaled"),
    ),
    Mutation(
        "fabric-compares-reach-marks-after-backward",
        "Fabric's backward asks the recipe which unscaled gradients it reached (mixed scales)",
        FABRIC_PLUGIN,
        "        if recipe.reach_marks:\n            recipe.after_backward()\n",
        "",
        (f"{FABRIC_TESTS}/test_amp_fabric_cases.py", "-k", "clipped_gradients_that_did_not_step"),
    ),
    Mutation(
        "fabric-clip-unscales-first",
        "`fabric.clip_gradients` unscales before clipping",
        FABRIC_PLUGIN,
        "        recipe.unscale(optimizer)\n",
        "        pass\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "clip"),
    ),
    # ---- the update rule -------------------------------------------------------------------------------------------
    Mutation(
        "rule-a-update-after-every-fit-optimizer-stepped",
        "rule (a): once every optimizer of the fit has stepped since the last update, the update follows at once (the"
        " scale read after the step shows a skip; a critic stepped several times updates after each step)",
        FABRIC_RECIPE,
        "                if other.stepped_in != self._cycle and other.optimizer() is not None:\n"
        "                    return output\n",
        "                return output\n",
        (
            f"{PRECISION_TESTS}/test_amp_iteration.py",
            "-k",
            "says_whether_it_was_skipped or second_step_cycle or stepped_twice_per_batch",
        ),
    ),
    Mutation(
        "rule-a-waits-for-every-fit-optimizer",
        "rule (a): the update waits for the last optimizer of the fit to step: several optimizers fed by one backward"
        " get"
        " one update, after the last step",
        FABRIC_RECIPE,
        "                if other.stepped_in != self._cycle and other.optimizer() is not None:\n",
        "                if False:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "fed_by_one_backward"),
    ),
    Mutation(
        "empty-fit-updates-after-each-step",
        "with no optimizer declared for the fit, each step gets its update right after it, as in stock Lightning",
        FABRIC_RECIPE,
        "        elif self._fit:\n            return output\n",
        "        else:\n            return output\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "without_declared_optimizers"),
    ),
    Mutation(
        "rule-b-update-before-the-next-backward",
        "rule (b): the owed update is applied before the next scaled backward, always (Fabric's loop, an interleaved"
        " GAN,"
        " a critic stepped n times)",
        FABRIC_RECIPE,
        "        if self._owed:\n            self.settle()\n        elif self._torch.recorded():",
        "        if False:\n            self.settle()\n        elif self._torch.recorded() and not self._owed:",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "interleaved or update_count"),
    ),
    Mutation(
        "rule-b-a-clip-alone-owes-no-update",
        "rule (b): gradients unscaled and not stepped (a clip without a step) wait for their step: no update before the"
        " next backward, one update per iteration as in torch's loop",
        FABRIC_RECIPE,
        "            if marks:\n                self._cycle += 1\n",
        "            if False:\n                self._cycle += 1\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_cases.py", "-k", "clip_without_a_step_does_not_update"),
    ),
    Mutation(
        "rule-b-cleared-unscaled-gradients-update",
        "rule (b): an optimizer unscaled and not stepped whose gradients were cleared gets the update before the next"
        " backward, as torch's loop (`unscale_`, `zero_grad`, `update`)",
        FABRIC_RECIPE,
        "                    if not _has_gradients(optimizer):\n                        marks = []\n",
        "                    if False:\n                        marks = []\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "unscaled_then_cleared"),
    ),
    Mutation(
        "cycle-starts-at-a-backward-owing-nothing",
        "a backward that owes no update starts a new cycle: an optimizer that stepped without gradients before it (a"
        " plain"
        " step, owing nothing) has not stepped in the cycle its gradients start",
        FABRIC_RECIPE,
        "            self._cycle += 1  # steps without gradients owe nothing",
        "            pass  # steps without gradients owe nothing",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "earlier_stepped_optimizer_holds_new_gradients"),
    ),
    Mutation(
        "cycle-starts-at-a-backward-after-a-clip",
        "a backward after a clip without a step (no update owed) starts a new cycle too: an optimizer that stepped"
        " without"
        " gradients before it has not stepped in the cycle its gradients start",
        FABRIC_RECIPE,
        "            if marks:\n                self._cycle += 1\n",
        "            if marks:\n                pass\n",
        (f"{FABRIC_TESTS}/test_amp_recipe_mechanisms.py", "-k", "plain_step_before_a_backward_after_a_clip"),
    ),
    Mutation(
        "rule-c-iteration-end-settles",
        "rule (c): the iteration's end applies the owed update (an iteration that unscaled but did not step backs off)",
        FABRIC_PLUGIN,
        "            recipe.settle()\n",
        "            pass\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", f"{PRECISION_TESTS}/test_amp_skipped_steps.py"),
    ),
    Mutation(
        "iteration-start-counts-a-backward",
        "a Trainer's iteration start counts as a backward the recipe cannot see (the user's own"
        " `scaler.scale(loss).backward()`): a clip after it is not \"right after the last step\", it unscales",
        FABRIC_PLUGIN,
        "                recipe.backwards += 1\n",
        "                pass\n",
        (f"{PRECISION_TESTS}/test_amp_user_loops.py", "-k", "plugins_scaler"),
    ),
    Mutation(
        "trainer-teardown-applies-the-owed-update",
        "the end of the fit applies the owed update (a step in `on_train_epoch_end`)",
        FABRIC_RECIPE,
        "        self.settle()\n        for record in list(self._records.values()):\n",
        "        for record in list(self._records.values()):\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "on_train_epoch_end"),
    ),
    Mutation(
        "fit-forgets-its-optimizers",
        "a fit's optimizers are dropped when it ends: a second fit with the same plugin updates after its own"
        " optimizer's step",
        FABRIC_RECIPE,
        "        self._fit = []\n\n    def scale(",
        "        pass\n\n    def scale(",
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "reused_by_a_second_trainer"),
    ),
    Mutation(
        "users-own-inf-check-owes-an-update",
        "an inf check recorded by the user's own `scaler.unscale_` (or a clip without a step) calls for the update at a"
        " settle",
        FABRIC_RECIPE,
        "        if self._torch.recorded():\n            self._update()\n",
        "        if self._owed:\n            self._update()\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "users_own_unscale_owes"),
    ),
    Mutation(
        "collected-optimizer-leaves-the-fit",
        "a collected optimizer of the fit is not waited for: the others still update after their steps",
        FABRIC_RECIPE,
        "                if other.stepped_in != self._cycle and other.optimizer() is not None:\n",
        "                if other.stepped_in != self._cycle:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "collected_optimizer_leaves_the_fit"),
    ),
    Mutation(
        "records-go-with-their-optimizers",
        "an optimizer's record (its skip signal, its hook's handle) goes when the optimizer is collected: a new"
        " optimizer"
        " that CPython gives the same `id()` starts afresh",
        FABRIC_RECIPE,
        "    records.pop(ref, None)  # the optimizer went",
        "    pass  # the optimizer went",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "records_go_with_their_optimizers"),
    ),
    Mutation(
        "fit-drops-collected-records",
        "a fit's list of optimizers drops the collected ones when another is tracked: k-fold with one Fabric keeps one",
        FABRIC_RECIPE,
        "self._fit = [r for r in self._fit if r.optimizer() is not None] + [record]",
        "self._fit = self._fit + [record]",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "records_go_with_their_optimizers"),
    ),
    # ---- unscale and step ------------------------------------------------------------------------------------------
    Mutation(
        "users-own-unscale-is-read",
        "the user's own `scaler.unscale_(opt)` (or a step since the update) is torch's stage, read: no second unscale",
        FABRIC_RECIPE,
        "        if self._torch.stage(optimizer, record.wrappers)[0] is not OptState.READY:\n            return",
        "        if False:\n            return",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "idempotent or wrapper_is_read"),
    ),
    Mutation(
        "clip-after-step-changes-nothing",
        "a clip or unscale of an optimizer right after its step (no scaled backward since) changes nothing: no second"
        " unscale, no second update, the true norm",
        FABRIC_RECIPE,
        "        if record.stepped_at == self.backwards or record.unscaled_in == self._cycle:\n",
        "        if record.unscaled_in == self._cycle:\n",
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "clip_after_the_step"),
    ),
    Mutation(
        "unscaled-in-this-cycle-only",
        "the recipe's own unscale is taken as done only within its update cycle: a clip in a later cycle unscales"
        " again",
        FABRIC_RECIPE,
        " or record.unscaled_in == self._cycle:\n            return",
        " or record.unscaled_in >= 0:\n            return",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "one_optimizer_updates_right_after_each_step"),
    ),
    Mutation(
        "step-reads-the-recipes-unscale-of-this-cycle",
        "a step takes the recipe's own unscale as done only within its update cycle: a later step without gradients"
        " is a"
        " plain step, a sharded scaler's rank unscales",
        FABRIC_RECIPE,
        "                if record.unscaled_in == self._cycle\n",
        "                if record.unscaled_in >= 0\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "applied_before_a_backward_when_no_gradients_wait"),
    ),
    Mutation(
        "a-second-step-on-the-same-gradients",
        "a step right after the optimizer's step (no scaled backward since) steps again on the same true gradients,"
        " skipped"
        " if the first was: no second unscale, no torch error",
        FABRIC_RECIPE,
        "        if record.stepped_at == self.backwards:  # again",
        "        if False:  # again",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "second_step_on_the_gradients"),
    ),
    Mutation(
        "no-unscale-without-gradients",
        "an unscale of an optimizer without gradients (clipping on a batch without backward) leaves torch no entry",
        FABRIC_RECIPE,
        "        if self._torch.sharded or _has_gradients(optimizer):\n            self._unscale(optimizer)\n",
        "        if True:\n            self._unscale(optimizer)\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "optimizer_without_gradients"),
    ),
    Mutation(
        "sharded-scaler-always-unscales",
        "under `ShardedGradScaler` every rank unscales, with gradients or without: its all-reduces stay paired",
        FABRIC_RECIPE,
        "        if self._torch.sharded or _has_gradients(optimizer):\n            self._unscale(optimizer)\n",
        "        if _has_gradients(optimizer):\n            self._unscale(optimizer)\n",
        (f"{FABRIC_TESTS}/test_fsdp_precision_ranks.py",),
    ),
    Mutation(
        "sharded-scaler-always-steps-through-the-scaler",
        "under `ShardedGradScaler` a rank without gradients still unscales before its step: the all-reduces stay"
        " paired",
        FABRIC_RECIPE,
        "                if self._torch.sharded:  # every rank unscales",
        "                if False:  # every rank unscales",
        (f"{FABRIC_TESTS}/test_fsdp_precision_ranks.py",),
    ),
    Mutation(
        "plain-step-without-gradients",
        "a step with no gradients is a plain step, not torch's bare AssertionError",
        FABRIC_RECIPE,
        "                elif not _has_gradients(optimizer):\n                    holder = None",
        "                elif False:\n                    holder = None",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and (without_gradients or zeroed_grads)"),
    ),
    Mutation(
        "nothing-scaled-error-at-unscale",
        "a clip (an unscale) before the scaler scaled any loss raises, naming the backward to call (torch's"
        " AssertionError turned into the recipe's error)",
        FABRIC_RECIPE,
        "error:\n            if not self._torch.has_scaled():\n",
        "error:\n            if False:\n",
        (f"{PRECISION_TESTS}/test_amp_users_own_scale.py", "-k", "raises_by_default"),
    ),
    Mutation(
        "nothing-scaled-error",
        "a step before the scaler scaled any loss raises, naming the backward to call (torch's AssertionError turned"
        " into"
        " the recipe's error)",
        FABRIC_RECIPE,
        "error:\n                        if not self._torch.has_scaled():\n",
        "error:\n                        if False:\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "nothing_scaled_raises_by_default and step"),
    ),
    Mutation(
        "closures-refused-under-the-scaler",
        "`opt.step(closure)` under an enabled scaler raises as torch does, instead of stepping on scaled gradients",
        FABRIC_RECIPE,
        '        if kwargs.get("closure") is not None:\n',
        "        if False:\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "closure"),
    ),
    Mutation(
        "fused-sgd-momentum",
        "fused SGD gets zero momentum buffers before a first step the scaler may skip",
        FABRIC_RECIPE,
        "                if in_kernel and isinstance(optimizer, SGD):\n"
        "                    _protect_fused_sgd_momentum(optimizer)\n",
        "",
        (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "momentum"),
    ),
    Mutation(
        "fused-sgd-dampening-refused",
        "fused SGD with dampening, which zero buffers cannot make exact, is refused before any step",
        TORCH_ADAPTER,
        '        if group["dampening"] != 0:\n',
        "        if False:\n",
        (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "dampening"),
    ),
    Mutation(
        "unscales-itself-refused-at-clip",
        "clipping an optimizer that unscales inside its own `step()` (a `grad_scaler` argument) raises instead of"
        " unscaling its gradients twice",
        FABRIC_RECIPE,
        "            if not before_step:\n                raise _unscales_itself_error(optimizer)\n",
        "            if False:\n                raise _unscales_itself_error(optimizer)\n",
        (f"{PRECISION_TESTS}/test_amp_fused.py", "-k", "cannot_be_clipped"),
    ),
    Mutation(
        "fused-with-sharded-scaler-steps-on-the-host",
        "a fused optimizer under `ShardedGradScaler` (1-element inf checks its kernel cannot take) steps as"
        " `scaler.step` would, decided on the host",
        FABRIC_RECIPE,
        "        if holder is optimizer and not (in_kernel and self._torch.sharded):\n",
        "        if holder is optimizer:\n",
        (f"{PRECISION_TESTS}/test_fsdp_amp_recipe.py", "-k", "fused"),
    ),
    # ---- the user's own unscale through a wrapper -------------------------------------------------------------------
    Mutation(
        "wrapper-step-without-scaler-step",
        "a step after the user's `scaler.unscale_(wrapper)` steps as `scaler.step` would, on the wrapper's entry: no"
        " second unscale",
        FABRIC_RECIPE,
        "        if holder is optimizer and not (in_kernel and self._torch.sharded):\n",
        "        if not (in_kernel and self._torch.sharded):\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "wrapper"),
    ),
    Mutation(
        "wrappers-tracked",
        "the recipe keeps each tracked optimizer's wrappers, which a user may hand to `scaler.unscale_`",
        FABRIC_RECIPE,
        "            record.wrappers.append(weakref.ref(wrapper))\n",
        "            pass\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "wrapper"),
    ),
    Mutation(
        "adapter-reads-the-wrappers-entry",
        "the adapter reads torch's stage under a wrapper's id when the user unscaled through it",
        TORCH_ADAPTER,
        "                if wrapper is not None and (state := states.get(id(wrapper))) is not None:\n",
        "                if False:\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "wrapper"),
    ),
    # ---- gradients that would mix two scales ------------------------------------------------------------------------
    Mutation(
        "mark-unscaled-before-a-backward",
        "before a scaled backward, the gradients of optimizers unscaled and not stepped are marked (their versions)",
        FABRIC_RECIPE,
        "                self.reach_marks = marks\n",
        "                pass\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "refused_at_that_backward"),
    ),
    Mutation(
        "reach-marks-read-versions",
        "the reach marks hold each gradient's version counter: a backward that accumulates into unscaled gradients in"
        " place is seen",
        FABRIC_RECIPE,
        "(weakref.ref(p.grad), p.grad._version)",
        "(weakref.ref(p.grad), 0)",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "two_networks_each_clipped or refused_at_that_backward"),
    ),
    Mutation(
        "mixed-scales-detected",
        "a scaled backward that wrote into gradients unscaled and not stepped (two scales mixed) is refused after it",
        FABRIC_RECIPE,
        " and _written(optimizer, versions):\n",
        " and False:\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "backward_onto_gradients_unscaled"),
    ),
    Mutation(
        "reach-marks-compare-identity",
        "a gradient tensor a backward replaced (out of place) counts as written, compared by identity, never by value",
        FABRIC_RECIPE,
        "        elif mark[0]() is not p.grad or mark[1] != p.grad._version:\n",
        "        elif mark[1] != p.grad._version:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "identity_not_by_value"),
    ),
    Mutation(
        "trainer-unscale-gradients",
        "the Trainer's `unscale_gradients` unscales (once per update, whoever asks first)",
        PYTORCH_RECIPE,
        "            self._recipe.unscale(optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else"
        " optimizer)\n\n"
        "    @override\n    def optimizer_step_was_skipped",
        "            pass\n\n    @override\n    def optimizer_step_was_skipped",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "unscale_gradients_unscales_once"),
    ),
    Mutation(
        "unscaled-out-of-reach-steps",
        "unscaled gradients a backward did not reach (their versions unchanged) may still step: a GAN that clips each"
        " network after its own backward",
        FABRIC_RECIPE,
        " and _written(optimizer, versions):\n",
        " and True:\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "gan"),
    ),
    # ---- the carry: gradients that wait move into the new scale ----------------------------------------------------
    Mutation(
        "carry-of-waiting-gradients",
        "the carry: at an update, gradients that wait for their step (`READY`) are multiplied by new/old scale",
        FABRIC_RECIPE,
        "self._torch.scale() if unscaled else self._torch.scale() / old_scale)",
        "self._torch.scale() if unscaled else old_scale / old_scale)",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "gradients_that_wait_are_carried"),
    ),
    Mutation(
        "carry-of-unscaled-gradients",
        "the carry: at an update, gradients unscaled and not stepped (`UNSCALED`, which the update makes `READY`) are"
        " multiplied by the new scale",
        FABRIC_RECIPE,
        "self._torch.scale() if unscaled else self._torch.scale() / old_scale)",
        "old_scale / old_scale if unscaled else self._torch.scale() / old_scale)",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "carried_to_its_end"),
    ),
    Mutation(
        "carry-skips-optimizers-that-stepped",
        "the carry leaves the gradients of optimizers that stepped in the cycle alone: they are true gradients",
        FABRIC_RECIPE,
        "            if optimizer is not None and record.stepped_in != self._cycle:\n",
        "            if optimizer is not None:\n",
        (f"{FABRIC_TESTS}/test_amp_recipe_mechanisms.py", "-k", "optimizer_that_stepped"),
    ),
    # ---- the skip signal -------------------------------------------------------------------------------------------
    Mutation(
        "skip-signal-step-hook",
        "a non-fused step's skip is whether its `step()` ran (a step post-hook): decided on the host, no device read",
        FABRIC_RECIPE,
        "if not in_kernel and record.step_hook is None:",
        "if False:",
        (f"{PRECISION_TESTS}/test_amp_skipped_steps.py", "-k", "exactly_on_forced_overflows"),
    ),
    Mutation(
        "skip-signal-of-fused-optimizers",
        "a fused optimizer's `step()` always runs: its skip is its inf check",
        FABRIC_RECIPE,
        "skipped = self._torch.found_inf(holder) if in_kernel else not self._step_ran",
        "skipped = not self._step_ran",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "skip"),
    ),
    Mutation(
        "fused-skip-read-only-when-asked",
        "a fused optimizer's inf check is read from the device only when someone asks: no host read per step",
        FABRIC_RECIPE,
        "        if isinstance(skipped, Tensor):\n",
        "        if isinstance(skipped, Tensor) and skipped.item() >= 0:\n",
        (f"{PRECISION_TESTS}/test_amp_recipe_cases.py", "-k", "host_reads"),
    ),
    Mutation(
        "fused-skips-counted-on-the-device",
        "the fused optimizers' skips add up in one running count on the device",
        FABRIC_RECIPE,
        "self._fused_skipped = skipped.gt(0).int() + self._fused_skipped",
        "self._fused_skipped = skipped.gt(0).int()",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "skip_count"),
    ),
    Mutation(
        "inf-checks-copied",
        "the skip signal keeps its own copy of a fused optimizer's inf check: torch's update sums into the first"
        " optimizer's, in place",
        TORCH_ADAPTER,
        "found_inf = found_infs[0].clone()\n",
        "found_inf = found_infs[0]\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "survives_the_update"),
    ),
    Mutation(
        "skip-signal-hooks-released",
        "the step hooks of the skip signal go when the fit ends: a raw optimizer kept after the fit pays nothing",
        FABRIC_RECIPE,
        "            if record.step_hook is not None:\n                record.step_hook.remove()\n",
        "            if False:\n                record.step_hook.remove()\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "end_fit"),
    ),
    Mutation(
        "schedulers-hold-on-skipped-steps",
        "a step-interval LR scheduler does not advance on a skipped step, fused optimizers included",
        "pytorch/loops/training_epoch_loop.py",
        "                    and trainer.precision_plugin.optimizer_step_was_skipped(optimizer)\n",
        "                    and False\n",
        (f"{PRECISION_TESTS}/test_amp_skipped_steps.py",),
    ),
    Mutation(
        "a-batch-without-a-step-was-not-skipped",
        "a batch of automatic optimization that does not step (`training_step` returned None) forgets the last step's"
        " skip: a step-interval scheduler does not depend on the batch before",
        FABRIC_RECIPE,
        "        if record is not None:\n            record.last_skip = False\n",
        "        if record is not None:\n            pass\n",
        (f"{PRECISION_TESTS}/test_amp_skipped_steps.py", "-k", "batch_without_step"),
    ),
    Mutation(
        "loss-scale-monitor-per-optimizer-step",
        "`LossScaleMonitor` logs once per optimizer step under gradient accumulation",
        "pytorch/callbacks/loss_scale_monitor.py",
        "            if epoch_loop._should_accumulate():\n                return  #",
        "            if False:\n                return  #",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and loss_scale_monitor"),
    ),
    Mutation(
        "loss-scale-monitor-manual-per-optimizer-step",
        "`LossScaleMonitor` logs once per optimizer step in manual optimization too, where a batch that accumulates"
        " steps none",
        "pytorch/callbacks/loss_scale_monitor.py",
        "            due = steps // every > self._steps_before_batch // every\n",
        "            due = (epoch_loop._batches_that_stepped + 1) % every == 0\n",
        ("tests/tests_pytorch/callbacks/test_loss_scale_monitor.py", "-k", "manual_accumulation"),
    ),
    Mutation(
        "loss-scale-monitor-counts-this-run",
        "`LossScaleMonitor` counts the skips of its own run: not those of an earlier fit or `lr_find` of the same"
        " Trainer",
        "pytorch/callbacks/loss_scale_monitor.py",
        "        self._skipped_before_run = 0 if self._plugin is None else"
        " int(self._plugin._recipe.skipped_steps.item())\n",
        "        self._skipped_before_run = 0\n",
        ("tests/tests_pytorch/callbacks/test_loss_scale_monitor.py", "-k", "second_fit or lr_find"),
    ),
    # ---- checkpoints -----------------------------------------------------------------------------------------------
    Mutation(
        "checkpoint-mid-iteration",
        "a checkpoint saved mid-iteration holds the scale the iteration used and leaves the live run alone",
        FABRIC_PLUGIN,
        "include_owed_update=not self._in_iteration",
        "include_owed_update=True",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and checkpoint"),
    ),
    Mutation(
        "state-dict-is-pure",
        "the scaler's state for a checkpoint holds the owed update without applying it: a save changes nothing",
        FABRIC_RECIPE,
        "            self._torch.project_owed_update(state)\n",
        "            self.settle()\n            state = self.scaler.state_dict()\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "a_save_changes_nothing"),
    ),
    Mutation(
        "load-consumes-the-owed-update",
        "a load applies the update owed so far through torch's own `update()` first",
        FABRIC_RECIPE,
        "        self.settle()\n        self.scaler.load_state_dict(state_dict)\n",
        "        self.scaler.load_state_dict(state_dict)\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "consumes"),
    ),
    Mutation(
        "recipe-pickles-without-the-fit",
        "a pickled plugin (launchers, `ddp_spawn`) leaves the fit, hooks and weak references behind",
        FABRIC_RECIPE,
        '"_records": {}, "_fit": [], ',
        '"_records": {}, ',
        (f"{FABRIC_TESTS}/test_amp_recipe_pickle.py",),
    ),
    Mutation(
        "disabled-scaler-refused",
        "a scaler torch disabled is refused before training",
        TORCH_ADAPTER,
        "    if scaler is None or scaler.is_enabled():\n        return\n",
        "    return\n",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and (scaler_disabled or cuda_scaler)"),
    ),
    # ---- the opt-in misuse watch -----------------------------------------------------------------------------------
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
        "trainer-watch",
        "with the watch on, `loss.backward()` and raw optimizer steps under 16-mixed raise in manual optimization",
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
        "the end of the fit takes the watch's hooks off the parameters",
        FABRIC_WATCH,
        "        super().end_fit()\n        self.unwatch()\n",
        "        super().end_fit()\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "teardown"),
    ),
    Mutation(
        "watch-refuses-at-unscale",
        "with the watch on, an unscale (a clip) of an optimizer holding gradients of a backward without the scale"
        " raises",
        FABRIC_WATCH,
        "        self.refuse(f\"`{type(optimizer).__name__}`'s unscale or step\", optimizer)\n"
        "        super().unscale(optimizer, before_step)\n",
        "        super().unscale(optimizer, before_step)\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "loss_backward_instead"),
    ),
    Mutation(
        "watch-refuses-at-step",
        "with the watch on, a step of an optimizer holding gradients of a backward without the scale raises",
        FABRIC_WATCH,
        "        self.refuse(f\"`{type(optimizer).__name__}`'s unscale or step\", optimizer)\n"
        "        return super().step(optimizer, **kwargs)\n",
        "        return super().step(optimizer, **kwargs)\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "loss_backward_instead"),
    ),
    Mutation(
        "watch-window",
        "the watch switches itself off after its first updates: no cost per step afterwards",
        FABRIC_WATCH,
        "        if self.watch is not None and self.updates >= self.ends_at_update and not self.accumulations:\n"
        "            self.unwatch()\n",
        "",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "watch_ends"),
    ),
    Mutation(
        "watch-knows-the-recipes-own-steps",
        "with the watch on, the recipe's own `optimizer.step()` (a step again on true gradients, a step after the"
        " user's"
        " unscale through a wrapper) is not taken for a raw step",
        FABRIC_WATCH,
        "        self._recipe_steps.add(id(optimizer))  # the recipe's own step",
        "        pass  # the recipe's own step",
        (f"{FABRIC_TESTS}/test_amp_recipe_mechanisms.py", "-k", "second_step_on_the_same_gradients"),
    ),
    Mutation(
        "watch-goes-with-its-parameters",
        "the watch holds its optimizers, parameters and their hooks weakly: a collected model takes its hooks along",
        FABRIC_WATCH,
        "            if optimizer not in self._watched:\n",
        "            self.__dict__.setdefault('_kept', []).append(optimizer)\n"
        "            if optimizer not in self._watched:\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "collected_model"),
    ),
    Mutation(
        "watch-counts-scaled-backwards",
        "the misuse watch takes what accumulates while a scaled backward of its run is in flight for scaled gradients",
        FABRIC_WATCH,
        "    if watch is not None and not watch._in_flight:\n",
        "    if watch is not None:\n",
        (f"{FABRIC_TESTS}/test_grad_scaler_recipe.py", "-k", "watch"),
    ),
    # ---- Fabric -----------------------------------------------------------------------------------------------------
    Mutation(
        "fabric-save-carries-the-scale",
        "`fabric.save` stores the scaler's state for a state without the plugin",
        "fabric/fabric.py",
        "        if precision_state and not self._holds_precision_state(unwrapped_state):\n",
        "        if False:\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "resume"),
    ),
    Mutation(
        "fabric-save-bare-scaler",
        "a bare `GradScaler` in `fabric.save`'s state is saved as the plugin's state, the owed update included",
        "fabric/fabric.py",
        "            unwrapped_state = {k: precision_state if v is scaler else v for k, v in"
        " unwrapped_state.items()}\n",
        "            pass\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "bare_scaler and owed_update"),
    ),
    Mutation(
        "fabric-clip-tolerates-overflow",
        "`fabric.clip_gradients` under a scaler does not raise on an overflow step by default",
        "fabric/fabric.py",
        '                error_if_nonfinite = getattr(self._precision, "scaler", None) is None\n',
        "                error_if_nonfinite = True\n",
        (f"{FABRIC_TESTS}/test_amp_fabric_recipe.py", "-k", "clip"),
    ),
    Mutation(
        "trainer-iteration-ends-on-exception",
        "an exception leaving a training batch ends its iteration: the owed update is kept",
        "pytorch/loops/training_epoch_loop.py",
        "                    finally:\n"
        "                        # an exception ends the iteration too: the update its steps owe is not lost\n"
        "                        precision_plugin.training_iteration_end()\n",
        "                    except BaseException:\n                        raise\n"
        "                    else:\n                        precision_plugin.training_iteration_end()\n",
        (f"{PRECISION_TESTS}/test_amp_iteration.py", "-k", "exception_leaving"),
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
    # ---- other patches ---------------------------------------------------------------------------------------------
    Mutation(
        "trainer-clip-returns-the-norm",
        "`self.clip_gradients` returns the total norm of the unscaled gradients",
        "pytorch/core/module.py",
        "        return self.trainer.precision_plugin.clip_gradients(",
        "        self.trainer.precision_plugin.clip_gradients(",
        (f"{PRECISION_TESTS}/test_amp_differential.py", "-k", "test_fork and returns_the_unscaled_norm"),
    ),
    Mutation(
        "pytree-leaf-spec",
        "a leaf's tree spec comes from `treespec_leaf()`, without torch's deprecation warning",
        "pytorch/utilities/_pytree.py",
        "        return [pytree], treespec_leaf()\n",
        "        return [pytree], LeafSpec()\n",
        ("tests/tests_pytorch/utilities/test_pytree_leaf_spec.py",),
    ),
    Mutation(
        "cpu-16-mixed-is-float16",
        "`precision='16-mixed'` on a CPU gets a CPU gradient scaler where torch has one",
        "fabric/connector.py",
        "    if _TORCH_GREATER_EQUAL_2_3:\n        rank_zero_info(",
        "    if False:\n        rank_zero_info(",
        (f"{PRECISION_TESTS}/test_cpu_16_mixed.py", f"{FABRIC_TESTS}/test_cpu_16_mixed.py"),
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


def union(mutations: tuple[Mutation, ...]) -> tuple[str, ...]:
    """One pytest selection of every test the mutations run, and no other: each selection's ``-k`` expression applies
    to its own files, named by their module's file name (a keyword of each test in it)."""
    paths: dict[str, None] = {}
    terms: dict[str, None] = {}
    for m in mutations:
        args = list(m.tests)
        expression = None
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
