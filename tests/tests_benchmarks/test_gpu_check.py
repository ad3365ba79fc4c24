"""``make gpu-check`` where there is no GPU: the one-line skip, the report writer, the parts' isolation and,
as a dry run on the CPU with tiny sizes, the whole pipeline that the GPU runs (every part, every row's code)."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests_benchmarks.benchmark_modules import ROOT, load_benchmark

DRIVER = ROOT / "benchmarks" / "gpu_check.py"

report = load_benchmark("gpu_check_report")
driver = load_benchmark("gpu_check")


def test_without_cuda_one_line_and_exit_0(tmp_path, monkeypatch):
    out = tmp_path / "artifacts"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(DRIVER), "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "gpu-check: no CUDA GPU on this machine (CUDA_VISIBLE_DEVICES=''); "
                                                 "nothing to check, skipped.\n")
    assert not out.exists(), "no report without a GPU"
    # `make gpu-check` probes first: without a GPU the probe fails, so make skips the setup
    proc = subprocess.run([sys.executable, str(DRIVER), "--probe"], capture_output=True, text=True,
                          env={**env, "CUDA_VISIBLE_DEVICES": "-1"}, timeout=60)
    assert proc.returncode == 1 and proc.stdout.startswith("gpu-check: no CUDA GPU")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert driver.find_gpus() == ([], "CUDA_VISIBLE_DEVICES=''")


def _fake_parts() -> list[dict]:
    row = {"check": "manual clipping", "fork": "bitwise", "stock": "max abs diff 0.02", "recipe": "reference",
           "verdict": "PASS", "notes": "", "data": {"fork": {"bitwise": True}}}
    return [
        {"name": "reports", "title": "1. Reports", "status": "ok", "elapsed_s": 3.0, "error": None,
         "rows": [row, {**row, "check": "a | pipe", "verdict": "FAIL"}]},
        {"name": "equivalence", "title": "2. Equivalence", "status": "error", "elapsed_s": 1.0,
         "error": "the part's process exited with 1", "rows": [{"check": "half", "verdict": "MAYBE"}]},
        {"name": "cost", "title": "3. Cost", "status": "timeout", "elapsed_s": 9.0, "error": "stopped",
         "rows": [{**row, "check": "time per step", "verdict": "INFO", "fork": "1.0 ms; fork/stock 1.01"}]},
        {"name": "watch", "title": "4. Watch", "status": "skipped", "error": "the time budget was spent", "rows": []},
    ]


def test_report_writer_on_fake_results(tmp_path):
    results = report.build_results(_fake_parts(), {"torch": "2.14.1+cu128", "gpu": "H200"}, "2026-12-02 10:00 UTC",
                                   False, "cuda", 450, 123.4)
    md_path, json_path = report.write_report(results, tmp_path)
    assert (md_path.name, json_path.name) == ("gpu-check.md", "gpu-check.json")

    data = json.loads(json_path.read_text())
    assert data == json.loads(json.dumps(results)) and data["schema"] == 1
    assert [p["status"] for p in data["parts"]] == ["ok", "error", "timeout", "skipped"]
    for part in data["parts"]:
        assert set(part) == {"name", "title", "status", "elapsed_s", "error", "rows"}
        for row in part["rows"]:
            assert set(row) == set(report.ROW_KEYS)
    # an unknown verdict shows as an error instead of vanishing; missing cells are empty
    (odd,) = data["parts"][1]["rows"]
    assert odd["verdict"] == "ERROR" and "MAYBE" in odd["notes"] and odd["fork"] == ""
    assert data["summary"] == {"PASS": 1, "FAIL": 1, "INFO": 1, "ERROR": 1, "N/A": 0, "parts_failed": 3}

    md = md_path.read_text()
    assert md.startswith("# GPU check: the fork against stock Lightning 2.6.6 and PyTorch's AMP recipe\n")
    assert "- torch 2.14.1+cu128; gpu H200" in md
    assert "- verdicts: 1 PASS, 1 FAIL, 1 INFO, 1 ERROR, 0 N/A; parts not completed: 3" in md
    assert md.count("| check | fork | stock | recipe | verdict | notes |") == 3  # the skipped part has no table
    assert "| a \\| pipe | bitwise | max abs diff 0.02 | reference | **FAIL** | - |" in md
    assert "**Part timeout** after 9 s: stopped" in md
    assert "## 4. Watch\n\n**Part skipped** after 0 s: the time budget was spent\n\nNo rows." in md


FAKE_PARTS = textwrap.dedent("""\
    import json, sys, time
    part, out = sys.argv[2], sys.argv[sys.argv.index("--out") + 1]
    def emit(**r):
        with open(out, "a") as f:
            f.write(json.dumps(r) + "\\n")
    if part == "versions":
        emit(kind="meta", versions={"torch": "fake"}, cuda_available=False)
    elif part == "equivalence":
        emit(kind="row", check="before the crash", verdict="PASS")
        sys.exit(3)
    elif part == "cost":
        emit(kind="row", check="before the hang", verdict="INFO")
        time.sleep(60)
    elif part == "exit_hang":
        emit(kind="row", check="all of it", verdict="PASS")
        emit(kind="done")
        time.sleep(60)
    else:
        emit(kind="row", check=part, verdict="PASS")
    emit(kind="done")
""")


@pytest.fixture
def fake_python(tmp_path) -> str:
    """An "interpreter" that ignores the parts' script and plays a part that crashes and one that hangs."""
    script = tmp_path / "fake_parts.py"
    script.write_text(FAKE_PARTS)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    return str(python)


def test_a_crashing_part_is_recorded_and_the_others_still_run(tmp_path, fake_python):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(DRIVER), "--device", "cpu", "--dry-run", "--python", fake_python,
                           "--out", str(out), "--parts", "reports,equivalence,watch"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, "a part that did not complete fails the check"
    data = json.loads((out / "gpu-check.json").read_text())
    parts = {p["name"]: p for p in data["parts"]}
    assert [p["name"] for p in data["parts"]] == ["reports", "equivalence", "watch"]
    assert parts["equivalence"]["status"] == "error" and "exited with 3" in parts["equivalence"]["error"]
    assert [r["check"] for r in parts["equivalence"]["rows"]] == ["before the crash"]
    assert parts["reports"]["status"] == parts["watch"]["status"] == "ok"
    assert data["versions"] == {"torch": "fake"}


@pytest.mark.parametrize(("part", "status", "rows"), [("cost", "timeout", ["before the hang"]),
                                                     ("exit_hang", "ok", ["all of it"])])
def test_a_part_past_its_time_is_stopped_with_its_rows_kept(tmp_path, fake_python, part, status, rows):
    """A part that hangs is stopped at its time and keeps its rows; one that hangs only at exit has completed."""
    started = time.time()
    with open(tmp_path / "log", "w") as log:
        result = driver.run_part(fake_python, part, "cpu", True, 3.0, tmp_path, log)
    assert time.time() - started < 30
    assert result["status"] == status and (result["error"] is None) == (status == "ok")
    assert [r["check"] for r in result["rows"]] == rows


def test_dry_run_runs_every_part_on_the_cpu(tmp_path):
    """The GPU's pipeline on the CPU with tiny sizes: every part, every row, the report (about a minute here)."""
    pytest.importorskip("stock_pytorch_lightning", reason="the check compares with the stock copy of `make setup`")
    out = tmp_path / "artifacts"
    proc = subprocess.run([sys.executable, str(DRIVER), "--device", "cpu", "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    log = (out / "gpu-check.log").read_text() if (out / "gpu-check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + log[-5000:]
    data = json.loads((out / "gpu-check.json").read_text())
    assert data["dry_run"] is True and data["device"] == "cpu"
    assert [p["name"] for p in data["parts"]] == ["reports", "equivalence", "cost", "watch"]
    assert all(p["status"] == "ok" and p["rows"] for p in data["parts"])
    verdicts = {row["check"]: row["verdict"] for p in data["parts"] for row in p["rows"]}
    assert not {c: v for c, v in verdicts.items() if v in ("FAIL", "ERROR")}
    assert data["versions"]["stock"] == "2.6.6" and "+" in data["versions"]["fork"]
    md = (out / "gpu-check.md").read_text()
    assert "DRY RUN on the CPU" in md
    assert md.count("| check | fork | stock | recipe | verdict | notes |") == 4
