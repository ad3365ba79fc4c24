#!/usr/bin/env python3
"""Turn the fork into a pull-request branch on an upstream Lightning checkout: one commit per concern.

    python3 tools/upstream/make_pr.py --upstream ../pytorch-lightning [--branch NAME]     (make pr UPSTREAM=...)

In that checkout (which must have no uncommitted changes to tracked files) it creates a new branch from the current
HEAD (a 2.6.x tag or master) and commits, in order:

1. one commit per patch of ``patches/series``, holding the whole concern: the patch (``git apply --index``), the
   fork's own files its ``Adds:`` field names (modules and tests, new files in upstream's layout), the upstream test
   patches of ``tools/upstream/test-patches/`` that accompany it (``Accompanies:``: tests that pin the behaviour it
   changes on purpose, updated), and its entries of our ``CHANGELOG.md`` "Unreleased" section under the unreleased
   heading of upstream's ``src/lightning/pytorch/CHANGELOG.md`` (and ``src/lightning/fabric/CHANGELOG.md`` for
   entries that touch Fabric), without our patch numbers. The message is the patch's DEP-3 header.
   Where a patch does not apply because that upstream changed the same code (master: #21616, #21436), its recorded
   resolution ``tools/upstream/resolutions/<base>/<patch>`` is used instead: the same concern and header, the
   commit message extended by what it reconciles. ``check_series.py`` (in CI) checks offline that every resolution
   still leads to the code the series leads to.
2. the test patches that accompany no patch (fixes to upstream tests, e.g. a regex that does not escape the local
   version label), one commit each;
3. the documentation: our pages under ``docs/source-pytorch/`` with the first patch of ``docs/patches/series``, then
   one commit per further docs patch (the includes and links that put our pages into upstream's docs).

The series' patches marked ``Forwarded: not-needed`` (fork-only and not meant for upstream, e.g.
0023-cpu-16-mixed-is-float16.patch) are left out, with their own files, accompanying test patches and CHANGELOG
entries; ``--with-not-needed`` keeps them (the whole fork as one branch). The forwarded layer and the fork-only
patches awaiting an RFC or an issue are all kept: the branch is what upstream could take, one concern a commit.
Our files listed in ``tools/upstream/fork-only`` (the fork's packaging tests) are left out; a file of ours that no
patch claims stops the run. A patch that does not apply (nor a resolution of it) stops the run with the patch's name
and, file by file, git's reason; the checkout is then put back exactly as it was (original branch checked out, the
new branch deleted). Commits are written with ``git write-tree --missing-ok``, so a partial clone whose large binary
files are absent works too. Standard library only.
Exit status: 0 done, 1 a patch or file conflicts, 2 bad usage or an unusable checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import (  # noqa: E402
    REPO,
    RESOLUTIONS,
    SOURCE_PATCHES,
    TEST_PATCHES,
    Failure,
    SeriesPatch,
    conflicts,
    git,
    read_series,
    resolutions,
    test_resolutions,
    unclaimed,
)

OWN_FOLDERS = ("src", "tests/tests_pytorch", "tests/tests_fabric", "docs/source-pytorch")
DOCS_FOLDER = "docs/source-pytorch"
SKIP_PARTS = ("__pycache__",)
SKIP_SUFFIXES = (".pyc", ".pyo")
CHANGELOGS = {"pytorch": "src/lightning/pytorch/CHANGELOG.md", "fabric": "src/lightning/fabric/CHANGELOG.md"}
SECTION_ORDER = ["Added", "Changed", "Deprecated", "Removed", "Fixed"]
_FABRIC = re.compile(r"lightning\.fabric|\bfabric\b", re.I)


class Conflict(Failure):
    """Something of ours does not fit the checkout (exit 1, as opposed to bad usage)."""


def default_branch() -> str:
    local = "fork"
    pin = REPO / "upstream.toml"
    if pin.is_file():
        match = re.search(r'^local\s*=\s*"([^"]+)"', pin.read_text(encoding="utf-8"), re.M)
        if match:
            local = match.group(1)
    return f"lightning-fork/{local}"


def identity_env(checkout: Path) -> dict[str, str]:
    """The checkout's git identity if it has one (the PR is the maintainer's), else a stated fallback."""
    env = dict(os.environ)
    if not git(checkout, "config", "user.name", check=False).stdout.strip():
        env.setdefault("GIT_AUTHOR_NAME", "lightning-amp fork")
        env.setdefault("GIT_COMMITTER_NAME", "lightning-amp fork")
    if not git(checkout, "config", "user.email", check=False).stdout.strip():
        env.setdefault("GIT_AUTHOR_EMAIL", "lightning-amp-fork@localhost")
        env.setdefault("GIT_COMMITTER_EMAIL", "lightning-amp-fork@localhost")
    return env


def commit(checkout: Path, message: str, env: dict[str, str]) -> str:
    """Commit the index. ``write-tree --missing-ok``: a partial clone may lack blobs of files we never touch."""
    tree = git(checkout, "write-tree", "--missing-ok").stdout.strip()
    parent = git(checkout, "rev-parse", "HEAD").stdout.strip()
    done = subprocess.run(["git", "-C", str(checkout), "commit-tree", tree, "-p", parent, "-F", "-"], input=message,
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise Failure(f"`git commit-tree` failed in {checkout}:\n{done.stderr.strip()}")
    sha = done.stdout.strip()
    git(checkout, "update-ref", "-m", "make_pr", "HEAD", sha, parent)
    return sha[:10]


def applicable(checkout: Path, patch: SeriesPatch, kind: str, alternatives: dict[str, SeriesPatch]) -> SeriesPatch:
    """The patch, or its recorded resolution for this checkout's base when only that applies."""
    reasons = conflicts(checkout, patch)
    if not reasons:
        return patch
    for resolution in alternatives.values():
        if not conflicts(checkout, resolution):
            return resolution
    files = ", ".join(r.split(":", 1)[0] for r in reasons)
    tried = f" (nor its recorded resolution for {', '.join(alternatives)})" if alternatives else ""
    raise Conflict(
        f"{kind} patch {patch.name}{tried} does not apply to {checkout} (conflicting file(s): {files}):\n"
        + "\n".join(f"  {r}" for r in reasons)
        + "\nrefresh it against this upstream, or record a resolution (CONTRIBUTING.md, 'Recorded resolutions')"
    )


def apply_index(checkout: Path, patch: SeriesPatch) -> None:
    git(checkout, "apply", "--index", "--whitespace=nowarn", str(patch.path))


def own_files(repo: Path) -> dict[str, Path]:
    """Our files to lay onto upstream: tracked or new (not ignored) files under OWN_FOLDERS, read from the work tree."""
    listed = git(repo, "ls-files", "--cached", "--others", "--exclude-standard", "--", *OWN_FOLDERS).stdout
    files = {}
    for name in filter(None, listed.splitlines()):
        path = repo / name
        parts = Path(name).parts
        if not path.is_file() or any(p in SKIP_PARTS for p in parts) or name.endswith(SKIP_SUFFIXES):
            continue
        files[name] = path
    return files


def lay(checkout: Path, repo: Path, names: list[str]) -> list[str]:
    """Copy our files ``names`` into the checkout and stage them; refuse to overwrite an upstream file."""
    clashes = [n for n in names if (checkout / n).exists() and (checkout / n).read_bytes() != (repo / n).read_bytes()]
    if clashes:
        raise Conflict(
            "our own files would overwrite upstream files (change those through a patch instead):\n"
            + "\n".join(f"  {name}" for name in clashes)
        )
    written = []
    for name in names:
        target = checkout / name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(repo / name, target)
        written.append(name)
    if written:
        git(checkout, "add", "--", *written)
    return written


# --- CHANGELOG -------------------------------------------------------------------------------------------------------


def read_unreleased(
    changelog: Path, bugs: dict[str, list[str]] | None = None, keep_numbers: bool = False
) -> dict[str, list[str]]:
    """Our "Unreleased" section: subsection -> entries, each one line, without our patch numbers. A subsection whose
    title starts with "Fork" (the fork's own packaging) is not upstream's business and is left out.

    ``bugs`` maps a patch number ("0001") to the upstream issues of its header's ``Bug:`` field: an entry that links
    no issue itself gets those links in place of its patch number. ``keep_numbers`` keeps the patch numbers at the
    end of each entry (``..., 0004)``), for the caller to sort entries by patch.
    """
    lines = changelog.read_text(encoding="utf-8").splitlines()
    start = next((i for i, ln in enumerate(lines) if re.match(r"^## \[?unreleased", ln, re.I)), None)
    if start is None:
        raise Failure(f"{changelog} has no '## [Unreleased]' section")
    sections: dict[str, list[str]] = {}
    current = None
    entry: list[str] | None = None

    def close() -> None:
        nonlocal entry
        if entry is not None and current is not None and not current.lower().startswith("fork"):
            text = with_issue_links(" ".join(part.strip() for part in entry), bugs or {}, keep_numbers)
            if text.strip("- "):
                sections.setdefault(current, []).append(text)
        entry = None

    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("### "):
            close()
            current = line[4:].strip()
            continue
        if line.startswith("- "):
            close()
            entry = [line]
        elif line.startswith("  ") and entry is not None:
            entry.append(line)
        else:
            close()
    close()
    return sections


def with_issue_links(entry: str, bugs: dict[str, list[str]], keep_numbers: bool = False) -> str:
    """Replace the entry's patch numbers by the issues their patches answer, unless the entry links an issue."""
    match = re.search(r"(\d{4}(?:\s*,\s*\d{4})*)\)$", entry)
    numbers = re.findall(r"\d{4}", match.group(1)) if match else []
    suffix = f" ({', '.join(numbers)})" if keep_numbers and numbers else ""
    entry = strip_patch_numbers(entry)
    if "[#" in entry:
        return entry + suffix
    urls = [url for number in numbers for url in bugs.get(number, [])]
    urls = list(dict.fromkeys(urls))
    if not urls:
        return entry + suffix
    links = ", ".join(f"[#{url.rstrip('/').rsplit('/', 1)[-1]}]({url})" for url in urls)
    return f"{entry} ({links}){suffix}"


def patch_bugs(patches: list[SeriesPatch]) -> dict[str, list[str]]:
    """Patch number ("0004") -> the upstream issue/PR URLs of its ``Bug:`` field."""
    out = {}
    for patch in patches:
        number = patch.name[:4]
        if number.isdigit():
            out[number] = re.findall(r"https://github\.com/Lightning-AI/[\w.-]+/(?:issues|pull)/\d+",
                                     patch.fields().get("Bug", ""))
    return out


def strip_patch_numbers(entry: str) -> str:
    """``... ([#1](...), 0003)`` -> ``... ([#1](...))`` and ``... (0001)`` -> ``...``: patch numbers are the fork's."""
    entry = re.sub(r",\s*\d{4}(?:\s*,\s*\d{4})*\)$", ")", entry)
    entry = re.sub(r"\s*\(\d{4}(?:\s*,\s*\d{4})*\)$", "", entry)
    return entry


def insert_entries(text: str, sections: dict[str, list[str]], where: str) -> str:
    """Insert the entries under the first unreleased heading of an upstream CHANGELOG, subsection by subsection.

    Existing entries stay first; upstream's empty placeholder bullet ("-") goes where we add entries; a subsection
    upstream lacks is created in Keep-a-Changelog order. Sections we do not touch keep their lines exactly.
    """
    lines = text.split("\n")
    start = next((i for i, ln in enumerate(lines) if re.match(r"^## \[?unreleased", ln, re.I)), None)
    if start is None:
        first = next((i for i, ln in enumerate(lines) if ln.startswith("## ")), None)
        if first is None:
            raise Conflict(f"{where}: no '## [Unreleased]' (or any '## ') heading to put our entries under")
        lines[first:first] = ["## [unreleased] - YYYY-MM-DD", "", "---", ""]
        start = first
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    region = lines[start + 1 : end]
    tail_at = len(region)
    while tail_at > 0 and region[tail_at - 1].strip() in ("", "---", "--"):
        tail_at -= 1
    region, tail = region[:tail_at], region[tail_at:]
    heads = [i for i, ln in enumerate(region) if ln.startswith("### ")]
    preamble = region[: heads[0]] if heads else region
    order: list[str] = []
    bodies: dict[str, list[str]] = {}
    titles: dict[str, str] = {}
    for n, at in enumerate(heads):
        title = region[at][4:].strip()
        key = title.lower()
        order.append(key)
        titles[key] = title
        bodies[key] = region[at + 1 : heads[n + 1] if n + 1 < len(heads) else len(region)]
    touched = set()
    for name, entries in sections.items():
        key = name.lower()
        if key not in bodies:
            later = [k for k in order if _order(k) > _order(key)]
            order.insert(order.index(later[0]) if later else len(order), key)
            titles[key], bodies[key] = name, []
        kept = [ln for ln in bodies[key] if ln.strip() and ln.strip() != "-"]
        bodies[key] = kept + entries
        touched.add(key)
    out = lines[: start + 1] + preamble
    for n, key in enumerate(order):
        body = bodies[key]
        if key in touched:
            rendered = [""]
            for item in body:
                rendered += [item, ""]
            if n == len(order) - 1 and tail[:1] == [""]:
                rendered.pop()
            body = rendered
        elif n < len(order) - 1 and (not body or body[-1].strip()):
            body = [*body, ""]
        out += [f"### {titles[key]}", *body]
    return "\n".join(out + tail + lines[end:])


def _order(name: str) -> int:
    lowered = [s.lower() for s in SECTION_ORDER]
    return lowered.index(name.lower()) if name.lower() in lowered else len(SECTION_ORDER)


def changelog_by_patch(changelog: Path, source: list[SeriesPatch]) -> dict[str, dict[str, list[str]]]:
    """Our "Unreleased" entries grouped by the patch that completes them (the last patch number an entry names;
    entries that name none go with the last patch), each entry without our patch numbers."""
    if not changelog.is_file():
        return {}
    numbers = [patch.name[:4] for patch in source]
    grouped: dict[str, dict[str, list[str]]] = {}
    for section, entries in read_unreleased(changelog, patch_bugs(source), keep_numbers=True).items():
        for entry in entries:
            named = [n for n in re.findall(r"\b(\d{4})\b", _trailing_numbers(entry)) if n in numbers]
            owner = max(named, key=numbers.index) if named else numbers[-1]
            grouped.setdefault(owner, {}).setdefault(section, []).append(strip_patch_numbers(entry))
    return grouped


def _trailing_numbers(entry: str) -> str:
    match = re.search(r"(\d{4}(?:\s*,\s*\d{4})*)\)$", entry)
    return match.group(1) if match else ""


def add_changelog(checkout: Path, sections: dict[str, list[str]]) -> None:
    """Put ``sections`` (subsection -> entries) under upstream's unreleased headings and stage the files."""
    if not sections:
        return
    fabric = {name: [e for e in entries if _FABRIC.search(e)] for name, entries in sections.items()}
    fabric = {name: entries for name, entries in fabric.items() if entries}
    changed = []
    for package, entries in (("pytorch", sections), ("fabric", fabric)):
        if not entries:
            continue
        path = checkout / CHANGELOGS[package]
        if not path.is_file():
            raise Conflict(f"upstream has no {CHANGELOGS[package]} to add our entries to")
        text = insert_entries(path.read_text(encoding="utf-8"), entries, CHANGELOGS[package])
        path.write_text(text, encoding="utf-8")
        changed.append(CHANGELOGS[package])
    git(checkout, "add", "--", *changed)


# --- main ------------------------------------------------------------------------------------------------------------


def make_pr(checkout: Path, branch: str, repo: Path = REPO, test_patches: bool = True,
            with_not_needed: bool = False) -> list[str]:
    """Build the branch; returns a report, one line per commit. Raises Failure after restoring the checkout."""
    if not (checkout / ".git").exists():
        raise Failure(f"{checkout} is not a git checkout (expected an upstream Lightning clone with a work tree)")
    if not (checkout / "src" / "lightning" / "pytorch").is_dir():
        raise Failure(f"{checkout} does not look like upstream Lightning (no src/lightning/pytorch)")
    if checkout.resolve() == repo.resolve() or repo.resolve() in checkout.resolve().parents:
        raise Failure("the upstream checkout must live outside this repository")
    dirty = git(checkout, "status", "--porcelain", "--untracked-files=no").stdout.strip()
    if dirty:
        raise Failure(f"{checkout} has uncommitted changes; commit or stash them first:\n{dirty}")
    if git(checkout, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False).returncode == 0:
        raise Failure(f"branch {branch} already exists in {checkout}; pass --branch NAME or delete it")
    original = git(checkout, "symbolic-ref", "--quiet", "--short", "HEAD", check=False).stdout.strip()
    base = git(checkout, "rev-parse", "HEAD").stdout.strip()
    env = identity_env(checkout)
    source = read_series(repo / SOURCE_PATCHES.relative_to(REPO))
    tests = read_series(repo / TEST_PATCHES.relative_to(REPO)) if test_patches else []
    report = [f"base {base[:10]} ({original or 'detached HEAD'}) -> branch {branch}"]
    missing = unclaimed([n for n in own_files(repo) if not n.startswith(DOCS_FOLDER)], source)
    if missing:
        raise Failure(
            "our files that no patch claims (name them in the `Adds:` field of their patch, or in"
            " tools/upstream/fork-only):\n" + "\n".join(f"  {name}" for name in missing)
        )
    if not with_not_needed:
        left_out = [patch for patch in source if patch.fields().get("Forwarded", "").startswith("not-needed")]
        source = [patch for patch in source if patch not in left_out]
        report += [f"left out  {patch.name} (Forwarded: not-needed)" for patch in left_out]
    accompanying: dict[str, list[SeriesPatch]] = {}
    for test in tests:
        accompanying.setdefault(test.accompanies() or "", []).append(test)
    recorded = resolutions(repo / RESOLUTIONS.relative_to(REPO))
    recorded_tests = test_resolutions(repo / RESOLUTIONS.relative_to(REPO)) if test_patches else {}
    known_tests = {test.name for test in tests}
    active: set[str] = set()  # the bases whose resolutions this checkout needed: their own test patches apply too
    entries = changelog_by_patch(repo / "CHANGELOG.md", source)
    git(checkout, "checkout", "-q", "-b", branch)
    try:
        for patch in source:
            alternatives = {name: found[patch.name] for name, found in recorded.items() if patch.name in found}
            chosen = applicable(checkout, patch, "source", alternatives)
            if chosen is not patch:
                active.add(chosen.path.parent.name)
            apply_index(checkout, chosen)
            laid = lay(checkout, repo, patch.adds())
            tests_here = accompanying.get(patch.stem, []) + [
                extra for base_name in sorted(active) for name, extra in recorded_tests[base_name].items()
                if name not in known_tests and extra.accompanies() == patch.stem
            ]
            for test in tests_here:
                test_alternatives = {b: found[test.name] for b, found in recorded_tests.items() if test.name in found}
                apply_index(checkout, applicable(checkout, test, "test", test_alternatives))
            add_changelog(checkout, entries.get(patch.name[:4], {}))
            message = chosen.commit_message()
            if tests_here:
                message += "".join(f"Test-Patch: {test.name}\n" for test in tests_here)
            sha = commit(checkout, message, env)
            how = f" (recorded resolution: {chosen.path.parent.name})" if chosen is not patch else ""
            extras = ", ".join(filter(None, [f"{len(laid)} own file(s)" if laid else "",
                                             f"{len(tests_here)} test patch(es)" if tests_here else "",
                                             "CHANGELOG" if patch.name[:4] in entries else ""]))
            targets = ", ".join(patch.targets())
            report.append(f"{sha}  {patch.name}{how}: {targets}" + (f" + {extras}" if extras else ""))
        for test in accompanying.get("", []):
            apply_index(checkout, applicable(checkout, test, "test", {}))
            sha = commit(checkout, test.commit_message(), env)
            report.append(f"{sha}  test patch {test.name}: {', '.join(test.targets())}")
        pages = sorted(n for n in own_files(repo) if n.startswith(DOCS_FOLDER))
        for n, patch in enumerate(read_series(repo / "docs" / "patches")):
            # our pages first: these patches include them in upstream's pages
            laid = lay(checkout, repo, pages) if n == 0 else []
            apply_index(checkout, applicable(checkout, patch, "docs", {}))
            sha = commit(checkout, patch.commit_message(), env)
            report.append(f"{sha}  docs patch {patch.name}: {', '.join(patch.targets())}"
                          + (f" + {len(laid)} page(s)" if laid else ""))
    except BaseException:
        git(checkout, "reset", "-q", "--hard", "HEAD", check=False)
        git(checkout, "checkout", "-q", original or base, check=False)
        git(checkout, "branch", "-q", "-D", branch, check=False)
        raise
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True, type=Path, help="an upstream Lightning git checkout")
    parser.add_argument("--branch", default=None, help=f"the new branch (default: {default_branch()})")
    parser.add_argument("--no-test-patches", action="store_true", help="leave upstream's tests as they are")
    parser.add_argument("--with-not-needed", action="store_true",
                        help="also the patches marked `Forwarded: not-needed` (left out by default)")
    args = parser.parse_args(argv)
    checkout = args.upstream.expanduser().resolve()
    branch = args.branch or default_branch()
    try:
        report = make_pr(checkout, branch, test_patches=not args.no_test_patches,
                         with_not_needed=args.with_not_needed)
    except Conflict as err:
        print(f"make_pr: STOPPED: {err}\nmake_pr: {checkout} is back as it was; branch {branch} was not kept",
              file=sys.stderr)
        return 1
    except Failure as err:
        print(f"make_pr: {err}", file=sys.stderr)
        return 2
    uncommitted = git(REPO, "status", "--porcelain", "--", "patches", "tools/upstream/test-patches", "CHANGELOG.md",
                      *OWN_FOLDERS, check=False).stdout.strip()
    if uncommitted:
        print("make_pr: note: the branch was built from this repository's work tree, which differs from its HEAD in:\n"
              + "\n".join(f"  {line}" for line in uncommitted.splitlines()), file=sys.stderr)
    print("\n".join(report))
    print(f"make_pr: branch {branch} is ready in {checkout}; see CONTRIBUTING.md for the PR description")
    return 0


if __name__ == "__main__":
    sys.exit(main())
