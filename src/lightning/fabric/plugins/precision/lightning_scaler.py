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
"""The gradient scaler of a Lightning precision plugin tells the plugin about each loss it scales.

The plugin watches, in the first iterations of a fit, for gradients that a backward *without* the loss scale
accumulated (``loss.backward()`` instead of ``self.manual_backward(loss)``). A user who writes PyTorch's recipe by hand
with the plugin's scaler, ``self.trainer.precision_plugin.scaler.scale(loss).backward()``, runs a backward the plugin
did not start; the scaler marks it as carrying the scale, as the plugin's own backward is, so that it is not taken for
``loss.backward()``.

One mechanism serves every scaler of torch's own classes, the one Lightning creates and the one a user passes alike:
:func:`_serve` gives the scaler object a subclass of its class that adds this to ``scale()`` (the same object, its
state and its behaviour otherwise unchanged, ``isinstance`` as before; a copy or a pickle keeps it). A scaler of the
user's own subclass stays as it is: its ``scale()`` cannot be seen, and the hand-written recipe then needs
``self.manual_backward(loss)``.

Example::

    scaler = torch.amp.GradScaler("cuda")
    plugin = MixedPrecision("16-mixed", "cuda", scaler=scaler)  # calls `_serve(scaler, plugin)`
    assert plugin.scaler is scaler and isinstance(scaler, _TellsThePlugin)

"""

import functools
import weakref
from typing import Any, Optional, cast

import torch
from torch import Tensor

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

    def __reduce_ex__(self, protocol: Any) -> Any:
        # the class is made at run time (`_served_class`): a copy or a pickle rebuilds it from torch's class
        torch_class = next(c for c in type(self).__mro__[1:] if not issubclass(c, _TellsThePlugin))
        return _rebuild, (torch_class,), self.__getstate__()

    def serve(self, plugin: Any) -> None:
        """Tell ``plugin`` (a precision plugin driving this scaler) about each loss this scaler scales."""
        self._plugin = plugin

    def scale_unmarked(self, outputs: Any) -> Any:
        """``scale()`` without the mark: for the plugin's own backward, which marks itself."""
        return super().scale(outputs)  # type: ignore[misc]

    def scale(self, outputs: Any) -> Any:
        scaled = super().scale(outputs)  # type: ignore[misc]
        recipe = getattr(self._plugin, "_scaler_recipe", None)
        if recipe is not None and recipe.watched:
            watch = weakref.ref(recipe._watch)
            for tensor in _tensors(scaled):
                if tensor.grad_fn is not None:
                    tensor.grad_fn.register_prehook(functools.partial(_scaled_backward_begins, watch))
        return scaled


def _serve(scaler: Optional[Any], plugin: Any) -> None:
    """Make ``scaler`` (the plugin's: created by Lightning or passed by the user) tell ``plugin`` about each loss it
    scales, if its class is torch's own (``GradScaler`` of ``torch.amp``, ``torch.cuda.amp`` or ``torch.cpu.amp``, or
    FSDP's ``ShardedGradScaler``)."""
    if scaler is None:
        return
    if not isinstance(scaler, _TellsThePlugin):
        cls = type(scaler)
        if not (isinstance(scaler, _AmpGradScaler) and cls.__module__.split(".")[0] == "torch"):
            return  # the user's own subclass: theirs to keep as it is
        scaler.__class__ = _served_class(cls)
    cast(_TellsThePlugin, scaler).serve(plugin)


_SERVED_CLASSES: dict[type, type] = {}


def _served_class(torch_class: type) -> type:
    """The subclass of ``torch_class`` that tells the plugin, one per class (so that ``type()`` compares equal)."""
    served = _SERVED_CLASSES.get(torch_class)
    if served is None:
        name = f"_Lightning{torch_class.__name__}"
        served = type(name, (_TellsThePlugin, torch_class), {"__module__": __name__, "__doc__": None})
        _SERVED_CLASSES[torch_class] = served
    return served


def _rebuild(torch_class: type) -> Any:
    return object.__new__(_served_class(torch_class))


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
    if watch is not None:
        torch.autograd.Variable._execution_engine.queue_callback(watch.marked_scaled_backward_begins())
