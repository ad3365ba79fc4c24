#!/usr/bin/env python3
"""Turn the fork into a pull-request branch on an upstream Lightning checkout.

    python3 tools/upstream/make_pr.py --upstream ../pytorch-lightning [--branch NAME]     (make pr UPSTREAM=...)

In that checkout (which must have no uncommitted changes to tracked files) it creates a new branch from the current
HEAD and commits, in order:

1. each patch of ``patches/series``, one commit each (``git apply --index``), the patch's DEP-3 header as the message;
2. each patch of ``tools/upstream/test-patches/series``: upstream tests that pin the behaviour our patches change on
   purpose, updated (one commit each, same rules);
3. the fork's own files, one commit: ``src/**`` (our modules), ``tests/tests_pytorch/**``, ``tests/tests_fabric/**``
   and ``docs/source-pytorch/**`` where present; a file that upstream already has with other content stops the run
   (upstream files change through patches only);
4. each patch of ``docs/patches/series``, one commit each: the includes and links that put our pages into upstream's
   documentation;
5. the entries of the "Unreleased" section of our ``CHANGELOG.md`` under the unreleased heading of upstream's
   ``src/lightning/pytorch/CHANGELOG.md`` (and ``src/lightning/fabric/CHANGELOG.md`` for entries that touch Fabric),
   without our patch numbers.

A patch that does not apply stops the run with the patch's name and, file by file, git's reason; the checkout is
then put back exactly as it was (original branch checked out, the new branch deleted). Standard library only.
Exit status: 0 done, 1 a patch or file conflicts, 2 bad usage or an unusable checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import REPO, SOURCE_PATCHES, TEST_PATCHES, Failure, SeriesPatch, conflicts, git, read_series  # noqa: E402

OWN_FOLDERS = ("src", "tests/tests_pytorch", "tests/tests_fabric", "docs/source-pytorch")
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
    with tempfile.NamedTemporaryFile("w", suffix=".msg", delete=False, encoding="utf-8") as handle:
        handle.write(message)
    try:
        git(checkout, "-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-F", handle.name, env=env)
    finally:
        os.unlink(handle.name)
    return git(checkout, "rev-parse", "--short", "HEAD").stdout.strip()


def apply_patch(checkout: Path, patch: SeriesPatch, kind: str, env: dict[str, str]) -> str:
    reasons = conflicts(checkout, patch)
    if reasons:
        files = ", ".join(r.split(":", 1)[0] for r in reasons)
        raise Conflict(
            f"{kind} patch {patch.name} does not apply to {checkout} (conflicting file(s): {files}):\n"
            + "\n".join(f"  {r}" for r in reasons)
            + "\nrefresh it against this upstream (or rebase it by hand) before opening the PR"
        )
    git(checkout, "apply", "--index", "--whitespace=nowarn", str(patch.path))
    return commit(checkout, patch.commit_message(), env)


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


def lay_own_files(checkout: Path, repo: Path, env: dict[str, str]) -> tuple[str | None, list[str]]:
    files = own_files(repo)
    clashes, written = [], []
    for name, source in sorted(files.items()):
        target = checkout / name
        if target.exists():
            if target.is_file() and target.read_bytes() == source.read_bytes():
                continue
            clashes.append(name)
    if clashes:
        raise Conflict(
            "our own files would overwrite upstream files (change those through a patch instead):\n"
            + "\n".join(f"  {name}" for name in clashes)
        )
    for name, source in sorted(files.items()):
        target = checkout / name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        written.append(name)
    if not written:
        return None, []
    git(checkout, "add", "--", *written)
    message = (
        "Add the fork's own modules and tests\n\n"
        "New files only, in upstream's layout: the modules the patches use and the tests that prove the behaviour\n"
        "against PyTorch's AMP recipe (bitwise, on CPU).\n\n"
        + "\n".join(f"- {name}" for name in written)
        + "\n"
    )
    return commit(checkout, message, env), written


# --- CHANGELOG -------------------------------------------------------------------------------------------------------


def read_unreleased(changelog: Path, bugs: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Our "Unreleased" section: subsection -> entries, each one line, without our patch numbers. A subsection whose
    title starts with "Fork" (the fork's own packaging) is not upstream's business and is left out.

    ``bugs`` maps a patch number ("0001") to the upstream issues of its header's ``Bug:`` field: an entry that links
    no issue itself gets those links in place of its patch number.
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
            text = with_issue_links(" ".join(part.strip() for part in entry), bugs or {})
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


def with_issue_links(entry: str, bugs: dict[str, list[str]]) -> str:
    """Replace the entry's patch numbers by the issues their patches answer, unless the entry links an issue."""
    match = re.search(r"(\d{4}(?:\s*,\s*\d{4})*)\)$", entry)
    numbers = re.findall(r"\d{4}", match.group(1)) if match else []
    entry = strip_patch_numbers(entry)
    if "[#" in entry:
        return entry
    urls = [url for number in numbers for url in bugs.get(number, [])]
    urls = list(dict.fromkeys(urls))
    if not urls:
        return entry
    links = ", ".join(f"[#{url.rstrip('/').rsplit('/', 1)[-1]}]({url})" for url in urls)
    return f"{entry} ({links})"


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


def add_changelog(checkout: Path, repo: Path, env: dict[str, str]) -> str | None:
    ours = repo / "CHANGELOG.md"
    if not ours.is_file():
        return None
    sections = read_unreleased(ours, patch_bugs(read_series(repo / SOURCE_PATCHES.relative_to(REPO))))
    if not sections:
        return None
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
    message = (
        "Update the CHANGELOGs\n\n"
        "The fork's CHANGELOG.md \"Unreleased\" entries under upstream's unreleased heading"
        + (" (entries that touch Fabric in Fabric's too)" if fabric else "")
        + ".\n"
    )
    return commit(checkout, message, env)


# --- main ------------------------------------------------------------------------------------------------------------


def make_pr(checkout: Path, branch: str, repo: Path = REPO, test_patches: bool = True) -> list[str]:
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
    git(checkout, "checkout", "-q", "-b", branch)
    try:
        for kind, patches in (("source", source), ("test", tests)):
            for patch in patches:
                sha = apply_patch(checkout, patch, kind, env)
                report.append(f"{sha}  {kind} patch {patch.name}: {', '.join(patch.targets())}")
        sha, written = lay_own_files(checkout, repo, env)
        if sha:
            report.append(f"{sha}  own files: {len(written)} new file(s)")
        for patch in read_series(repo / "docs" / "patches"):
            # after our pages exist: these include them in upstream's pages
            sha = apply_patch(checkout, patch, "docs", env)
            report.append(f"{sha}  docs patch {patch.name}: {', '.join(patch.targets())}")
        sha = add_changelog(checkout, repo, env)
        if sha:
            report.append(f"{sha}  CHANGELOG entries")
    except BaseException:
        git(checkout, "am", "--abort", check=False)  # nothing uses am, but leave no half-done state of any kind
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
    args = parser.parse_args(argv)
    checkout = args.upstream.expanduser().resolve()
    branch = args.branch or default_branch()
    try:
        report = make_pr(checkout, branch, test_patches=not args.no_test_patches)
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
