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
"""The gradient scaler Lightning creates for ``precision="16-mixed"``: torch's own, which also tells the precision
plugin about each loss it scales.

The plugin watches, in the first iterations of a fit, for gradients that a backward *without* the loss scale
accumulated (``loss.backward()`` instead of ``self.manual_backward(loss)``). A user who writes PyTorch's recipe by hand
with Lightning's scaler, ``self.trainer.precision_plugin.scaler.scale(loss).backward()``, runs a backward the plugin did
not start; this scaler marks it as carrying the scale, as the plugin's own backward is, so that it is not taken for
``loss.backward()``. A scaler the user passes is theirs, and stays as it is: its ``scale()`` cannot be seen.

Example::

    scaler = _lightning_grad_scaler("cuda")
    plugin = MixedPrecision("16-mixed", "cuda", scaler=scaler)  # `serve(plugin)` is called by the plugin

"""

import functools
import weakref
from typing import Any, Optional

import torch
from torch import Tensor

from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_4

try:  # torch >= 2.3
    from torch.amp import GradScaler as _AmpGradScaler
except ImportError:  # torch 2.1, 2.2: the scaler lived with CUDA's AMP
    from torch.cuda.amp import GradScaler as _AmpGradScaler  # type: ignore[assignment]


class _TellsThePlugin:
    """``scale()`` marks the backward of what it returns as carrying the scale, while the plugin serving it watches for
    backwards without the scale."""

    # the plugin that owns this scaler: a strong reference (the two live and die together), so that both are pickled
    # together when a launcher pickles the plugin (`ddp_spawn`), and the copy still tells the copy
    _plugin: Optional[Any] = None

    def serve(self, plugin: Any) -> None:
        """Tell ``plugin`` (a precision plugin driving this scaler) about each loss this scaler scales."""
        self._plugin = plugin

    def scale(self, outputs: Any) -> Any:
        scaled = super().scale(outputs)  # type: ignore[misc]
        recipe = getattr(self._plugin, "_scaler_recipe", None)
        if recipe is not None and recipe.watched:
            watch = weakref.ref(recipe._watch)
            for tensor in _tensors(scaled):
                if tensor.grad_fn is not None:
                    tensor.grad_fn.register_prehook(functools.partial(_scaled_backward_begins, watch))
        return scaled


class _LightningGradScaler(_TellsThePlugin, _AmpGradScaler):
    """``torch.amp.GradScaler`` (on torch < 2.3 CUDA's), telling the plugin it serves about the losses it scales."""


def _lightning_grad_scaler(device: str) -> _LightningGradScaler:
    """The scaler Lightning creates for ``device``: ``GradScaler(device)``, or CUDA's before torch 2.4, as before."""
    return _LightningGradScaler(device=device) if _TORCH_GREATER_EQUAL_2_4 else _LightningGradScaler()


def _tensors(scaled: Any) -> list[Tensor]:
    if isinstance(scaled, Tensor):
        return [scaled]
    if isinstance(scaled, (list, tuple)):
        return [t for item in scaled for t in _tensors(item)]
    return []


def _scaled_backward_begins(watch_ref: "weakref.ref[Any]", grad_outputs: Any) -> None:
    """The backward reached the scaled loss (its node runs first): the watch counts it as a scaled backward until the
    end of this backward, as for the plugin's own (the refusal of gradients without the scale included)."""
    watch = watch_ref()
    if watch is None:
        return
    backward = watch.scaled_backward()
    backward.__enter__()
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(backward.__exit__, None, None, None))
