"""Lightning's ``_tree_flatten`` builds a leaf's spec without torch's deprecation warning.

torch deprecates constructing ``LeafSpec()`` in favour of ``treespec_leaf()`` and warns at every construction
("`isinstance(treespec, LeafSpec)` is deprecated", a FutureWarning); the Trainer flattens every batch it moves, so each
``fit`` printed it. On a torch without ``treespec_leaf`` the spec is ``LeafSpec()`` as before.
"""

import warnings

import pytest
import torch
from torch.utils._pytree import tree_unflatten

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities._pytree import _map_and_unflatten, _tree_flatten


@pytest.mark.parametrize(
    "pytree",
    [torch.ones(2), 3, [1, 2.0, "a"], {"x": torch.ones(1), "y": [torch.zeros(2), (4, torch.ones(3))]}],
    ids=["tensor", "int", "list-of-primitives", "nested"],
)
def test_tree_flatten_round_trip_without_warning(pytree):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        leaves, spec = _tree_flatten(pytree)
        rebuilt = tree_unflatten(leaves, spec)
        doubled = _map_and_unflatten(lambda v: v * 2 if isinstance(v, torch.Tensor) else v, leaves, spec)
    assert repr(rebuilt) == repr(pytree)
    assert type(doubled) is type(pytree)


def test_leaf_spec_is_a_leaf():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        leaves, spec = _tree_flatten([1, 2])  # a container of primitives is one leaf for Lightning
    assert leaves == [[1, 2]]
    assert spec.num_leaves == 1  # a leaf on every torch (`is_leaf()` is new in 2.3)
    assert tree_unflatten(leaves, spec) == [1, 2]


def test_fit_does_not_warn_about_leaf_spec(tmp_path):
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BoringModel())
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
