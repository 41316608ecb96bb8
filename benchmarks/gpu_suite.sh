#!/usr/bin/env bash
# Every CUDA check raysweep has, in one command for a lent GPU machine (the step limits sum to 580 s):
#   1. the `gpu` tests (tests/test_gpu.py, tests/test_slot_memory.py)         -> gpu_tests.txt
#   2. gpu_throughput.py: batch 64-4096 x bf16/fp32 x how the step runs (as a trial does, eager,
#      compiled, compiled + CUDA graphs), most telling first, within a time budget -> gpu_throughput.txt
#   3. gpu_probe.py: the largest per-GPU batch in bf16 and fp32, MiB/image    -> gpu_probe.txt
#   4. compile_cache.py: a trial's compile time in fresh processes, cold, then with the sweep's
#      cache directory, then from the portable artifacts                      -> compile_cache.txt
#   5. gpu_throughput.py --profile of batch 1024 bf16 as a trial runs it:
#      top kernels, layout conversions, GPU busy share, what limits the step  -> gpu_profile.txt
#   6. summary.md and summary.json (every figure above, for RESULTS.md); suite.log (steps, times, exit codes)
# Files go to $OUT when set (a folder you bring back from the machine), else ./gpu_suite_out.
#
# The GPU machine has PyTorch, numpy, PyYAML, psutil and pytest, but not Ray, MLflow, pydantic or captcha,
# and no network. The suite runs raysweep's worker code without Ray, MLflow or captcha; pydantic travels
# as wheels (2.5 MB). Once, here:   bash benchmarks/device_wheels.sh        (fills .whl/, git-ignored)
# then, on the machine with the GPU, in a checkout with .whl/ copied in:   bash benchmarks/gpu_suite.sh
# (one command; its step limits keep it within 10 minutes).
#
#   bash benchmarks/gpu_suite.sh --cpu-smoke   # no GPU: the same steps in CPU --quick form, with Ray, MLflow
#                                              # and captcha made unimportable; proves the plumbing (CI runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE=0
case "${1:-}" in
    --cpu-smoke) SMOKE=1 ;;
    "") ;;
    *) echo "usage: bash benchmarks/gpu_suite.sh [--cpu-smoke]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu_suite_out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
LOG=$OUT/suite.log
: >"$LOG"
say() { echo "$*" | tee -a "$LOG"; }

# pydantic from the carried wheels, where the machine lacks it
if [[ -d .whl ]] && ! "$PY" -c "import pydantic" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        >>"$LOG" 2>&1 || { say "gpu_suite: installing .whl/*.whl failed (see $LOG)"; exit 2; }
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [[ $SMOKE == 1 ]]; then
    export PYTHONPATH=$ROOT/benchmarks/suite_env:$PYTHONPATH RAYSWEEP_BLOCK_IMPORTS=ray,mlflow,captcha
    if "$PY" -c "import ray" 2>/dev/null || "$PY" -c "import mlflow" 2>/dev/null; then
        say "gpu_suite: --cpu-smoke could not make ray/mlflow unimportable (benchmarks/suite_env)"; exit 1
    fi
fi
if ! missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('torch', 'numpy', 'yaml', 'pydantic', 'psutil', 'pytest', 'pytest_timeout') if u.find_spec(m) is None))
") || [[ -n $missing ]]; then
    say "gpu_suite: missing Python packages: ${missing:-?}; for pydantic run 'bash benchmarks/device_wheels.sh' here and carry .whl"
    exit 2
fi
if [[ $SMOKE == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "gpu_suite: no CUDA device here; 'bash benchmarks/gpu_suite.sh --cpu-smoke' checks the plumbing without one"
    exit 2
fi

START=$SECONDS
say "gpu_suite $(date -u +%Y-%m-%dT%H:%M:%SZ) mode=$([[ $SMOKE == 1 ]] && echo cpu-smoke || echo gpu) commit=$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
  [[ $SMOKE == 1 ]] && echo "blocked imports: $RAYSWEEP_BLOCK_IMPORTS"; } 2>&1 | tee -a "$LOG"

FAILED=()
step() {  # step NAME OUTFILE TIMEOUT_S COMMAND...: runs it, its output to OUTFILE, its time and exit code to the log
    local name=$1 file=$2 limit=$3; shift 3
    local t0=$SECONDS rc
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$file" 2>&1
    rc=$?
    say "step $name: exit $rc in $((SECONDS - t0)) s -> $file$([[ $rc == 124 ]] && echo " (stopped at its ${limit} s limit)")"
    [[ $rc == 0 ]] || FAILED+=("$name")
}

if [[ $SMOKE == 1 ]]; then
    export RAYSWEEP_TEST_OOM_ABOVE=40  # the CPU has no allocator limit: the probe's bisection needs an OOM to find
    step tests gpu_tests.txt 120 "$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_slot_memory.py -rs \
        -p no:cacheprovider
    step throughput gpu_throughput.txt 120 "$PY" benchmarks/gpu_throughput.py --quick --json "$WORK/throughput.json"
    step probe gpu_probe.txt 120 "$PY" benchmarks/gpu_probe.py --quick --json "$WORK/probe.json"
    step compile_cache compile_cache.txt 240 "$PY" benchmarks/compile_cache.py --quick --trials 1 \
        --json "$WORK/compile_cache.json"
    step profile gpu_profile.txt 120 "$PY" benchmarks/gpu_throughput.py --quick --profile --batches 16 --precisions bf16 \
        --json "$WORK/profile.json"
else
    # one Inductor cache for the suite's own processes (compile_cache.py makes its own, to measure it)
    export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor}
    step tests gpu_tests.txt 160 "$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_slot_memory.py -rA \
        -p no:cacheprovider
    step throughput gpu_throughput.txt 140 "$PY" benchmarks/gpu_throughput.py --batches 1024,64,256,4096 \
        --compile auto,off,graphs,on --budget-s 100 --steps 30 --json "$WORK/throughput.json"
    step probe gpu_probe.txt 100 "$PY" benchmarks/gpu_probe.py --json "$WORK/probe.json"
    step compile_cache compile_cache.txt 130 "$PY" benchmarks/compile_cache.py --trials 2 --json "$WORK/compile_cache.json"
    step profile gpu_profile.txt 50 "$PY" benchmarks/gpu_throughput.py --profile --batches 1024 --precisions bf16 \
        --compile auto --steps 10 --json "$WORK/profile.json"
fi

"$PY" - "$OUT" "$WORK" "$SMOKE" "$((SECONDS - START))" "${FAILED[*]:-}" <<'PY' 2>&1 | tee -a "$LOG"
import json, re, sys
from pathlib import Path

out, work, smoke, seconds, failed = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5].split()


def load(name):
    try:
        return json.loads((work / name).read_text())
    except (OSError, ValueError):
        return None


tests_txt = (out / "gpu_tests.txt").read_text() if (out / "gpu_tests.txt").exists() else ""
counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", tests_txt.splitlines()[-1] if tests_txt else "")}
throughput, probe, prof = load("throughput.json"), load("probe.json"), load("profile.json")
cache = load("compile_cache.json")
summary = {"mode": "cpu-smoke" if smoke else "gpu", "seconds": seconds, "failed_steps": failed, "tests": counts,
           "throughput": throughput, "probe": probe, "compile_cache": cache, "profile": prof}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
lines = [f"# gpu_suite ({summary['mode']}): {seconds} s, failed steps: {', '.join(failed) or 'none'}",
         "tests: " + (", ".join(f"{n} {k}" for k, n in counts.items()) or "no result line")]
rows = [r for r in (throughput or {}).get("rows", []) if "images_per_s" in r]
for r in rows:
    if r["precision"] == "bf16" and r["batch"] in (64, 1024):
        lines.append(f"throughput: batch {r['batch']} bf16 {r['compile']} ({'+'.join(k for k in ('compiled', 'graphs') if r.get(k)) or 'eager'}): "
                     f"{r['images_per_s']:,.0f} images/s")
errors = [r for r in (throughput or {}).get("rows", []) if "error" in r]
if throughput:
    lines.append(f"throughput: {len(rows)} configurations measured, {len(errors)} errors"
                 + "".join(f"; {r['batch']}/{r['precision']}/{r['compile']}: {r['error']}" for r in errors))
for r in (cache or {}).get("results", []):
    lines.append(f"compile_cache: trial {r['trial']} ({r['cache']}): " + ", ".join(
        f"batch {t['batch']} compile_s {t['compile_s']:.1f}" for t in r["trials"]))
for r in (probe or {}).get("results", []):
    per = f"{1024 * r['gib_per_image']:.2f} MiB/image" if r["gib_per_image"] is not None else "MiB/image n/a"
    lines.append(f"probe {r['precision']}: largest per-GPU batch {r['largest']}, recommended {r['recommended']}, {per}")
if prof:
    lines.append(f"profile: {prof['images_per_s']:,.0f} images/s under the profiler; layout conversions per step: "
                 f"{prof.get('layout_conversions_per_step', 'n/a')}; limit: {prof['limit']}")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
say "files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
[[ ${#FAILED[@]} == 0 ]]
