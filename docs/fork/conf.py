"""Sphinx project for the fork's own documentation pages, and only those.

The pages live in upstream's layout under ``docs/source-pytorch/`` so that they drop into an upstream checkout
unchanged, and ``docs/patches/`` hooks them into upstream's pages. A ``conf.py`` there would replace upstream's, so the
fork's Sphinx project is this folder instead: it links to the pages (``model/``, ``common/``) and stands in for the
one upstream page that includes a section of ours (``model/manual_optimization.rst``), so that document names,
includes and cross-references are the ones upstream's build will see. Build it with::

    python -m sphinx -W --keep-going -b html docs/fork build/docs/html
    python -m sphinx -W --keep-going -b doctest docs/fork build/docs/doctest

The doctest build executes every example of the pages against the ``lightning`` that Python imports, which must be the
fork (installed, or ``PYTHONPATH=.tree/src`` after ``make tree``). ``tests/tests_docs/test_docs.py`` runs both builds.
"""

project = "Lightning, patched for correct mixed precision"
author = "lightning-amp fork"
copyright = "The Lightning AI team and the lightning-amp fork"  # noqa: A001

# upstream's docs use autosectionlabel with document prefixes: `:ref:`model/manual_optimization:Mixed Precision``
extensions = ["sphinx.ext.doctest", "sphinx.ext.autosectionlabel"]
autosectionlabel_prefix_document = True

root_doc = "index"
exclude_patterns = [
    # a section that model/manual_optimization.rst includes, not a page (docs/patches/0002 says the same upstream)
    "model/manual_optimization_mixed_precision.rst",
]

# every cross-reference must resolve, as in upstream's build
nitpicky = True

# only the `testcode`/`testoutput` directives are examples; no `>>>` blocks in running text
doctest_test_doctest_blocks = ""

html_theme = "alabaster"
pygments_style = "sphinx"


def _require_the_fork(app) -> None:
    """The examples document the fork's behaviour: running them against stock Lightning would prove nothing."""
    if app.builder.name != "doctest":
        return
    import lightning
    from lightning.pytorch.core.optimizer import LightningOptimizer

    if not hasattr(LightningOptimizer, "step_was_skipped"):
        raise RuntimeError(
            f"The doctest build needs the fork's `lightning`, but Python imports stock Lightning"
            f" {lightning.__version__} from {lightning.__file__}. Install the fork (`make install`) or run"
            " `make tree` and set PYTHONPATH=.tree/src."
        )


def setup(app):
    app.connect("builder-inited", _require_the_fork)
    return {"parallel_read_safe": True}
