"""The upstream work: run its commands from the repository root, ``python3 -m upstream.pr_stack`` and
``python3 -m upstream.upstream_test`` (``make pr-stack``, ``make upstream-test``)."""
