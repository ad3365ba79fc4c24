"""The report of ``make gpu-check``: its results as ``gpu-check.md`` (tables for people) and ``gpu-check.json``.

Standard library only, so the driver (``gpu_check.py``) and the tests can use it without torch.

The results are one dict (the JSON file's content, :data:`SCHEMA` 1)::

    {"schema": 1, "created": "2026-12-02 10:00 UTC", "dry_run": false, "device": "cuda",
     "budget_s": 450.0, "elapsed_s": 402.3,
     "versions": {"torch": "2.14.1+cu128", "cuda": "12.8", "gpu": "NVIDIA H200", "fork": "2.6.6+amp.1",
                  "stock": "2.6.6", "python": "3.12.3"},
     "parts": [{"name": "reports", "title": "...", "status": "ok", "elapsed_s": 41.0, "error": null,
                "rows": [{"check": "...", "fork": "...", "stock": "...", "recipe": "...",
                          "verdict": "PASS", "notes": "...", "data": {...}}]}],
     "summary": {"PASS": 12, "FAIL": 0, "INFO": 9, "ERROR": 0, "N/A": 1, "parts_failed": 0}}

A part's ``status``: ``ok`` (it ran to its end), ``error`` (its process failed: ``error`` says how; the rows it wrote
before are kept), ``timeout`` (stopped at its share of the time budget; rows kept), ``skipped`` (the budget was spent).
A row's ``verdict``: ``PASS``/``FAIL`` (a check with a criterion), ``INFO`` (a measurement without one), ``ERROR``
(the row's own code raised: ``notes`` holds the exception), ``N/A`` (not available here: the misuse watch's switch, a
torch feature). ``fork``/``stock``/``recipe`` are the cells of the three contenders, as text; ``data`` holds the
row's raw figures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SCHEMA = 1
VERDICTS = ("PASS", "FAIL", "INFO", "ERROR", "N/A")
PART_STATUSES = ("ok", "error", "timeout", "skipped")
ROW_KEYS = ("check", "fork", "stock", "recipe", "verdict", "notes", "data")


def normalise_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every key of :data:`ROW_KEYS` (missing cells become ``""``, ``data`` ``{}``); an unknown verdict
    becomes ``ERROR`` with the reason in ``notes``, so a bad row shows instead of vanishing."""
    out: dict[str, Any] = {key: row.get(key, "") for key in ROW_KEYS}
    out["data"] = row.get("data") or {}
    if out["verdict"] not in VERDICTS:
        out["notes"] = f"unknown verdict {out['verdict']!r}; {out['notes']}".strip("; ")
        out["verdict"] = "ERROR"
    return out


def summarise(parts: list[dict[str, Any]]) -> dict[str, int]:
    """Rows per verdict over all parts, plus ``parts_failed``: parts whose status is not ``ok``."""
    counts = {verdict: 0 for verdict in VERDICTS}
    for part in parts:
        for row in part.get("rows", []):
            counts[row["verdict"]] += 1
    counts["parts_failed"] = sum(part.get("status") != "ok" for part in parts)
    return counts


def _cell(text: Any) -> str:
    # a table cell: one line, no pipe (it would split the cell)
    return " ".join(str(text).split()).replace("|", "\\|") or "-"


def render_markdown(results: dict[str, Any]) -> str:
    """The markdown report: a header with the machine and versions, the summary, one table per part."""
    versions = results.get("versions", {})
    summary = results["summary"]
    mode = "DRY RUN on the CPU with tiny sizes (pipeline check, not a measurement)" if results.get("dry_run") else (
        f"device {results.get('device', '?')}"
    )
    lines = [
        "# GPU check: the fork against stock Lightning 2.6.6 and PyTorch's AMP recipe",
        "",
        f"Run of {results.get('created', '?')}, {mode}; {results.get('elapsed_s', 0):.0f} s of a "
        f"{results.get('budget_s', 0):.0f} s budget.",
        "",
        "- " + "; ".join(f"{key} {value}" for key, value in versions.items()) if versions else "- versions: unknown",
        f"- verdicts: {', '.join(f'{summary[v]} {v}' for v in VERDICTS)}; parts not completed: "
        f"{summary['parts_failed']}",
        "",
        "Cells: `fork`/`stock` compare each with the hand-written recipe of the same run unless the row says otherwise "
        "(`bitwise`: every parameter equal bit for bit; otherwise the largest absolute difference). Verdicts: PASS/FAIL "
        "judge the fork (stock's cells are the contrast), INFO is a measurement, N/A not available here.",
    ]
    for part in results["parts"]:
        lines += ["", f"## {part.get('title') or part['name']}", ""]
        status = part.get("status", "?")
        if status != "ok":
            lines += [f"**Part {status}** after {part.get('elapsed_s', 0):.0f} s: {_cell(part.get('error') or '')}", ""]
        rows = part.get("rows", [])
        if not rows:
            lines.append("No rows.")
            continue
        lines += ["| check | fork | stock | recipe | verdict | notes |", "| --- | --- | --- | --- | --- | --- |"]
        for row in rows:
            verdict = row["verdict"]
            shown = f"**{verdict}**" if verdict in ("FAIL", "ERROR") else verdict
            lines.append(
                f"| {_cell(row['check'])} | {_cell(row['fork'])} | {_cell(row['stock'])} | {_cell(row['recipe'])} "
                f"| {shown} | {_cell(row['notes'])} |"
            )
    lines.append("")
    return "\n".join(lines)


def build_results(
    parts: list[dict[str, Any]],
    versions: dict[str, str],
    created: str,
    dry_run: bool,
    device: str,
    budget_s: float,
    elapsed_s: float,
) -> dict[str, Any]:
    """The results dict of :data:`SCHEMA` from the parts (each ``name``, ``title``, ``status``, ``elapsed_s``,
    ``error``, ``rows``); rows are normalised (:func:`normalise_row`) and the summary computed."""
    clean = []
    for part in parts:
        status = part.get("status", "error")
        clean.append({
            "name": part["name"],
            "title": part.get("title", part["name"]),
            "status": status if status in PART_STATUSES else "error",
            "elapsed_s": float(part.get("elapsed_s", 0.0)),
            "error": part.get("error"),
            "rows": [normalise_row(row) for row in part.get("rows", [])],
        })
    return {
        "schema": SCHEMA,
        "created": created,
        "dry_run": dry_run,
        "device": device,
        "budget_s": float(budget_s),
        "elapsed_s": float(elapsed_s),
        "versions": dict(versions),
        "parts": clean,
        "summary": summarise(clean),
    }


def write_report(results: dict[str, Any], out_dir: Path, stem: str = "gpu-check") -> tuple[Path, Path]:
    """Write ``<out_dir>/<stem>.md`` and ``<stem>.json``; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(render_markdown(results))
    js.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return md, js
