"""Two torch processes on one machine's cores, as the test suite's two lanes run: libgomp's wait policy.

Each process trains raysweep's CNN (64×24 images, batch 32, AdamW) for a fixed number of steps on torch's default
threads (one per core). Per repetition, alternating the policies: one process alone, then two started together;
OMP_WAIT_POLICY unset (libgomp spins between parallel regions: GOMP_SPINCOUNT, libgomp/env.c), then PASSIVE (a waiting
thread sleeps). tests/conftest.py sets PASSIVE for the suite from these figures.

    python benchmarks/omp_lanes.py [--steps 40] [--repeats 3]
    python benchmarks/omp_lanes.py --quick      # the code path (CI)

Last line: RESULT omp_lanes ratio=<two together, spinning ÷ two together, PASSIVE> (median wall seconds; above 1:
PASSIVE's pair finished sooner).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
import torch
sys.path.insert(0, sys.argv[2])
from raysweep.model import CaptchaCNN
torch.manual_seed(0)
model = CaptchaCNN(24, 64, 4, 36).to(memory_format=torch.channels_last)
opt = torch.optim.AdamW(model.parameters(), 1e-3)
x = torch.rand(32, 1, 24, 64).to(memory_format=torch.channels_last)
y = torch.randint(0, 36, (32, 4))
for step in range(-2, int(sys.argv[1])):  # two warm-up steps
    if step == 0:
        t, c = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 36), y.reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
e = resource.getrusage(resource.RUSAGE_SELF)
cpu = e.ru_utime + e.ru_stime - c.ru_utime - c.ru_stime
print(json.dumps({"wall": time.perf_counter() - t, "cpu": cpu, "threads": torch.get_num_threads()}))
"""

POLICIES = {"spinning (unset)": None, "PASSIVE": "PASSIVE"}


def run(n: int, steps: int, policy: str | None) -> list[dict]:
    """`n` processes started together; each one's {wall, cpu, threads}."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(steps), str(ROOT)], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"omp_lanes: a training process exited {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="5 steps, 1 repetition: the code path")
    a = p.parse_args()
    steps, repeats = (5, 1) if a.quick else (a.steps, a.repeats)
    alone = {name: [] for name in POLICIES}
    together = {name: [] for name in POLICIES}
    threads = None
    for _ in range(repeats):
        for name, policy in POLICIES.items():
            (one,) = run(1, steps, policy)
            pair = run(2, steps, policy)
            threads = one["threads"]
            alone[name].append(one)
            together[name].append(max(pair, key=lambda r: r["wall"]))  # the pair is done when its slower one is
    print(f"omp_lanes on {os.cpu_count()} CPUs, torch threads {threads}; {steps} steps of the CNN at batch 32, "
          f"64×24; {repeats} alternating repetition(s); medians")
    print(f"{'policy':18s} {'alone wall s':>12s} {'alone CPU s':>11s} {'two together wall s':>19s} "
          f"{'(each repetition)':>24s} {'together ÷ alone':>16s}")
    med = {}
    for name in POLICIES:
        a_wall = statistics.median(r["wall"] for r in alone[name])
        a_cpu = statistics.median(r["cpu"] for r in alone[name])
        t_wall = statistics.median(r["wall"] for r in together[name])
        each = ", ".join(f"{r['wall']:.1f}" for r in together[name])
        med[name] = t_wall
        print(f"{name:18s} {a_wall:12.2f} {a_cpu:11.2f} {t_wall:19.2f} {'(' + each + ')':>24s} {t_wall / a_wall:16.2f}")
    print(f"RESULT omp_lanes ratio={med['spinning (unset)'] / med['PASSIVE']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
