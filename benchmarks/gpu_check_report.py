"""The report of ``make gpu-check``: ``gpu-check.md`` (tables for people) and ``gpu-check.json`` (every figure).

Standard library only, so the driver (``gpu_check.py``) and the tests can use it without torch.

``gpu-check.md`` has a header (date; ``device cuda`` or ``DRY RUN on the CPU``; seconds used of the budget), a line of
versions (torch, CUDA, GPU, fork, stock, Python), a line of verdict counts, then per part a heading (with ``**Part
error|timeout|skipped**`` and the reason when it did not complete) and one table::

    | check        | fork             | stock                   | recipe        | verdict                        | notes |
    | what was run | the fork's result | stock 2.6.6's, contrast | the reference | PASS / FAIL / INFO / ERROR / N/A | how |

A ``fork``/``stock`` cell of a comparison with the recipe is ``bitwise`` (scale trajectory, skipped steps, every
parameter and what the row records equal bit for bit), or what ``amp_oracle.run.differences`` finds, or ``raises
<error>``. A verdict judges the fork only: ``PASS`` is nothing found but parameters within 1e-5 (said in the notes);
the FSDP row on CUDA needs the recipe's scale trajectory, skipped steps and finite weights (FSDP computes in fp16
parameters, so its weights differ from autocast's by design; the difference is in the cell). Cost rows are ``INFO``:
``fork`` holds its median time per step and ``fork/stock`` (the median of the paired rounds' ratios, smallest and
largest round in brackets), ``stock`` and ``recipe`` their median times; sync rows hold host synchronisations per step.
The watch rows say ``raises <error>`` (caught) or ``trains on``.

``gpu-check.json`` is one dict, :data:`SCHEMA` 1::

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
A row's ``verdict``: ``PASS``/``FAIL`` (a check with a criterion), ``INFO`` (a measurement), ``ERROR`` (the row's own
code raised: ``notes`` holds the exception, ``data["traceback"]`` the traceback), ``N/A`` (not available here). A
row's ``data`` holds its raw figures: per contender ``differences`` (the list) and ``passes``, or ``error``; for cost
rows ``step_s`` (each round's median seconds per step) and ``fork_over_stock`` (the paired ratios), or
``syncs_per_step``.
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


def _cell(text: Any) -> str:
    # a table cell: one line, no pipe (it would split the cell)
    return " ".join(str(text).split()).replace("|", "\\|") or "-"


def render_markdown(results: dict[str, Any]) -> str:
    """The markdown report: a header with the machine and versions, the summary, one table per part."""
    versions, summary = results.get("versions", {}), results["summary"]
    mode = "DRY RUN on the CPU with tiny sizes (pipeline check, not a measurement)" if results.get("dry_run") else (
        f"device {results.get('device', '?')}")
    lines = [
        "# GPU check: the fork against stock Lightning 2.6.6 and PyTorch's AMP recipe",
        "",
        f"Run of {results.get('created', '?')}, {mode}; {results.get('elapsed_s', 0):.0f} s of a "
        f"{results.get('budget_s', 0):.0f} s budget.",
        "",
        "- " + ("; ".join(f"{key} {value}" for key, value in versions.items()) if versions else "versions: unknown"),
        f"- verdicts: {', '.join(f'{summary[v]} {v}' for v in VERDICTS)}; parts not completed: "
        f"{summary['parts_failed']}",
        "",
        "Cells: `fork`/`stock` compare each with the hand-written recipe of the same run unless the row says otherwise "
        "(`bitwise`, or what differs). Verdicts: PASS/FAIL judge the fork (stock's cells are the contrast), INFO is a "
        "measurement, N/A not available here. The format: `benchmarks/gpu_check_report.py`.",
    ]
    for part in results["parts"]:
        lines += ["", f"## {part.get('title') or part['name']}", ""]
        if part.get("status") != "ok":
            lines += [f"**Part {part.get('status')}** after {part.get('elapsed_s', 0):.0f} s: "
                      f"{_cell(part.get('error') or '')}", ""]
        if not part.get("rows"):
            lines.append("No rows.")
            continue
        lines += ["| check | fork | stock | recipe | verdict | notes |", "| --- | --- | --- | --- | --- | --- |"]
        for row in part["rows"]:
            verdict = f"**{row['verdict']}**" if row["verdict"] in ("FAIL", "ERROR") else row["verdict"]
            cells = [_cell(row[key]) for key in ("check", "fork", "stock", "recipe")] + [verdict, _cell(row["notes"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def build_results(parts: list[dict[str, Any]], versions: dict[str, str], created: str, dry_run: bool, device: str,
                  budget_s: float, elapsed_s: float) -> dict[str, Any]:
    """The results dict of :data:`SCHEMA` from the parts (each ``name``, ``title``, ``status``, ``elapsed_s``,
    ``error``, ``rows``): rows normalised (:func:`normalise_row`), the verdicts counted."""
    clean = [{
        "name": part["name"],
        "title": part.get("title", part["name"]),
        "status": part.get("status") if part.get("status") in PART_STATUSES else "error",
        "elapsed_s": float(part.get("elapsed_s", 0.0)),
        "error": part.get("error"),
        "rows": [normalise_row(row) for row in part.get("rows", [])],
    } for part in parts]
    summary = {verdict: sum(row["verdict"] == verdict for p in clean for row in p["rows"]) for verdict in VERDICTS}
    summary["parts_failed"] = sum(part["status"] != "ok" for part in clean)
    return {"schema": SCHEMA, "created": created, "dry_run": dry_run, "device": device, "budget_s": float(budget_s),
            "elapsed_s": float(elapsed_s), "versions": dict(versions), "parts": clean, "summary": summary}


def write_report(results: dict[str, Any], out_dir: Path, stem: str = "gpu-check") -> tuple[Path, Path]:
    """Write ``<out_dir>/<stem>.md`` and ``<stem>.json``; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md.write_text(render_markdown(results))
    js.write_text(json.dumps(results, indent=1, default=str) + "\n")
    return md, js
