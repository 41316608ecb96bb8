"""benchmarks/driver_scale.py in --quick mode: the real driver (Tune, ASHA, the MLflow writer, the broker) runs a
small sweep on simulated slots to its end and prints its figures (no timing asserted)."""

import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.ray
@pytest.mark.timeout(150)
def test_driver_scale_quick_runs_a_sweep_on_simulated_slots_and_prints_its_figures():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "driver_scale.py"), "--quick"],
                          capture_output=True, text=True, timeout=140, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "reports/s" in out and "gives first" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT driver_scale "))
    figures = dict(item.split("=", 1) for item in line.split()[2:])
    assert figures["concurrency"] == "2" and figures["trials"] == "4" and figures["max_running"] == "2"
    # every trial ended through ASHA or at max_t, none failed; every report reached Tune and the store
    assert int(figures["finished"]) + int(figures["pruned"]) == 4 and figures["failed"] == "0"
    assert int(figures["results"]) > 0 and float(figures["reports_per_s"]) > 0
    assert float(figures["decision_lag_p50_s"]) >= 0 and float(figures["writes_per_s"]) > 0
    assert re.fullmatch(r"[a-z-]+", figures["gives_first"])
