"""Each benchmark runs in --quick mode and produces its table and RESULT line (no timing asserted)."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT


def _run(script: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick"], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"RESULT \w+ (ratio|value)=\d+\.\d+", last), last
    return proc.stdout


def test_loop_vs_seed_quick():
    import torch

    from raysweep.train_loop import resolve_precision

    out = _run("loop_vs_seed.py")
    assert "loop           batch  loader workers   images/s  vs best seed" in out
    assert len([ln for ln in out.splitlines() if ln.startswith(("seed ", "raysweep "))]) == 6
    bf16_rows = len([ln for ln in out.splitlines() if ln.startswith("raysweep-bf16 ")])
    assert bf16_rows == (2 if resolve_precision("auto", torch.device("cpu")) == "bf16" else 0)


@pytest.mark.ray
def test_ray_overhead_quick():
    out = _run("ray_overhead.py")
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("all cores ", "a core spare "))]
    assert [r[-6] for r in rows] == ["128", "64"]  # images per configuration (--quick)
    assert all(float(v) > 0 for r in rows for v in r[-5:])  # bare, Ray, worker own, ratio, first report
    assert re.search(r"^RESULT ray_overhead_spare_core ratio=\d+\.\d+$", out, re.M)
    assert re.search(r"^RESULT ray_first_report_s value=\d+\.\d+$", out, re.M)


def test_gpu_throughput_quick_checks_the_code_path_on_cpu():
    out = _run("gpu_throughput.py")
    assert "MFLOP per image forward+backward" in out
    rows = [ln for ln in out.splitlines() if re.match(r"\s+(8|16)\s+(fp32|bf16)", ln)]
    assert len(rows) == 2 * 2 * 2  # batches × precisions × channels_last


@pytest.mark.ray
def test_ray_overhead_timeline_lists_the_processes_a_trial_starts():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ray_overhead.py"), "--quick", "--timeline"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = proc.stdout.split("timeline of a 1-epoch trial, ")[1:]
    assert [t.split(" (")[0] for t in tables] == ["the first on this cluster", "a later one"]
    for table in tables:
        assert "ray::RayTrainWorker" in table and "ray::SynchronizationActor" in table
        assert "first report reaches the controller" in table
        assert "DatasetManager" not in table and "PreemptionWatcher" not in table


def test_noise_cost_quick():
    out = _run("noise_cost.py")
    rows = [ln for ln in out.splitlines() if ln.startswith(("DDP, 2 gloo ranks", "1 rank, 2 micro-batches"))]
    assert len(rows) == 2 and all(float(v) > 0 for r in rows for v in r.split()[-3:])
    assert "of the DDP step" in out


def test_critical_batch_quick():
    out = _run("critical_batch.py")
    table = out.split("global_batch")[1].splitlines()[1:-1]
    assert [int(r.split()[0]) for r in table] == [4, 8, 16, 32]
    assert float(table[0].split()[3]) == 1.0  # the smallest batch anchors E_min: its ratio is 1 by construction
