"""Check that the series is reviewable one concern at a time: claimed files, no churn, citations, every prefix works.

    python -m forkbuild series-check                  (make series-check: the claims, then every prefix)
    python -m forkbuild series-check --tests new      (each test file once, at the prefix that adds it)
    python -m forkbuild series-check --tests none     (claims, then each prefix builds and imports)
    python -m forkbuild series-check --claims-only

1. **Claims.** Each of our own files (``src/**``, ``tests/amp_oracle/**``, ``tests/tests_pytorch/**``,
   ``tests/tests_fabric/**``) is added by exactly one patch, named in its header's ``Adds:`` field (one path a
   line), or listed in ``patches/fork-only`` (the fork's packaging tests, which upstream does not need). Each upstream test patch (``upstream/test-patches/``)
   names, in ``Accompanies:``, the patch whose behaviour change it follows (or ``none``).
2. **Written once, where it ends up.** The series is what the wheel ships: no patch removes a line that an earlier
   patch added (a rewrite or a move), at most ``--max-churn`` (5 %) of the added lines. Each patch's DEP-3
   ``Forwarded:`` is ``no``, ``not-needed``, or the PRs of ``upstream/stack/`` and RFCs of ``upstream/rfcs/`` that
   carry its concern upstream.
3. **Citations.** Every patch cited by number in the patches (headers and added lines) and in the tracked Markdown
   and docs (``patch 0019``, ``patches 0007 and 0013``, ``0019-amp-misuse-watch-is-opt-in.patch``,
   ``patches/0010-...``) is a patch of ``patches/series``, and a slug given with the number is that patch's.
4. **Every prefix.** For k = 1 .. N: upstream's package from the pinned wheel (hash-checked), patches 1..k, and the
   files patches 1..k add, in a fresh folder; it must byte-compile and import (``lightning``, ``lightning.pytorch``,
   ``lightning.fabric`` and every module patched so far), and pass the tests its patches add: all of them so far
   (``--tests all``, the default: a prefix passes the tests of every concern it contains), only the new ones
   (``--tests new``), or none. Tests run from that folder, so a test that needs a later patch fails here.

Exit status: 0 all good, 1 a check failed (the report says which prefix and why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from forkbuild import assemble, upstream
from forkbuild.patching import apply_patch, header, parse
from forkbuild.pin import read_pin
from forkbuild.series import (
    FORK_ONLY,
    REPO,
    SOURCE_PATCHES,
    TEST_PATCHES,
    Failure,
    SeriesPatch,
    fork_only,
    git,
    read_series,
    unclaimed,
)

OWN = ("src", "tests/amp_oracle", "tests/tests_pytorch", "tests/tests_fabric")
MAX_CHURN = 0.05
PYTEST_INI = """[pytest]
addopts = -ra --strict-markers --import-mode=importlib -p no:cacheprovider
pythonpath = tests
filterwarnings = ignore::DeprecationWarning:lightning_utilities.*
"""


def log(message: str) -> None:
    print(f"[series-check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def own_files() -> list[str]:
    listed = git(REPO, "ls-files", "--cached", "--others", "--exclude-standard", "--", *OWN).stdout.split()
    return sorted(p for p in listed if "__pycache__" not in p and not p.endswith((".pyc", ".pyo")))


def check_claims(patches: list[SeriesPatch], test_patches: list[SeriesPatch]) -> list[str]:
    problems = []
    claimed: dict[str, str] = {}
    for patch in patches:
        for path in patch.adds():
            if path in claimed:
                problems.append(f"{path} is added by both {claimed[path]} and {patch.name}")
            claimed[path] = patch.name
            if not (REPO / path).is_file():
                problems.append(f"{patch.name} adds {path}, which does not exist")
    kept = fork_only()
    for path in kept:
        if path in claimed:
            problems.append(f"{path} is both fork-only and added by {claimed[path]}")
        if not (REPO / path).is_file():
            problems.append(f"{FORK_ONLY.name} lists {path}, which does not exist")
    for path in unclaimed(own_files(), patches):
        problems.append(
            f"{path} belongs to no patch: name it in the `Adds:` field of the patch whose concern it serves,"
            f" or in patches/{FORK_ONLY.name} if upstream does not need it"
        )
    stems = {p.stem for p in patches}
    for patch in test_patches:
        if "Accompanies" not in patch.fields():
            problems.append(f"test patch {patch.name} has no `Accompanies:` field (a patch of the series, or none)")
        elif patch.accompanies() is not None and patch.accompanies() not in stems:
            problems.append(f"test patch {patch.name} accompanies {patch.accompanies()}, not a patch of the series")
    return problems


def churn(patches: list[SeriesPatch]) -> tuple[int, int, list[str]]:
    """(lines removed that an earlier patch added, lines added, per-patch detail) over the whole series: each concern
    is written once where it ends up, so a later patch rewriting an earlier one's lines is churn."""
    added_before: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    removed_again = total = 0
    detail = []
    for patch in patches:
        target, mine, again = None, collections.defaultdict(list), 0
        for line in patch.path.read_text(encoding="utf-8").splitlines():
            if line.startswith("+++ b/"):
                target = line[6:]
            elif line.startswith("--- "):
                continue
            elif target and line.startswith("-") and added_before[target][line[1:]] > 0:
                added_before[target][line[1:]] -= 1
                again += 1
            elif target and line.startswith("+"):
                mine[target].append(line[1:])
        for path, lines in mine.items():
            added_before[path].update(lines)
            total += len(lines)
        removed_again += again
        if again:
            detail.append(f"{patch.name} removes {again} line(s) an earlier patch added")
    return removed_again, total, detail


def check_forwarded(patches: list[SeriesPatch]) -> list[str]:
    """Each patch's DEP-3 ``Forwarded:`` says where its concern went: ``no``, ``not-needed``, or the folders of
    ``upstream/stack/`` and the RFC drafts of ``upstream/rfcs/`` that carry it, which must exist."""
    problems = []
    for patch in patches:
        value = patch.fields().get("Forwarded", "").split()
        if not value:
            problems.append(f"{patch.name} has no `Forwarded:` field (no, not-needed, or where it went upstream)")
        elif value not in (["no"], ["not-needed"]):
            for where in value:
                if not where.startswith(("upstream/stack/", "upstream/rfcs/")) or not (REPO / where).exists():
                    problems.append(f"{patch.name}: `Forwarded: {where}` is neither no, not-needed, nor a PR of"
                                    " upstream/stack/ or an RFC of upstream/rfcs/ that exists")
    return problems


#: the series a citation may name, by the folder that holds its ``series`` file; a number alone names a patch of the
#: first (``test patch 0010`` a test patch's), a folder before the number its own, a slug the series that has it
CITED_SERIES = {"patches": SOURCE_PATCHES, "test-patches": TEST_PATCHES, "docs/patches": REPO / "docs" / "patches"}
# a patch named with a folder or its slug: `0019-amp-misuse-watch-is-opt-in.patch`, `0007-amp-follows-the-recipe`,
# `patches/0010-...`, `docs/patches/0002`
_CITED_FILE = re.compile(r"(?<![\w.-])(?P<folder>(?:docs/)?patches/|test-patches/)?(?P<number>0\d{3})(?!\w)"
                         r"(?:-(?P<slug>[a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?P<ext>\.patch)?)?")
# a patch named by its number: `patch 0019`, `patches 0007 and 0013`, `test patches 0010/0011`
_CITED_NUMBERS = re.compile(r"\b(?P<test>test )?patch(?:es)?\s+(?P<numbers>0\d{3}(?:(?:\s*,\s*|\s+and\s+|\s+or\s+|/)"
                            r"0\d{3})*)(?![\w-])", re.I)
# patch numbers listed in parentheses, as the CHANGELOG does: `([#18089](...), 0007, 0013)`, `(0019, fork-only)`
_CITED_IN_PARENS = re.compile(r"(?:(?<=\()|(?<=, ))(?P<number>0\d{3})(?=\.?\)|, [^()\n]*\))")


def cited_text(text: str, patch: bool) -> str:
    """What of ``text`` may cite: all of it, or of a patch its header and the lines its diff adds (the others blank,
    so that line numbers stay the file's)."""
    if not patch:
        return text
    lines = text.splitlines()
    head = len(header(text).splitlines())
    return "\n".join(lines[:head] + [ln[1:] if ln.startswith("+") and not ln.startswith("+++") else ""
                                    for ln in lines[head:]])


def citations(text: str) -> list[tuple[int, str | None, str, str | None]]:
    """(line, series folder or None, number, slug or None) of each patch that ``text`` cites: the folder is the
    citation's own (``docs/patches/0002``), a test patch's for ``test patch(es) NNNN``, else ``patches`` for a number
    alone and None for a slug (the series that has it)."""
    found: list[tuple[int, str | None, str, str | None]] = []

    def line_of(at: int) -> int:
        return text.count("\n", 0, at) + 1

    for m in _CITED_FILE.finditer(text):
        folder, slug = (m.group("folder") or "").rstrip("/") or None, m.group("slug")
        if folder is not None or slug is not None:
            found.append((line_of(m.start()), folder, m.group("number"), slug and slug + (m.group("ext") or "")))
    for m in _CITED_NUMBERS.finditer(text):
        for number in re.findall(r"0\d{3}", m.group("numbers")):
            found.append((line_of(m.start()), "test-patches" if m.group("test") else "patches", number, None))
    for m in _CITED_IN_PARENS.finditer(text):
        found.append((line_of(m.start()), "patches", m.group("number"), None))
    return found


def cited_files(repo: Path = REPO) -> list[str]:
    """Where patches are cited: the series' patches, every tracked Markdown file, and the text files of ``docs/``."""
    names = git(repo, "ls-files", "--", "*.md", "docs", "patches/*.patch").stdout.split()
    return [name for name in names if name.endswith((".md", ".rst", ".py", ".patch", ".txt"))]


def _names(slug: str, stem: str) -> bool:
    """Whether ``slug`` (after ``NNNN-``) names the patch ``stem``: its whole file name, or the start of its stem."""
    return slug == f"{stem[5:]}.patch" or not slug.endswith(".patch") and f"{stem}-".startswith(f"{stem[:4]}-{slug}-")


def check_citations(repo: Path = REPO, files: list[str] | None = None) -> list[str]:
    """Each patch cited by number is a patch of that number in its series, and a slug given with it is that patch's."""
    stems = {
        name: {patch.stem[:4]: patch.stem for patch in read_series(repo / folder.relative_to(REPO))}
        for name, folder in CITED_SERIES.items()
    }
    problems = []
    for name in cited_files(repo) if files is None else files:
        text = (repo / name).read_text(encoding="utf-8")
        for line, folder, number, slug in citations(cited_text(text, name.endswith(".patch"))):
            cited = f"{number}-{slug}" if slug else number
            where = [folder] if folder else list(stems)
            if any(number in stems[f] and (slug is None or _names(slug, stems[f][number])) for f in where):
                continue
            if slug is None:
                problems.append(f"{name}:{line} cites {folder} {number}, but {folder}/series has no patch {number}")
                continue
            base = slug.removesuffix(".patch")
            actual = [stem for f in where for stem in stems[f].values() if stem[5:] == base]
            has = [f"{f} {number} is {stems[f][number]}" for f in where if number in stems[f]]
            problems.append(f"{name}:{line} cites {cited}, but " + ("; ".join(has) or f"no series has a patch {number}")
                            + (f"; {base} is {', '.join(actual)}" if actual else ""))
    return problems


def upstream_package() -> dict[str, bytes]:
    pin = read_pin()
    folder = REPO / "build" / "upstream-wheel"
    folder.mkdir(parents=True, exist_ok=True)
    cached = folder / pin.filename
    wheel = upstream.verify(pin, cached) if cached.is_file() else upstream.obtain(pin, folder)
    files, dist_info = assemble.read_upstream(wheel)
    return {name: data for name, data in files.items() if not name.startswith(dist_info)}


def write_prefix(root: Path, package: dict[str, bytes], own: list[str], repo: Path = REPO) -> None:
    src = root / "src"
    for name, data in package.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    for path in own:
        target = root / path  # src/lightning/... or tests/...
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((repo / path).read_bytes())
    (root / "pytest.ini").write_text(PYTEST_INI, encoding="utf-8")


def run_prefix(root: Path, modules: list[str], tests: list[str], python: str, pytest_args: list[str]) -> str | None:
    """Why the prefix in ``root`` fails, or None."""
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(root / "src")}
    done = subprocess.run([python, "-m", "compileall", "-q", str(root / "src" / "lightning")], capture_output=True,
                          text=True, env=env)
    if done.returncode:
        return f"does not byte-compile:\n{(done.stdout + done.stderr)[-3000:]}"
    probe = (
        "import importlib, sys, lightning, lightning.pytorch, lightning.fabric\n"
        f"assert lightning.__file__.startswith({str(root)!r}), lightning.__file__\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
    )
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env, cwd=root)
    if done.returncode:
        return f"does not import:\n{(done.stdout + done.stderr)[-3000:]}"
    if not tests:
        return None
    done = subprocess.run([python, "-m", "pytest", "-q", *pytest_args, *tests], capture_output=True, text=True,
                          env=env, cwd=root)
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    log(f"    {len(tests)} test file(s): {summary}")
    if done.returncode:
        return f"its tests fail:\n{(done.stdout + done.stderr)[-6000:]}"
    return None


def module_name(path: str) -> str | None:
    if not path.startswith("src/") or not path.endswith(".py"):
        return None
    name = path[len("src/") : -len(".py")].replace("/", ".")
    return name.removesuffix(".__init__")


def check_prefixes(patches: list[SeriesPatch], mode: str, python: str, pytest_args: list[str], keep: Path | None,
                   first: int = 1, repo: Path = REPO) -> list[str]:
    package = upstream_package()
    problems = []
    own: list[str] = []
    modules: list[str] = []
    tests_so_far: list[str] = []
    with tempfile.TemporaryDirectory(prefix="series-check-") as tmp:
        for k, patch in enumerate(patches, start=1):
            parsed = parse(patch.name, patch.path.read_bytes().decode("utf-8"))
            apply_patch(parsed, package)
            modules += [m for m in map(module_name, [f.path for f in parsed.files]) if m and m not in modules]
            new_files = patch.adds()
            own += new_files
            modules += [m for m in map(module_name, new_files) if m and m not in modules]
            new_tests = [p for p in new_files if Path(p).name.startswith("test_")]
            tests_so_far += new_tests
            if k < first:
                continue
            tests = {"all": tests_so_far, "new": new_tests, "none": []}[mode]
            root = (keep or Path(tmp)) / f"{k:04d}"
            log(f"prefix {k}/{len(patches)}: ... {patch.stem}")
            write_prefix(root, package, own, repo)
            why = run_prefix(root, modules, list(tests), python, pytest_args)
            if why:
                problems.append(f"prefix 1..{k} (up to {patch.name}) {why}")
                log(f"    FAILED: {why.splitlines()[0]}")
    return problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tests", choices=["all", "new", "none"], default="all",
                        help="which added tests each prefix runs (default: all so far)")
    parser.add_argument("--claims-only", action="store_true", help="only the claims, the churn and the citations")
    parser.add_argument("--from", dest="first", type=int, default=1, help="start at this prefix (1-based)")
    parser.add_argument("--keep", type=Path, help="write the prefixes here instead of a temporary folder")
    parser.add_argument("--max-churn", type=float, default=MAX_CHURN)
    parser.add_argument("--pytest-args", default="-x", help="extra pytest arguments, one string (default: -x)")


def run(args: argparse.Namespace) -> int:
    """``python -m forkbuild series-check``: the exit status of the module's docstring."""
    try:
        patches = read_series(SOURCE_PATCHES)
        problems = check_claims(patches, read_series(TEST_PATCHES)) + check_forwarded(patches)
        again, total, detail = churn(patches)
        share = again / total if total else 0.0
        log(f"churn: {again} of {total} added lines are removed again by a later patch"
            f" ({share:.1%}){''.join(chr(10) + '  ' + d for d in detail)}")
        if share > args.max_churn:
            problems.append(f"churn {share:.1%} is above {args.max_churn:.0%}:\n  " + "\n  ".join(detail))
        problems += check_citations()
        if problems:
            print("\n".join(f"- {p}" for p in problems), file=sys.stderr)
            return 1
        log(f"claims: every own file belongs to one of {len(patches)} patches or is fork-only; each patch cited exists")
        if args.claims_only:
            return 0
        problems = check_prefixes(patches, args.tests, sys.executable, args.pytest_args.split(), args.keep, args.first)
    except Failure as err:
        print(f"series-check: {err}", file=sys.stderr)
        return 2
    if problems:
        print("\n".join(f"- {p}" for p in problems), file=sys.stderr)
        return 1
    log(f"every prefix of the {len(patches)} patches builds, imports and passes its tests ({args.tests})")
    return 0
