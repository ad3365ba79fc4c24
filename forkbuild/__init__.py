"""Build tooling for the fork: upstream's pinned wheels + our own modules + our ordered patch series -> the wheels.

Two distributions come out of one source of truth: ``lightning`` and the standalone ``pytorch-lightning``
(``pytorch_lightning``, ``lightning_fabric``), whose modules and patches are lightning's, renamed; and, for the tests
only, ``stock-pytorch-lightning`` (the unpatched standalone wheel, renamed to ``stock_*``).

Modules:
    pin       -- reads ``upstream.toml``, the pins of the upstream wheels (version and sha256).
    upstream  -- obtains an upstream wheel (local file or the user's package index) and verifies its hash.
    patching  -- parses the patch series and applies it strictly, in memory.
    rename    -- the mechanical rename of packages (lightning.pytorch -> pytorch_lightning, ...), paths and text.
    assemble  -- lays our modules over upstream, applies the series, writes the wheels and sdists (the flavours).
    backend   -- the PEP 517 / PEP 660 hooks that pip and uv call.
    editable  -- ``pip install -e .``: an editable lightning that imports the patched tree ``.tree/src``.
    stamp     -- whether ``.tree/`` was made from the checkout's current inputs.
    devtree   -- ``python -m forkbuild tree`` / ``export``: the patched tree as a git history, and back.
    series    -- the series as the maintainers' commands read it: DEP-3 headers, claimed files (``upstream/`` uses it).
    series_check -- ``python -m forkbuild series-check``: claims, churn, patch citations, every prefix of the series.
"""
