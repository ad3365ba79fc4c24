"""Build tooling for the fork: upstream's pinned wheel + our own modules + our ordered patch series -> one wheel.

Modules:
    pin       -- reads ``upstream.toml``, the pin of the upstream release (version and sha256).
    upstream  -- obtains the upstream wheel (local file or the user's package index) and verifies its hash.
    patching  -- parses the patch series and applies it strictly, in memory.
    assemble  -- lays our modules over upstream, applies the series, writes the wheel and sdist.
    backend   -- the PEP 517 hooks that pip and uv call.
    devtree   -- ``python -m forkbuild tree`` / ``export``: the patched tree as a git history, and back.
"""
