#!/usr/bin/env python3
"""Check that the series is reviewable one concern at a time: claimed files, no churn, every prefix works.

    python tools/upstream/check_series.py                  (make series-check: the claims, then every prefix)
    python tools/upstream/check_series.py --tests new      (each test file once, at the prefix that adds it)
    python tools/upstream/check_series.py --tests none     (claims, then each prefix builds and imports)
    python tools/upstream/check_series.py --claims-only

1. **Claims.** Each of our own files (``src/**``, ``tests/tests_pytorch/**``, ``tests/tests_fabric/**``) is added by
   exactly one patch, named in its header's ``Adds:`` field (one path a line), or listed in
   ``tools/upstream/fork-only`` (the fork's packaging tests, which upstream does not need). Each upstream test patch
   names, in ``Accompanies:``, the patch whose behaviour change it follows (or ``none``). This is what
   ``make_pr.py`` reads to put every file into the commit of its concern.
2. **Two layers, each written once.** The series is the forwarded layer (each patch one pull request of
   ``tools/upstream/stack/``, named in ``Forwarded:``), then the fork-only layer (``Forwarded: awaiting RFC
   tools/upstream/rfcs/<NN>-<slug>.md``, ``awaiting an issue`` or ``not-needed``). Within each layer no patch removes
   a line that an earlier patch added (a rewrite or a move): at most ``--max-churn`` (5 %) of the layer's added
   lines. A fork-only patch may replace a forwarded patch's lines when its ``Replaces:`` field names that patch
   (declared; not churn); any other removal across the layers counts. Each forwarded patch, in its master form (its
   recorded resolution, else itself), changes ``src/`` as its stack PR's ``changes.patch`` does: the same lines, or,
   for a patch ``Stacked-On:`` earlier forwarded patches, nothing but the PR's lines and theirs.
3. **Every prefix.** For k = 1 .. N: upstream's package from the pinned wheel (hash-checked), patches 1..k, and the
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import (  # noqa: E402
    FORK_ONLY,
    HERE,
    REPO,
    RESOLUTIONS,
    SOURCE_PATCHES,
    TEST_PATCHES,
    Failure,
    SeriesPatch,
    fork_only,
    git,
    read_patch,
    read_series,
    unclaimed,
)

sys.path.insert(0, str(REPO))
from forkbuild import assemble, upstream  # noqa: E402
from forkbuild.patching import apply_patch, parse  # noqa: E402
from forkbuild.pin import read_pin  # noqa: E402

OWN = ("src", "tests/tests_pytorch", "tests/tests_fabric")
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
            f" or in tools/upstream/{FORK_ONLY.name} if upstream does not need it"
        )
    stems = {p.stem for p in patches}
    for patch in test_patches:
        if "Accompanies" not in patch.fields():
            problems.append(f"test patch {patch.name} has no `Accompanies:` field (a patch of the series, or none)")
        elif patch.accompanies() is not None and patch.accompanies() not in stems:
            problems.append(f"test patch {patch.name} accompanies {patch.accompanies()}, not a patch of the series")
    return problems


def churn(patches: list[SeriesPatch], layer: str | None = None) -> tuple[int, int, list[str]]:
    """(lines removed that an earlier patch added, lines added, per-patch detail), over the whole series or, with
    ``layer``, over that layer's patches (the lines they add, the lines they remove that an earlier patch added).

    A fork-only patch may replace lines that a forwarded patch added when its ``Replaces:`` field names that patch:
    such a removal is declared, and counts as churn in neither layer. Any other removal of an earlier patch's line is
    churn, within a layer or across the two."""
    added_before: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    owner: dict[tuple[str, str], list[SeriesPatch]] = collections.defaultdict(list)
    removed_again = total = 0
    detail = []
    for patch in patches:
        counted = layer is None or patch.layer() == layer
        target, mine, again, replaced = None, collections.defaultdict(list), 0, 0
        for line in patch.path.read_text(encoding="utf-8").splitlines():
            if line.startswith("+++ b/"):
                target = line[6:]
            elif line.startswith("--- "):
                continue
            elif target and line.startswith("-"):
                if added_before[target][line[1:]] > 0:
                    added_before[target][line[1:]] -= 1
                    by = owner[(target, line[1:])].pop()
                    if patch.layer() == "fork-only" and by.layer() == "forwarded" and by.name in patch.replaces():
                        replaced += 1
                    else:
                        again += 1
            elif target and line.startswith("+"):
                mine[target].append(line[1:])
        for path, lines in mine.items():
            added_before[path].update(lines)
            for line in lines:
                owner[(path, line)].append(patch)
            total += len(lines) if counted else 0
        if counted:
            removed_again += again
            if again:
                detail.append(f"{patch.name} removes {again} line(s) an earlier patch added")
            if replaced:
                detail.append(f"{patch.name} replaces {replaced} line(s) of {', '.join(patch.replaces())} (declared)")
    return removed_again, total, detail


def check_layers(patches: list[SeriesPatch]) -> list[str]:
    """The forwarded layer comes first, each of its patches one PR of ``tools/upstream/stack/`` at most once; the
    fork-only layer follows, each patch naming RFC drafts that exist; ``Replaces:`` and ``Stacked-On:`` name earlier
    forwarded patches."""
    problems = []
    seen_fork_only = None
    earlier: dict[str, SeriesPatch] = {}
    stack: dict[str, str] = {}
    for patch in patches:
        where = patch.name
        if patch.layer() == "fork-only":
            seen_fork_only = seen_fork_only or patch.name
            for rfc in patch.rfcs():
                if not (REPO / rfc).is_file():
                    problems.append(f"{where} awaits {rfc}, which does not exist")
            if patch.fields().get("Forwarded", "").startswith("awaiting RFC") and not patch.rfcs():
                problems.append(f"{where}: `Forwarded: awaiting RFC` names no tools/upstream/rfcs/<NN>-<slug>.md")
        else:
            if seen_fork_only:
                problems.append(f"{where} is forwarded but comes after the fork-only {seen_fork_only}: the forwarded"
                                " layer comes first")
            folder = patch.stack_folder()
            if folder:
                if not (REPO / folder / "changes.patch").is_file():
                    problems.append(f"{where} is forwarded as {folder}, which is not a PR of the stack")
                if folder in stack:
                    problems.append(f"{where} and {stack[folder]} are both forwarded as {folder}")
                stack[folder] = patch.name
            if patch.replaces():
                problems.append(f"{where}: only a fork-only patch replaces forwarded lines (`Replaces:`)")
        for field, names in (("Replaces", patch.replaces()), ("Stacked-On", patch.stacked_on())):
            for name in names:
                if name not in earlier or earlier[name].layer() != "forwarded":
                    problems.append(f"{where}: `{field}: {name}` is not an earlier forwarded patch of the series")
        earlier[patch.name] = patch
    return problems


def src_lines(patch_path: Path) -> dict[str, dict[str, collections.Counter]]:
    """The lines a diff adds and removes under ``src/`` (CHANGELOGs left out), per file: path -> {"+": ..., "-": ...}."""
    out: dict[str, dict[str, collections.Counter]] = {}
    target = None
    for line in patch_path.read_text(encoding="utf-8").splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[-1]
            target = path if path.startswith("src/") and not path.endswith("CHANGELOG.md") else None
        elif line.startswith(("+++ ", "--- ", "index ")):
            continue
        elif target and line[:1] in ("+", "-"):
            out.setdefault(target, {"+": collections.Counter(), "-": collections.Counter()})[line[0]][line[1:]] += 1
    return out


def check_stack(patches: list[SeriesPatch]) -> list[str]:
    """A forwarded patch and the stack's PR it names change upstream master's ``src/`` alike (one source of truth).

    The patch's master form (its recorded resolution, else the patch) must add and remove exactly the lines the
    PR's ``changes.patch`` adds and removes under ``src/`` (CHANGELOGs aside: the PR carries upstream's entries, the
    series ours). A patch stacked on earlier forwarded patches (``Stacked-On:``), which its PR is not on master, must
    add nothing but lines the PR adds or the patches it is stacked on add, and drop none of the PR's lines."""
    problems = []
    by_name = {p.name: p for p in patches}
    chosen = resolutions_of("master")
    for patch in patches:
        folder = patch.stack_folder()
        if patch.layer() != "forwarded" or not folder or not (REPO / folder / "changes.patch").is_file():
            continue
        master_form = chosen.get(patch.name, patch.path)
        ours, theirs = src_lines(master_form), src_lines(REPO / folder / "changes.patch")
        where = f"{patch.name} (as on master) and {folder}/changes.patch"
        if set(ours) != set(theirs):
            problems.append(f"{where} change different files under src/: {sorted(ours)} and {sorted(theirs)}")
            continue
        for path in sorted(ours):
            if not patch.stacked_on():
                for sign in "+-":
                    if ours[path][sign] != theirs[path][sign]:
                        lines = (ours[path][sign] - theirs[path][sign]) + (theirs[path][sign] - ours[path][sign])
                        problems.append(f"{where} differ in the lines they {'add' if sign == '+' else 'remove'} in"
                                        f" {path}:\n" + "".join(f"    {ln}\n" for ln in lines.elements()))
                continue
            below: collections.Counter = collections.Counter()
            for name in patch.stacked_on():
                below += src_lines(chosen.get(name, by_name[name].path)).get(path, {"+": collections.Counter()})["+"]
            foreign = ours[path]["+"] - theirs[path]["+"] - below
            lost = theirs[path]["+"] - ours[path]["+"] - below
            # a line the PR rewrites that the patches below still need (an import they use) stays as upstream has it
            kept = theirs[path]["-"] - ours[path]["-"]
            if sum(lost.values()) <= sum(kept.values()):
                lost = collections.Counter()
            for what, lines in (("adds lines the PR does not", foreign), ("drops lines the PR adds", lost)):
                if lines:
                    problems.append(f"{where}: {path}: the patch {what} (nor {', '.join(patch.stacked_on())}):\n"
                                    + "".join(f"    {ln}\n" for ln in lines.elements()))
    return problems


def resolutions_of(base: str) -> dict[str, Path]:
    folder = RESOLUTIONS / base
    return {p.name: p for p in sorted(folder.glob("*.patch"))} if folder.is_dir() else {}


def check_resolutions(patches: list[SeriesPatch]) -> list[str]:
    """A recorded resolution is a patch of the series as it applies to another base (``resolutions/master/``, for
    upstream's master, which changed code the series rewrites). It must lead to the code the series leads to:

    - its header is the patch's (Description extended, a ``Resolves:`` field added), for the same files;
    - every line the patch adds is in its result, or a later resolution of the same file adds it;
    - it adds nothing but lines the series adds to that file, lines a later resolution removes again, and
      upstream's own lines that the other base had changed (restored);
    - the last resolution of each file applies, in reverse, to the file as the series leaves it after that patch
      (the patches after it apply to both bases alike): its result is the series' result.

    All of this is checked offline against the pinned release, so a change to the series that its resolutions do not
    follow fails here (and in CI), before ``make pr`` meets the other base."""
    problems = []
    by_name = {p.name: p for p in patches}
    folders = sorted(d for d in RESOLUTIONS.iterdir() if d.is_dir()) if RESOLUTIONS.is_dir() else []
    if not folders:
        return problems
    original = upstream_package()
    state = dict(original)
    after: dict[str, dict[str, bytes]] = {}  # the package after each patch, for the files the resolutions change
    resolved = {t for folder in folders for r in folder.glob("*.patch") if r.name in by_name
                for t in by_name[r.name].targets()}
    for patch in patches:
        apply_patch(parse(patch.name, patch.path.read_bytes().decode("utf-8")), state)
        after[patch.name] = {path: state[path[len("src/"):]] for path in resolved}
    for folder in folders:
        chosen = {}
        for resolution in sorted(folder.glob("*.patch")):
            where = f"resolutions/{folder.name}/{resolution.name}"
            if resolution.name not in by_name:
                problems.append(f"{where} resolves no patch of the series")
                continue
            chosen[resolution.name] = resolution
            mine, theirs = by_name[resolution.name], read_patch(resolution)
            if set(mine.targets()) != set(theirs.targets()):
                problems.append(f"{where} changes {theirs.targets()}, the patch {mine.targets()}")
            problems += header_problems(where, mine, theirs, folder.name)
        problems += check_test_resolutions(folder, chosen, patches)
        order = [p.name for p in patches if p.name in chosen]
        for path in sorted({t for name in chosen for t in by_name[name].targets()}):
            key = path[len("src/"):]
            upstream_lines = set(original[key].decode("utf-8").splitlines())
            names = [n for n in order if path in by_name[n].targets()]
            series_added = {ln for p in patches if path in p.targets() for ln in changed_lines(p.path, path, "+")}
            for i, name in enumerate(names):
                where = f"resolutions/{folder.name}/{name} ({path})"
                added_here = changed_lines(chosen[name], path, "+")
                later_added = collections.Counter()
                later_removed: set[str] = set()
                for later in names[i + 1:]:
                    later_added += changed_lines(chosen[later], path, "+")
                    later_removed |= set(changed_lines(chosen[later], path, "-"))
                lost = changed_lines(by_name[name].path, path, "+") - (post_image(chosen[name], path) + later_added)
                if lost:
                    problems.append(f"{where} does not add what the series' patch adds (re-record it):\n"
                                    + "".join(f"    {ln}\n" for ln in lost.elements()))
                extra = [ln for ln in added_here if ln not in series_added | later_removed | upstream_lines]
                if extra:
                    problems.append(f"{where} adds lines the series does not (re-record it):\n"
                                    + "".join(f"    {ln}\n" for ln in extra))
            # the last resolution of the file leads where its patch leads the pinned release (the patches after it,
            # which have no resolution, then apply to both bases alike: the whole series, if none touches the file)
            if names and not reverse_applies(chosen[names[-1]], path, after[names[-1]][path]):
                problems.append(f"resolutions/{folder.name}/{names[-1]} does not end {path} where the series does"
                                " (its result is not the series' result; re-record it)")
    return problems


def header_problems(where: str, mine: SeriesPatch, theirs: SeriesPatch, base: str) -> list[str]:
    """A recorded resolution keeps its patch's header: the same fields, the Description extended, ``Resolves:``
    added (what it reconciles on ``base``)."""
    problems = []
    expected, got = dict(mine.fields()), dict(theirs.fields())
    if "Resolves" not in got:
        problems.append(f"{where} has no `Resolves:` field (what it reconciles on {base})")
    got.pop("Resolves", None)
    if not got.pop("Description", "").startswith(expected.pop("Description", "")):
        problems.append(f"{where}: its Description must start with the patch's")
    if got != expected:
        problems.append(f"{where}: its header fields differ from the patch's")
    return problems


def check_test_resolutions(folder: Path, chosen: dict[str, Path], patches: list[SeriesPatch]) -> list[str]:
    """Test patches for the other base: a recorded one keeps its header (Description extended, ``Resolves:``); one
    that only that base needs follows a patch the base has a resolution of. Their content is checked where the
    other base's tests are, by ``make pr`` and ``make upstream-test``."""
    problems = []
    ours = {p.name: p for p in read_series(TEST_PATCHES)}
    stems = {by.stem for by in patches if by.name in chosen}
    for path in sorted((folder / "test-patches").glob("*.patch")):
        where = f"resolutions/{folder.name}/test-patches/{path.name}"
        theirs = read_patch(path)
        if path.name in ours:
            problems += header_problems(where, ours[path.name], theirs, folder.name)
        elif theirs.accompanies() not in stems:
            problems.append(f"{where} must accompany a patch that has a {folder.name} resolution, not"
                            f" {theirs.accompanies()}")
    return problems


def changed_lines(patch_path: Path, path: str, sign: str) -> collections.Counter:
    """The lines a patch adds (``sign="+"``) or removes (``"-"``) in ``path``."""
    out: collections.Counter = collections.Counter()
    target = None
    for line in patch_path.read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ b/"):
            target = line[6:]
        elif line.startswith(("--- ", "diff --git", "index ")):
            continue
        elif target == path and line.startswith(sign):
            out[line[1:]] += 1
    return out


def post_image(patch_path: Path, path: str) -> collections.Counter:
    """The lines of ``path`` that the patch's hunks leave: context and added lines."""
    return changed_lines(patch_path, path, "+") + changed_lines(patch_path, path, " ")


def reverse_applies(patch_path: Path, path: str, result: bytes) -> bool:
    """Whether the patch's post-image of ``path`` is found in ``result``: ``git apply -R --check`` on it."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / path
        target.parent.mkdir(parents=True)
        target.write_bytes(result)
        done = subprocess.run(["git", "apply", "-R", "--check", f"--include={path}", str(patch_path)], cwd=tmp,
                              capture_output=True, text=True)
        return done.returncode == 0


# --- prefixes --------------------------------------------------------------------------------------------------------


def upstream_package() -> dict[str, bytes]:
    pin = read_pin()
    folder = HERE / "results" / "wheels"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", choices=["all", "new", "none"], default="all",
                        help="which added tests each prefix runs (default: all so far)")
    parser.add_argument("--claims-only", action="store_true", help="only the claims and the churn")
    parser.add_argument("--from", dest="first", type=int, default=1, help="start at this prefix (1-based)")
    parser.add_argument("--keep", type=Path, help="write the prefixes here instead of a temporary folder")
    parser.add_argument("--max-churn", type=float, default=MAX_CHURN)
    parser.add_argument("--pytest-args", default="-x", help="extra pytest arguments, one string (default: -x)")
    args = parser.parse_args(argv)
    try:
        patches = read_series(SOURCE_PATCHES)
        problems = check_claims(patches, read_series(TEST_PATCHES)) + check_resolutions(patches)
        problems += check_layers(patches) + check_stack(patches)
        for layer in ("forwarded", "fork-only"):
            again, total, detail = churn(patches, layer)
            share = again / total if total else 0.0
            log(f"churn, {layer} layer: {again} of {total} added lines are removed again by a later patch"
                f" ({share:.1%}){''.join(chr(10) + '  ' + d for d in detail)}")
            if share > args.max_churn:
                problems.append(f"churn in the {layer} layer {share:.1%} is above {args.max_churn:.0%}:\n  "
                                + "\n  ".join(detail))
        if problems:
            print("\n".join(f"- {p}" for p in problems), file=sys.stderr)
            return 1
        log(f"claims: every own file belongs to one of {len(patches)} patches or is fork-only")
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


if __name__ == "__main__":
    sys.exit(main())
