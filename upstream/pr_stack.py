"""Build and check the stack of small upstream pull requests: one branch per folder of ``upstream/stack/``.

    python3 -m upstream.pr_stack --upstream ../pytorch-lightning      (make pr-stack UPSTREAM=...)
    python3 -m upstream.pr_stack --check                              (the folders only; no clone, CI runs it)

Each folder ``upstream/stack/<NN>-<slug>/`` is one proposed PR, written against upstream master (``changes.patch``
applies there alone), and holds:

``pr.toml``         ``branch = "amp/<slug>"``, ``title`` (imperative, under 72 characters), ``closes = ["#NNNNN"]``
                    (the open upstream issues it fixes; ``[]`` for a follow-up that no issue tracks), ``touches_tests``
                    (the upstream test files the change could affect), ``merge_order`` (1, 2, ...: the order in which
                    the PRs are meant to merge; NN only orders the listing)
``changes.patch``   ``git diff --binary`` of the whole PR against the base commit (source, tests, docs, CHANGELOGs)
``description.md``  the PR text a maintainer reads: upstream's PR template, at most 300 words
``issue`` (optional) in ``pr.toml``: the file of ``upstream/issues/`` that drafts the upstream issue the PR links
                    (``--check``, which CI runs on this repository's stack, requires it of every PR)

Each PR is checked twice against the clone: **alone** (the patch applies to the base; the branch ``<branch>`` is made
from it: one commit on the base, made in a temporary index, subject = title, body = the description's first paragraph
and one ``Fixes #N`` line per closed issue) and **in order** (its branch's changes merge, file by file with
``git merge-file``, onto the base with every PR of a lower ``merge_order`` merged: the state after its predecessors were
merged upstream). A conflict in order fails the run, naming the PR, its predecessors and the file; only a
``CHANGELOG.md`` conflict is resolved by keeping both sides' entries (``--union``, as a maintainer does), and the
manifest says so. The in-order states are one chain of commits, one per PR, on the branch ``amp/stack-in-order``.

Before any branch is made, every folder is checked: its ``pr.toml`` keys, its description (no words about this
repository's own process, and its merge order stated), and the limits per PR (changed lines, added plus removed: at
most 400 under ``src/``, 600 under ``tests/``, 300 under ``docs/``); a failure names the PR and the limit. A branch
that exists already is refused (``--force`` replaces it). On any failure the branches this run created are deleted and
replaced ones restored: the clone is left exactly as it was. Last, the manifest ``build/pr-stack/stack.json``:
``{"base": ..., "order": [...], "in_order_branch": ..., "prs": [{"branch", "title", "closes", "description", "lines",
"merge_order", "commit", "in_order_commit", "union_merged"}]}``.

Exit status: 0 built (or, with ``--check``, the folders are well formed), 1 a folder is not (or its patch does not
apply alone or in order), 2 bad usage or a clone that cannot be used. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from forkbuild.series import REPO, Failure, git, identity_env

HERE = Path(__file__).resolve().parent

#: upstream master at the time of writing: every PR of the stack is a diff against it
BASE = "7f0c3436cd3f6ad3753125672024fc415cbcb414"
STACK = HERE / "stack"
OUT = REPO / "build" / "pr-stack"
LIMITS = {"src": 400, "tests": 600, "docs": 300}
KEYS = {"branch": str, "title": str, "closes": list, "touches_tests": list, "merge_order": int}
OPTIONAL_KEYS = {"issue": str}
#: the most words a description may have (upstream's PR template included; HTML comments not counted)
WORDS_MAX = 300
IN_ORDER_BRANCH = "amp/stack-in-order"
# conflicts in these files are resolved by keeping both sides (each PR adds its own entry)
UNION_FILES = ("CHANGELOG.md",)
TITLE_MAX = 72
_FOLDER = re.compile(r"^(\d\d)-([a-z0-9]+(?:-[a-z0-9]+)*)$")
_ISSUE = re.compile(r"^#\d+$")
# words about this repository's own process, which mean nothing to an upstream reviewer
_OWN_WORDS = {
    "a promise of our design": re.compile(r"\bpromises?\b", re.I),
    "a patch number of our series": re.compile(r"\bpatch(?:es)?[ /]?0\d{3}\b|\b0\d{3}-[a-z]", re.I),
    "our test-only stock copies": re.compile(r"\bstock_|\bstock copies\b", re.I),
    "an issue of our own tracker": re.compile(r"\bissues? \d{1,2}\b|(?<![\w/#])#\d{1,2}\b", re.I),
    "the fork": re.compile(r"\bthe fork\b|\bfork's\b|\blightning-amp\b", re.I),
}


class StackError(Failure):
    """A folder of the stack is not well formed, breaks a limit or does not apply (exit 1)."""


@dataclass
class PR:
    folder: Path
    branch: str
    title: str
    closes: list[str]
    touches_tests: list[str]
    merge_order: int = 0
    issue: str = ""

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def patch(self) -> Path:
        return self.folder / "changes.patch"

    @property
    def description(self) -> Path:
        return self.folder / "description.md"

    def message(self) -> str:
        fixes = "\n".join(f"Fixes {issue}" for issue in self.closes)
        paragraph = first_paragraph(self.description.read_text(encoding="utf-8"))
        return "\n\n".join(part for part in (self.title, paragraph, fixes) if part) + "\n"


def first_paragraph(markdown: str) -> str:
    """The first block of text lines that is not a heading or an HTML comment."""
    block: list[str] = []
    for line in markdown.splitlines():
        text = line.strip()
        if not text:
            if block:
                break
            continue
        if not block and (text.startswith("#") or text.startswith("<!--")):
            continue
        block.append(text)
    return "\n".join(block)


def changed_lines(patch_text: str) -> dict[str, int]:
    """Added plus removed lines of a unified diff, per top folder of the file they change (binary files count 0)."""
    per_top: dict[str, int] = {}
    top = ""
    in_hunk = False
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[-1]
            top = path.split("/", 1)[0]
            in_hunk = False
        elif line.startswith("@@"):
            in_hunk = True
        elif in_hunk and line[:1] in ("+", "-"):
            per_top[top] = per_top.get(top, 0) + 1
    return {name: per_top.get(name, 0) for name in LIMITS}


def added_lines(patch_text: str) -> dict[str, list[str]]:
    """The lines a diff adds, per file it changes."""
    added: dict[str, list[str]] = {}
    path = ""
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[-1]
        elif line.startswith("+") and not line.startswith("+++ "):
            added.setdefault(path, []).append(line[1:])
    return added


def own_words(text: str) -> list[str]:
    """What ``text`` says about this repository's own process, as "<what>: '<words>'"."""
    return [f"{what}: {match.group(0)!r}" for what, pattern in _OWN_WORDS.items() for match in pattern.finditer(text)]


def read_pr(folder: Path) -> PR:
    """A stack folder's pr.toml, checked; raises StackError naming the folder and what is wrong."""
    match = _FOLDER.match(folder.name)
    if not match:
        raise StackError(f"{folder.name}: a stack folder is named <NN>-<slug> (e.g. 01-stale-autocast-cache)")
    missing = [name for name in ("pr.toml", "changes.patch", "description.md") if not (folder / name).is_file()]
    if missing:
        raise StackError(f"{folder.name}: missing {', '.join(missing)}")
    try:
        meta = tomllib.loads((folder / "pr.toml").read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise StackError(f"{folder.name}/pr.toml: not valid TOML ({err})") from err
    problems = [f"key {key!r} missing or not a {kind.__name__}" for key, kind in KEYS.items()
                if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool)]
    problems += [f"unknown key {key!r} (the keys are {', '.join([*KEYS, *OPTIONAL_KEYS])})" for key in meta
                 if key not in KEYS and key not in OPTIONAL_KEYS]
    problems += [f"key {key!r} is not a {kind.__name__}" for key, kind in OPTIONAL_KEYS.items()
                 if key in meta and not isinstance(meta[key], kind)]
    if problems:
        raise StackError(f"{folder.name}/pr.toml: " + "; ".join(problems))
    slug = match.group(2)
    if meta["branch"] != f"amp/{slug}":
        problems.append(f"branch = {meta['branch']!r}, expected 'amp/{slug}' (from the folder's name)")
    if not meta["title"].strip() or len(meta["title"]) >= TITLE_MAX or "\n" in meta["title"]:
        problems.append(f"title must be one line under {TITLE_MAX} characters (has {len(meta['title'])})")
    if not all(isinstance(i, str) and _ISSUE.match(i) for i in meta["closes"]):
        problems.append(f"closes = {meta['closes']!r}: a list of upstream issues, e.g. [\"#19803\"] ([]: none open)")
    for test in meta["touches_tests"]:
        if not (isinstance(test, str) and re.match(r"^tests/tests_(pytorch|fabric)/.+\.py$", test)):
            problems.append(f"touches_tests: {test!r} is not an upstream test file (tests/tests_pytorch/....py)")
    issue = meta.get("issue", "")
    if issue and not (issues_folder(folder) / issue).is_file():
        problems.append(f"issue = {issue!r}: no such file in {issues_folder(folder)}")
    if problems:
        raise StackError(f"{folder.name}/pr.toml: " + "; ".join(problems))
    return PR(folder, meta["branch"], meta["title"], list(meta["closes"]), list(meta["touches_tests"]),
              meta["merge_order"], issue)


def issues_folder(folder: Path) -> Path:
    """Where the issue drafts of a stack folder's PR live: ``issues/`` beside the stack."""
    return folder.parent.parent / "issues"


def words(markdown: str) -> int:
    """The words of a description, HTML comments left out."""
    return len(re.sub(r"<!--.*?-->", " ", markdown, flags=re.S).split())


def check_pr(pr: PR) -> dict[str, int]:
    """The folder's description, patch and limits; returns the changed lines per limit."""
    problems = []
    description = pr.description.read_text(encoding="utf-8")
    problems += [f"description.md names {found}" for found in own_words(description)]
    if words(description) > WORDS_MAX:
        problems.append(f"description.md has {words(description)} words, over the limit of {WORDS_MAX}")
    if not first_paragraph(description):
        problems.append("description.md has no paragraph of text (the commit body)")
    if pr.merge_order > 1 and not re.search(r"\bmerge order\b", description, re.I):
        problems.append("description.md does not state the merge order (a line with 'merge order': what it follows)")
    problems += [f"description.md does not say 'Fixes {issue}'" for issue in pr.closes
                 if not re.search(rf"^.*\bFixes\b.*{issue}\b", description, re.M | re.I)]
    patch_text = pr.patch.read_text(encoding="utf-8")
    if "diff --git a/" not in patch_text:
        problems.append("changes.patch is not a `git diff` with a/ b/ prefixes")
    for path, lines in added_lines(patch_text).items():
        text = "\n".join(lines)
        problems += [f"changes.patch: {path} adds {found}" for found in own_words(text)]
        for suite, other in (("tests/tests_pytorch/", "tests_fabric"), ("tests/tests_fabric/", "tests_pytorch")):
            if path.startswith(suite) and re.search(rf"^\s*(from|import)\s+{other}\b", text, re.M):
                problems.append(f"changes.patch: {path} imports {other} (no imports across test suites)")
    lines = changed_lines(patch_text)
    problems += [f"{lines[top]} changed lines under {top}/, over the limit of {limit}" for top, limit in LIMITS.items()
                 if lines[top] > limit]
    if problems:
        raise StackError(f"{pr.name}: " + "; ".join(problems))
    return lines


def read_stack(stack: Path) -> list[PR]:
    folders = sorted(p for p in stack.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))) \
        if stack.is_dir() else []
    if not folders:
        raise StackError(f"{stack} holds no PR folder (<NN>-<slug>/)")
    prs = [read_pr(folder) for folder in folders]
    seen: dict[str, str] = {}
    for pr in prs:
        if pr.branch in seen:
            raise StackError(f"{pr.name}: branch {pr.branch} is also {seen[pr.branch]}'s")
        seen[pr.branch] = pr.name
    orders = sorted(pr.merge_order for pr in prs)
    if orders != list(range(1, len(prs) + 1)):
        listed = ", ".join(f"{pr.name}={pr.merge_order}" for pr in prs)
        raise StackError(f"merge_order must number the PRs 1..{len(prs)}, each once (found {listed})")
    return sorted(prs, key=lambda pr: pr.merge_order)


def predecessors(pr: PR, prs: list[PR]) -> list[PR]:
    return [other for other in prs if other.merge_order < pr.merge_order]


def clone_state(checkout: Path) -> tuple[str, str, str]:
    """What must be the same after the run: HEAD (the branch or commit checked out), its commit, the status."""
    head = git(checkout, "symbolic-ref", "-q", "HEAD", check=False).stdout.strip()
    commit = git(checkout, "rev-parse", "--verify", "-q", "HEAD", check=False).stdout.strip()
    status = git(checkout, "status", "--porcelain", "--untracked-files=all").stdout
    return head, commit, status


def build_branch(checkout: Path, base: str, pr: PR, env: dict[str, str]) -> str:
    """The PR's one commit on ``base``, made in a temporary index; returns its sha (no ref is written here)."""
    with tempfile.TemporaryDirectory(prefix="pr-stack-") as tmp:
        index_env = {**env, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(checkout, "read-tree", base, env=index_env)
        applied = git(checkout, "apply", "--cached", "--whitespace=nowarn", str(pr.patch.resolve()), check=False,
                      env=index_env)
        if applied.returncode != 0:
            raise StackError(f"{pr.name}: changes.patch does not apply to the base {base[:10]}:\n"
                             f"{applied.stderr.strip()}\nrewrite it as `git diff --binary {base[:10]}` of the PR")
        tree = git(checkout, "write-tree", "--missing-ok", env=index_env).stdout.strip()
    done = subprocess.run(["git", "-C", str(checkout), "commit-tree", tree, "-p", base, "-F", "-"],
                          input=pr.message(), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise Failure(f"{pr.name}: `git commit-tree` failed in {checkout}:\n{done.stderr.strip()}")
    return done.stdout.strip()


def _blob(checkout: Path, commit: str, path: str) -> tuple[str, str] | None:
    """(mode, blob sha) of ``path`` in ``commit``, or None where it has no such file."""
    line = git(checkout, "ls-tree", commit, "--", path).stdout.strip()
    if not line:
        return None
    mode, _, rest = line.partition(" ")
    return mode, rest.split()[1]


def _merge_file(checkout: Path, ours: str | None, base: str | None, theirs: str | None, union: bool) -> bytes | None:
    """``git merge-file`` of three blobs (None: an empty file); the merged bytes, or None on a conflict."""
    with tempfile.TemporaryDirectory(prefix="pr-stack-merge-") as tmp:
        names = []
        for name, sha in (("ours", ours), ("base", base), ("theirs", theirs)):
            path = Path(tmp) / name
            path.write_bytes(subprocess.run(["git", "-C", str(checkout), "cat-file", "blob", sha], capture_output=True,
                                            check=True).stdout if sha else b"")
            names.append(str(path))
        done = subprocess.run(["git", "merge-file", "-p", *(["--union"] if union else []), *names],
                              capture_output=True)
        return done.stdout if done.returncode == 0 else None


def merge_in_order(checkout: Path, base: str, tip: str, pr: PR, alone: str, env: dict[str, str],
                   before: list[PR]) -> tuple[str, list[str]]:
    """The PR's changes (its branch ``alone`` against ``base``) merged onto ``tip`` (the base with its predecessors
    merged), one commit on ``tip``; returns its sha and the files merged by keeping both sides."""
    changed = git(checkout, "diff", "--name-only", "--no-renames", base, alone).stdout.split()
    union_merged = []
    with tempfile.TemporaryDirectory(prefix="pr-stack-") as tmp:
        index_env = {**env, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(checkout, "read-tree", tip, env=index_env)
        for path in changed:
            b, t, o = _blob(checkout, base, path), _blob(checkout, alone, path), _blob(checkout, tip, path)
            if t == o or b == t:
                continue  # the predecessors made the same change, or the PR leaves the file as the base has it
            if b == o:
                merged = t  # the predecessors left the file alone: the PR's version
            elif t is None or o is None:
                merged = "conflict"
            else:
                union = Path(path).name in UNION_FILES
                data = _merge_file(checkout, o[1], b[1] if b else None, t[1], union=False)
                if data is None and union:
                    data = _merge_file(checkout, o[1], b[1] if b else None, t[1], union=True)
                    union_merged.append(path)
                if data is None:
                    merged = "conflict"
                else:
                    sha = subprocess.run(["git", "-C", str(checkout), "hash-object", "-w", "--stdin"], input=data,
                                         capture_output=True, check=True).stdout.decode().strip()
                    merged = (t[0], sha)
            if merged == "conflict":
                names = ", ".join(other.name for other in before) or "none"
                raise StackError(f"{pr.name}: does not merge in order (after {names}): {path} conflicts; rebase the"
                                 " PR so that its change applies both on the base and after its predecessors")
            if merged is None:
                git(checkout, "update-index", "--force-remove", "--", path, env=index_env)
            else:
                git(checkout, "update-index", "--add", "--cacheinfo", f"{merged[0]},{merged[1]},{path}", env=index_env)
        tree = git(checkout, "write-tree", "--missing-ok", env=index_env).stdout.strip()
    message = f"{pr.title}\n\nIn merge order {pr.merge_order}, after: " + \
        (", ".join(other.name for other in before) or "none (the base)") + "\n"
    done = subprocess.run(["git", "-C", str(checkout), "commit-tree", tree, "-p", tip, "-F", "-"], input=message,
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise Failure(f"{pr.name}: `git commit-tree` failed in {checkout}:\n{done.stderr.strip()}")
    return done.stdout.strip(), union_merged


def pr_stack(checkout: Path, stack: Path = STACK, base: str = BASE, out: Path = OUT, force: bool = False) -> dict:
    """Build every branch of the stack in ``checkout`` and write ``out/stack.json``; returns the manifest."""
    if git(checkout, "rev-parse", "--is-inside-work-tree", check=False).stdout.strip() != "true":
        raise Failure(f"{checkout} is not a git work tree (a clone of upstream Lightning)")
    commit = git(checkout, "rev-parse", "--verify", "-q", f"{base}^{{commit}}", check=False).stdout.strip()
    if not commit:
        raise Failure(f"{checkout} has no commit {base}: fetch upstream master into the clone first")
    prs = read_stack(stack)
    lines = {pr.name: check_pr(pr) for pr in prs}
    before = clone_state(checkout)
    checked_out = before[0].removeprefix("refs/heads/")
    previous: dict[str, str] = {}  # branch -> its commit before this run ("" if it is new)
    for name, branch in [(pr.name, pr.branch) for pr in prs] + [("the stack in order", IN_ORDER_BRANCH)]:
        old = git(checkout, "rev-parse", "--verify", "-q", f"refs/heads/{branch}", check=False).stdout.strip()
        if old and not force:
            raise Failure(f"{name}: branch {branch} exists in {checkout}; delete it, or pass --force"
                          " (make pr-stack FORCE=1) to replace it")
        if old and branch == checked_out:
            raise Failure(f"{name}: branch {branch} is checked out in {checkout}: check out another first")
    env = identity_env(checkout)
    manifest = {"base": commit, "order": [pr.name for pr in prs], "in_order_branch": IN_ORDER_BRANCH, "prs": []}
    try:
        alone = {pr.name: build_branch(checkout, commit, pr, env) for pr in prs}
        tip, in_order = commit, {}
        for pr in prs:
            tip, union_merged = merge_in_order(checkout, commit, tip, pr, alone[pr.name], env, predecessors(pr, prs))
            in_order[pr.name] = (tip, union_merged)
        for branch, sha in [(pr.branch, alone[pr.name]) for pr in prs] + [(IN_ORDER_BRANCH, tip)]:
            previous[branch] = git(checkout, "rev-parse", "--verify", "-q", f"refs/heads/{branch}",
                                   check=False).stdout.strip()
            git(checkout, "update-ref", "-m", "pr_stack", f"refs/heads/{branch}", sha)
        for pr in prs:
            manifest["prs"].append({
                "branch": pr.branch, "title": pr.title, "closes": pr.closes,
                "description": pr.description.resolve().relative_to(REPO).as_posix()
                if pr.description.resolve().is_relative_to(REPO) else str(pr.description),
                "lines": lines[pr.name], "merge_order": pr.merge_order, "commit": alone[pr.name],
                "in_order_commit": in_order[pr.name][0], "union_merged": in_order[pr.name][1],
            })
    except Failure:
        for branch, old in previous.items():
            if old:
                git(checkout, "update-ref", f"refs/heads/{branch}", old, check=False)
            else:
                git(checkout, "update-ref", "-d", f"refs/heads/{branch}", check=False)
        raise
    after = clone_state(checkout)
    if after != before:
        raise Failure(f"{checkout} changed during the run (HEAD or status): {before[:2]} -> {after[:2]}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "stack.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=Path, help="a git work tree of upstream Lightning (holding --base)")
    parser.add_argument("--check", action="store_true", help="check the stack's folders only (no clone needed)")
    parser.add_argument("--stack", type=Path, default=STACK, help="the folder of PR folders (default: %(default)s)")
    parser.add_argument("--base", default=BASE, help="the upstream commit every PR is based on (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT, help="where stack.json goes (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="replace branches of the stack that exist already")
    args = parser.parse_args(argv)
    if not args.check and args.upstream is None:
        parser.error("--upstream is required (or --check)")
    try:
        if args.check:
            for pr in sorted(read_stack(args.stack), key=lambda pr: pr.name):
                if not pr.issue:
                    raise StackError(f"{pr.name}/pr.toml: no `issue` (the draft in upstream/issues/ the PR links)")
                sizes = check_pr(pr)
                print(f"{pr.name}: {pr.branch}, merge order {pr.merge_order}, src {sizes['src']},"
                      f" tests {sizes['tests']}, docs {sizes['docs']}")
            return 0
        manifest = pr_stack(args.upstream.expanduser().resolve(), args.stack, args.base, args.out, args.force)
    except StackError as err:
        print(f"pr_stack: {err}", file=sys.stderr)
        return 1
    except Failure as err:
        print(f"pr_stack: {err}", file=sys.stderr)
        return 2
    for pr in manifest["prs"]:
        sizes = ", ".join(f"{top} {n}" for top, n in pr["lines"].items())
        union = f"; in order, kept both sides of {', '.join(pr['union_merged'])}" if pr["union_merged"] else ""
        print(f"{pr['merge_order']}. {pr['branch']}: {pr['commit'][:10]} alone, {pr['in_order_commit'][:10]} in order"
              f" {pr['title']} ({sizes}){union}")
    print(f"pr_stack: {len(manifest['prs'])} branches on {manifest['base'][:10]} in {args.upstream}, each applies alone"
          f" and in order ({IN_ORDER_BRANCH}); manifest {args.out / 'stack.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
