#!/usr/bin/env python3
"""Write the upstream pull request's description from the patch series.

    python3 tools/upstream/pr_description.py [--patches DIR] [--changelog FILE] [--results DIR] [--short]
                                                                                              (make pr-description)

Prints the description (Markdown) and writes it to ``<results>/PR.md`` (default ``tools/upstream/results/``, ignored
by git). What it reads:

- the header of each patch of ``patches/series``, in series order (one commit of the PR each), but for the patches
  marked ``Forwarded: not-needed``, which ``make pr`` leaves out too:

  ``Description:`` first line: the commit's subject; continuation lines: why (a `` .`` line between paragraphs)
  ``Bug:``         upstream issue URLs (``https://github.com/Lightning-AI/pytorch-lightning/issues/18089``), separated
                   by spaces, commas or continuation lines: "Closes #18089"; a pull-request URL: "See #N"
  ``Adds:``        optional: our own files that come with the patch (repository paths), one per continuation line
  ``Notice:``      optional: what a user will notice (free text; continuation lines starting with "- " are items)
  ``Split:``       optional: the upstream PR the patch belongs to, a short group name ("1: training-iteration hooks");
                   consecutive patches with the same value form one PR (none anywhere: one PR per patch)

- the "Changed" entries of ``CHANGELOG.md``'s "Unreleased" section (read by make_pr.py, as ``make pr`` reads them);
- the subjects of ``tools/upstream/test-patches/series`` (upstream tests the PR updates);
- ``<results>/summary.json`` and ``report.md`` of ``make upstream-test``; without them, a marked placeholder.

Lines a maintainer must fill in start with "**TODO:**". Standard library only. Exit status: 0, 2 when the series
cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _series import HERE, REPO, SOURCE_PATCHES, TEST_PATCHES, Failure, SeriesPatch, read_series, unclaimed  # noqa: E402

try:  # the CHANGELOG reader and the list of our own files are make_pr's: one reading for both tools
    import make_pr
except (ImportError, SyntaxError):  # pragma: no cover - make_pr.py being rewritten; the section says so
    make_pr = None

RESULTS = HERE / "results"
CHANGELOG = REPO / "CHANGELOG.md"
TODO = "**TODO:**"
TITLE = "Mixed precision follows PyTorch's AMP recipe in manual optimization and with fused optimizers"
SUMMARY = """\
Lightning's `MixedPrecision` (and `FSDPPrecision`, in the Trainer and in Fabric) follows PyTorch's AMP recipe in
automatic optimization with ordinary optimizers, but not in manual optimization nor with fused optimizers. There, in
2.6.6, `manual_backward`, clipping and the optimizer step run under autocast; `self.clip_gradients` clips gradients
still multiplied by the loss scale; `scaler.update()` runs after every optimizer step instead of once per iteration,
so a second optimizer fed by the same backward is unscaled with the wrong scale; fused optimizers cannot be clipped
(even under bf16-mixed) and `on_before_optimizer_step` sees scaled gradients; a step the scaler skipped leaves no
trace; and `loss.backward()` instead of `self.manual_backward(loss)` silently freezes fp16 training.

This PR makes mixed precision correct there: autocast covers the forward code only, gradients are unscaled once
before anything reads them, the scaler is updated once per iteration, fused optimizers are unscaled through the
scaler like any other, skipped steps are visible (`optimizer.step_was_skipped`, `LossScaleMonitor`) and misuse raises
a clear error. It is proven against PyTorch's own recipe: the tests train the same small models through Lightning
and through a hand-written `torch.autocast` + `GradScaler` loop and require bitwise-equal parameters, in 32-true,
bf16-mixed and 16-mixed, manual and automatic optimization, with plain, fused and several optimizers."""

_URL = re.compile(r"https?://[^\s,;<>()]+")
_LIGHTNING = re.compile(r"^https?://github\.com/Lightning-AI/[\w.-]+/(issues|pull)/(\d+)")
_HASH = re.compile(r"(?<![\w/&])#(\d+)\b")
_COLUMNS = ("passed", "failed", "error", "skipped", "xfailed")


@dataclass
class Commit:
    patch: SeriesPatch
    subject: str
    why: list[str]
    closes: list[str] = field(default_factory=list)  # issue numbers
    see: list[str] = field(default_factory=list)  # pull-request numbers
    links: list[str] = field(default_factory=list)  # any other URL of Bug:
    adds: list[str] = field(default_factory=list)
    notice: list[str] = field(default_factory=list)
    split: str | None = None

    @property
    def number(self) -> str:
        return self.patch.name[:4] if self.patch.name[:4].isdigit() else self.patch.stem


def references(text: str) -> tuple[list[str], list[str], list[str]]:
    """Upstream issue numbers, pull-request numbers and other URLs in a ``Bug:``-like field, in order, once each."""
    issues, pulls, other = [], [], []
    for url in _URL.findall(text):
        url = url.rstrip(".,")
        match = _LIGHTNING.match(url)
        bucket = (issues if match.group(1) == "issues" else pulls) if match else other
        item = match.group(2) if match else url
        if item not in bucket:
            bucket.append(item)
    for number in _HASH.findall(_URL.sub(" ", text)):  # a bare "#18089" is an upstream issue too
        if number not in issues:
            issues.append(number)
    return issues, pulls, other


def paragraphs(lines: list[str]) -> list[list[str]]:
    """DEP-3 body lines split at their `` .`` separator lines (blank lines too)."""
    out: list[list[str]] = [[]]
    for line in lines:
        if line.strip() in ("", "."):
            if out[-1]:
                out.append([])
        else:
            out[-1].append(line.rstrip())
    return [p for p in out if p]


def notice_items(text: str) -> list[str]:
    """``Notice:`` as items: each line starting with "- " begins one, as does each paragraph; lines are joined."""
    items: list[list[str]] = []
    for para in paragraphs(text.splitlines()):
        for n, line in enumerate(para):
            if n == 0 or line.lstrip().startswith("- "):
                items.append([line.strip().removeprefix("- ")])
            else:
                items[-1].append(line.strip())
    return [" ".join(i) for i in items if " ".join(i).strip()]


def commit_of(patch: SeriesPatch, short: bool = False) -> Commit:
    fields = patch.fields()
    subject, _, body = fields.get("Description", "").strip("\n").partition("\n")
    paras = paragraphs(body.splitlines())
    keep = paras if not short else paras[:2] if paras and paras[0][-1].endswith(":") else paras[:1]  # "...:" + list
    why = [line for para in keep for line in [*para, ""]][:-1]
    closes, see, links = references(fields.get("Bug", ""))
    see += [n for n in references(fields.get("Forwarded", ""))[1] if n not in see]
    return Commit(patch, subject.strip() or patch.stem, why, closes, see, links,
                  adds=[p for p in re.split(r"[\s,]+", fields.get("Adds", "")) if p],
                  notice=notice_items(fields.get("Notice", "")),
                  split=fields.get("Split", "").strip() or None)


def split_groups(commits: list[Commit], warn) -> tuple[list[tuple[str | None, list[Commit]]], bool]:
    """Consecutive commits with the same ``Split:`` form one PR; without any ``Split:``, one PR per commit."""
    declared = any(c.split for c in commits)
    groups: list[tuple[str | None, list[Commit]]] = []
    for c in commits:
        if declared and c.split and groups and groups[-1][0] == c.split:
            groups[-1][1].append(c)
            continue
        if declared and not c.split:
            warn(f"{c.patch.name} has no Split: field; proposed as a PR of its own")
        elif declared and any(name == c.split for name, _ in groups):
            warn(f"{c.patch.name}: Split: {c.split!r} is not next to its group's other patches; proposed apart")
        groups.append((c.split if declared else None, [c]))
    return groups, declared


def closes_line(numbers: list[str]) -> str:
    return ", ".join(f"{'Closes' if i == 0 else 'closes'} #{n}" for i, n in enumerate(numbers))


def quoted(paths: list[str]) -> str:
    return ", ".join(f"`{p}`" for p in paths)


# --- sections --------------------------------------------------------------------------------------------------------


def commits_section(commits: list[Commit]) -> list[str]:
    out = ["## Commits", "", "One commit per concern, in this order; each message holds the same text.", ""]
    for c in commits:
        out += [f"### {c.number}. {c.subject}", ""]
        if c.why:
            out += [*c.why, ""]
        if c.closes:
            out.append(closes_line(c.closes) + "  ")
        if c.see:
            out.append("See " + ", ".join(f"#{n}" for n in c.see) + "  ")
        if c.links:
            out.append("See " + ", ".join(c.links) + "  ")
        if c.adds:
            out.append(f"Adds: {quoted(c.adds)}  ")
        if out[-1].endswith("  "):
            out[-1] = out[-1][:-2]
            out.append("")
    return out


#: the numbers ("0023") of the patches marked `Forwarded: not-needed`, left out of the PR (set by main)
LEFT_OUT: set[str] = set()


def numbers_of(entry: str) -> set[str]:
    """The patch numbers a CHANGELOG entry ends with (``... (0011, 0017)``)."""
    match = re.search(r"\(([^()]*)\)\s*$", entry)
    return set(re.findall(r"(?<![#/\w])(\d{4})(?!\d)", match.group(1))) if match else set()


def changelog_changed(changelog: Path) -> tuple[list[str], str | None]:
    """The "Changed" entries of the "Unreleased" section, without our patch numbers; or why there are none."""
    if make_pr is None or not hasattr(make_pr, "read_unreleased"):
        return [], "make_pr.py's read_unreleased could not be imported"
    if not changelog.is_file():
        return [], f"no {changelog.name} at {changelog}"
    try:  # without make_pr's patch -> Bug: map: an entry keeps the links it has, the PR lists the issues elsewhere
        sections = make_pr.read_unreleased(changelog)
    except Failure as err:
        return [], str(err)
    changed = next((entries for name, entries in sections.items() if name.lower() == "changed"), [])
    # entries that only patches left out (`Forwarded: not-needed`) make, as make_pr.py leaves them out
    changed = [e for e in changed if not (numbers_of(e) and numbers_of(e) <= LEFT_OUT)]
    return [e.removeprefix("- ") for e in changed], None if changed else "its Unreleased section has no Changed entries"


def behaviour_section(commits: list[Commit], changelog: Path, test_patches: list[SeriesPatch]) -> list[str]:
    out = ["## Behaviour changes a user will notice", ""]
    noticed = [c for c in commits if c.notice]
    entries, why_not = changelog_changed(changelog)
    if noticed:
        for c in noticed:
            for item in c.notice:
                out.append(f"- {item} ({c.number})")
        out.append("")
    else:
        out += ["No commit has a `Notice:` header yet; the \"Changed\" entries of the CHANGELOG:" if entries else
                f"{TODO} no commit has a `Notice:` header and the CHANGELOG gives no \"Changed\" entries ({why_not}).",
                ""]
    if entries:
        listed = [f"- {e}" for e in entries]
        if noticed:
            out += ["<details><summary>CHANGELOG, \"Changed\" (the entries this PR adds to upstream's CHANGELOG)"
                    "</summary>", "", *listed, "", "</details>", ""]
        else:
            out += [*listed, ""]
    if test_patches:
        out += ["Upstream tests that pinned the old behaviour, updated by this PR (one commit each):", ""]
        out += [f"- {commit_of(p).subject}" for p in test_patches]
        out.append("")
    return out


def count_rows(obj, prefix: str = "") -> list[tuple[str, dict[str, int]]]:
    """Every mapping of outcome counts under ``obj``, named by its path (``counts`` keys add nothing to the name)."""
    if not isinstance(obj, dict) or not obj:
        return []
    if all(isinstance(v, int) and not isinstance(v, bool) for v in obj.values()):
        return [(prefix, obj)] if any(k in obj for k in (*_COLUMNS, "total")) else []
    rows = []
    for key, value in obj.items():
        rows += count_rows(value, prefix if key == "counts" else f"{prefix} / {key}" if prefix else str(key))
    return rows


def table(rows: list[tuple[str, dict[str, int]]]) -> list[str]:
    keys = [k for k in _COLUMNS if any(k in c for _, c in rows)]
    keys += [k for _, c in rows for k in c if k not in keys and k != "total"]
    keys = list(dict.fromkeys(keys)) + (["total"] if any("total" in c for _, c in rows) else [])
    out = ["| run | " + " | ".join(keys) + " |", "| --- |" + " ---: |" * len(keys)]
    out += [f"| {name} | " + " | ".join(str(c.get(k, "")) for k in keys) + " |" for name, c in rows]
    return out


def upstream_evidence(results: Path, patches: list[SeriesPatch], warn) -> list[str]:
    summary_path, report_path = results / "summary.json", results / "report.md"
    # the master mode (`make upstream-test BRANCH=...`) writes results/branch/: the base is master, not stock 2.6.6
    against = "master" if results.name.startswith("branch") else "stock 2.6.6"
    out = [f"### Upstream's tests of the touched areas, {against} against this branch", ""]
    summary = None
    if summary_path.is_file():
        try:
            summary = json.loads(summary_path.read_text(encoding="utf-8"))
        except ValueError as err:
            warn(f"{summary_path} is not JSON ({err}); using report.md alone")
    if summary is None and not report_path.is_file():
        return out + [f"{TODO} no test results yet: `make upstream-test UPSTREAM=<upstream clone>` writes "
                      f"`{_shown(summary_path)}` and `{_shown(report_path)}`; then run `make pr-description` again.",
                      ""]
    newest = max((p.path.stat().st_mtime for p in patches), default=0)
    for path in (summary_path, report_path):
        if path.is_file() and path.stat().st_mtime < newest:
            warn(f"{path} is older than the newest patch: rerun make upstream-test if a patch changed since")
    if isinstance(summary, dict):
        runs = summary.get("runs") if isinstance(summary.get("runs"), dict) else {}
        infos = [r.get("lightning") for r in runs.values() if isinstance(r, dict)]
        torch = sorted({str(i["torch"]) for i in infos if isinstance(i, dict) and i.get("torch")})
        where = f"upstream's tests at `{summary.get('ref', '?')}`"
        if summary.get("commit"):
            where += f" ({str(summary['commit'])[:10]})"
        out += [f"Run by `make upstream-test`: {where}, on CPU" + (f", torch {', '.join(torch)}" if torch else "")
                + "; tests that need CUDA GPUs skip.", ""]
        rows = count_rows(runs) + count_rows(summary.get("suites"), "")
        if rows:
            out += [*table(rows), ""]
        base = "master" if against == "master" else "stock"
        for key, title, full in (("regressions", f"Pass on {base}, fail on this branch", True),
                                 ("fixed_on_fork", f"Fail on {base}, pass on this branch", False)):
            items = summary.get(key)
            if isinstance(items, list):
                out.append(f"- {title}: {len(items)}")
                if items and (full or len(items) <= 20):
                    out += [f"  - `{t}`" for t in items]
        if isinstance(summary.get("test_patches"), dict) and summary["test_patches"]:
            out.append(f"- Upstream tests updated by this PR's test commits (run in their new version): "
                       f"{len(summary['test_patches'])} test patch(es)")
        out.append("")
    if report_path.is_file():
        text = report_path.read_text(encoding="utf-8").strip()
        text = re.sub(r"^(#+) ", lambda m: "#" * (len(m.group(1)) + 3) + " ", text, flags=re.M)
        if len(text) <= 30_000:
            out += ["<details><summary>The full report (make upstream-test's report.md)</summary>", "", text, "",
                    "</details>", ""]
        else:
            out += [f"The full report ({len(text):,} characters) is in `{_shown(report_path)}`: attach it.", ""]
    return out


def own_tests(commits: list[Commit], repo: Path | None) -> list[str]:
    out = ["### The new tests", ""]
    named = [(p, c.number) for c in commits for p in c.adds if p.startswith("tests/")]
    if named:
        listed = [f"- `{p}` ({number})" for p, number in named]
    elif repo is not None and make_pr is not None and hasattr(make_pr, "own_files"):
        files = sorted(p for p in make_pr.own_files(repo) if p.startswith("tests/"))
        listed = [f"- `{p}`" for p in files]
        out += ["(No commit names its files in `Adds:` yet: these are the test files `make pr` commits.)", ""]
    else:
        listed = [f"- {TODO} name the test files in the patches' `Adds:` headers"]
    out += ["They train the same tiny models through Lightning and through PyTorch's hand-written AMP recipe and "
            "compare the parameters bitwise (precision 32-true, bf16-mixed and 16-mixed; manual and automatic "
            "optimization; plain, fused and several optimizers; DDP on CPU processes; Fabric), all on CPU:",
            "", *listed, "",
            f"- Torch versions the new and the existing tests ran on: {TODO} (`make test`, `make test-matrix`)",
            f"- GPU: {TODO} what ran on CUDA, or \"not run\"", ""]
    return out


def split_section(commits: list[Commit], warn) -> list[str]:
    groups, declared = split_groups(commits, warn)
    out = ["## Proposed split for review", ""]
    out.append("Each PR below applies on top of the ones before it; reviewed one at a time, in this order."
               if declared else
               "No commit has a `Split:` header, so this proposes one PR per commit, in series order.")
    out.append("")
    last = {i: n for n, (_, members) in enumerate(groups, 1) for c in members for i in c.closes}  # its last PR closes
    for n, (name, members) in enumerate(groups, 1):
        title = (re.sub(r"^\s*\d+\s*[:.)]\s*", "", name) or name) if name else members[0].subject
        out += [f"### PR {n}: {title}", ""]
        if declared:
            out += [f"- {c.number}. {c.subject}" for c in members]
        else:
            out.append(f"- Commit {members[0].number} (`{members[0].patch.name}`)")
        earlier = {1: "nothing (applies to the base)", 2: "PR 1"}.get(n, f"PRs 1-{n - 1}")
        out.append(f"- Depends on: {earlier}")
        named = list(dict.fromkeys(i for c in members for i in c.closes))
        if [i for i in named if last[i] == n]:
            out.append(f"- {closes_line([i for i in named if last[i] == n])}")
        if [i for i in named if last[i] != n]:
            out.append("- Part of " + ", ".join(f"#{i} (closed by PR {last[i]})" for i in named if last[i] != n))
        adds = [p for c in members for p in c.adds]
        if adds:
            out.append(f"- Adds: {quoted(adds)}")
        out.append("")
    return out


def docs_section(docs_patches: list[SeriesPatch], pages: list[str]) -> list[str]:
    """The documentation commits at the end of the branch: our pages, then one commit per docs patch."""
    if not docs_patches and not pages:
        return []
    out = ["## Documentation", ""]
    if pages:
        out += [f"New pages (every example on them runs in the fork's tests): {quoted(pages)}.", ""]
    for patch in docs_patches:
        subject = patch.fields().get("Description", patch.stem).split("\n")[0]
        out.append(f"- `{patch.stem}`: {subject}")
    return out + [""]


def issues_section(commits: list[Commit]) -> list[str]:
    issues: dict[str, list[str]] = {}
    pulls: dict[str, list[str]] = {}
    for c in commits:
        for number in c.closes:
            issues.setdefault(number, []).append(c.number)
        for number in c.see:
            pulls.setdefault(number, []).append(c.number)
    out = ["## Upstream issues", ""]
    if not issues:
        return out + ["No commit names an upstream issue in `Bug:`.", ""]
    out += [f"- #{n} ({', '.join(by)})" for n, by in issues.items()]
    if pulls:
        out += ["", "Related pull requests: " + ", ".join(f"#{n} ({', '.join(by)})" for n, by in pulls.items())]
    return out + [""]


def describe(patches: list[SeriesPatch], changelog: Path, results: Path, test_patches: list[SeriesPatch],
             repo: Path | None = None, short: bool = False, warn=lambda message: None,
             docs_patches: list[SeriesPatch] | None = None, pages: list[str] | None = None) -> str:
    commits = [commit_of(p, short) for p in patches]
    all_issues = list(dict.fromkeys(i for c in commits for i in c.closes))
    groups, declared = split_groups(commits, lambda message: None)
    review = f"proposed for review as {len(groups)} PRs" if declared else "no split proposed yet (no `Split:` headers)"
    out = [f"# {TITLE}", "", "## What does this PR do?", "", SUMMARY, "",
           f"{len(commits)} commits, one concern each (below): each holds its patch, the new modules and tests it "
           f"adds, the upstream tests it updates and its CHANGELOG entries; then the documentation. {review[0].upper()}"
           f"{review[1:]}, see \"Proposed split for review\".", ""]
    if all_issues:
        out += [closes_line(all_issues), ""]
    out += commits_section(commits)
    out += behaviour_section(commits, changelog, test_patches)
    out += ["## Test evidence", ""] + upstream_evidence(results, patches, warn) + own_tests(commits, repo)
    out += docs_section(docs_patches or [], pages or [])
    out += split_section(commits, warn)
    out += issues_section(commits)
    if repo is not None:
        check_adds(commits, repo, warn)
    return "\n".join(out).rstrip() + "\n"


def check_adds(commits: list[Commit], repo: Path, warn) -> None:
    named = {p for c in commits for p in c.adds}
    for c in commits:
        for p in c.adds:
            if not (repo / p).exists():
                warn(f"{c.patch.name}: Adds: {p} does not exist in {repo}")
    if named and make_pr is not None and hasattr(make_pr, "own_files"):
        unnamed = unclaimed([n for n in make_pr.own_files(repo) if not n.startswith(make_pr.DOCS_FOLDER)],
                             [c.patch for c in commits])
        if unnamed:
            warn("own files that `make pr` commits but no Adds: names: " + ", ".join(unnamed))


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patches", type=Path, default=SOURCE_PATCHES, help="the series folder (default: patches/)")
    parser.add_argument("--test-patches", type=Path, default=TEST_PATCHES, help="the upstream test patches' folder")
    parser.add_argument("--changelog", type=Path, default=CHANGELOG, help="the CHANGELOG (default: CHANGELOG.md)")
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help="make upstream-test's results, where PR.md is written (default: tools/upstream/results/)")
    parser.add_argument("--short", action="store_true", help="each commit's why: its first paragraph only")
    args = parser.parse_args(argv)

    def warn(message: str) -> None:
        print(f"pr_description: note: {message}", file=sys.stderr)

    patches_dir = args.patches.resolve()
    repo = REPO if patches_dir == REPO or REPO in patches_dir.parents else None  # our checkout: check Adds: there
    try:
        # as make_pr.py does: the patches marked `Forwarded: not-needed` are not for upstream, nor their test patches
        every = read_series(patches_dir)
        patches = [p for p in every if not p.fields().get("Forwarded", "").startswith("not-needed")]
        left_out = {p.stem for p in every} - {p.stem for p in patches}
        LEFT_OUT.update(stem[:4] for stem in left_out)
        test_patches = [t for t in read_series(args.test_patches.resolve()) if t.accompanies() not in left_out]
    except Failure as err:
        print(f"pr_description: {err}", file=sys.stderr)
        return 2
    if not patches:
        print(f"pr_description: {patches_dir} has no series (or an empty one)", file=sys.stderr)
        return 2
    docs_patches, pages = [], []
    if repo is not None and make_pr is not None:  # our checkout: the docs commits `make pr` makes from it
        docs_patches = read_series(REPO / "docs" / "patches")
        pages = sorted(n for n in make_pr.own_files(REPO) if n.startswith(make_pr.DOCS_FOLDER))
    text = describe(patches, args.changelog, args.results, test_patches, repo, args.short, warn, docs_patches, pages)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "PR.md").write_text(text, encoding="utf-8")
    print(text, end="")
    todo = text.count(TODO)
    warn(f"written to {_shown(args.results / 'PR.md')}" + (f"; {todo} TODO line(s) to fill in" if todo else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
