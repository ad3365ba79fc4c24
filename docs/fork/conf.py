"""Sphinx project for the fork's own documentation pages, and only those.

The pages live in upstream's layout under ``docs/source-pytorch/`` so that they drop into an upstream checkout
unchanged, and ``docs/patches/`` hooks them into upstream's pages. A ``conf.py`` there would replace upstream's, so the
fork's Sphinx project is this folder instead: it links to the pages (``model/``, ``common/``) and stands in for the
one upstream page that includes a section of ours (``model/manual_optimization.rst``), so that document names,
includes and cross-references are the ones upstream's build will see. Build it with ``make docs``, or::

    python -m sphinx -W --keep-going -b html docs/fork build/docs/html

The pages' examples are ``code-block`` directives, which GitHub shows too; ``tests/tests_docs/doc_examples.py`` executes
them against the ``lightning`` that Python imports, which must be the fork (installed, or ``PYTHONPATH=.tree/src``
after ``make tree``), and ``tests/tests_docs/test_docs.py`` runs both.
"""

project = "Lightning, patched for correct mixed precision"
author = "lightning-amp fork"
copyright = "The Lightning AI team and the lightning-amp fork"  # noqa: A001

# upstream's docs use autosectionlabel with document prefixes: `:ref:`model/manual_optimization:Mixed Precision``
extensions = ["sphinx.ext.autosectionlabel"]
autosectionlabel_prefix_document = True

root_doc = "index"
exclude_patterns = [
    # a section that model/manual_optimization.rst includes, not a page (docs/patches/0002 says the same upstream)
    "model/manual_optimization_mixed_precision.rst",
]

# every cross-reference must resolve, as in upstream's build
nitpicky = True

html_theme = "alabaster"
pygments_style = "sphinx"


def setup(app):
    return {"parallel_read_safe": True}
