#!/usr/bin/env bash
# The GPU figure for warm worker groups' start-up (1769336), for a lent GPU machine: `tune` of
# search_spaces/one_gpu.yaml cut to
# 4 trials x 8 epochs on 20,000 synthetic images, through Ray (NCCL, one GPU worker), ASHA and MLflow. Its output,
# with every trial's `up ... started in` line and the closing `busy` line, goes to $OUT/gpu_sweep.txt.
#
# The machine lacks Ray and MLflow (and has no network): pack them here once into .device_site.tar.xz at the
# repository's root (~45 MB; keep it out of git, e.g. in .git/info/exclude), an xz tar whose top folder
# device_site/ holds, installed for the machine's Python (3.12, x86-64 manylinux wheels), every package of this
# project's environment the machine's image lacks (Ray, MLflow, captcha, pydantic and their dependencies), less
# torch and the NVIDIA libraries (the machine's own CUDA build serves). The script unpacks it into /tmp and puts
# /tmp/device_site on PYTHONPATH. Then, on the machine with the GPU, in a checkout with the archive copied in:
#   bash benchmarks/gpu_sweep.sh            # one command, sized for a 10-minute limit
#   SHARED=3 bash benchmarks/gpu_sweep.sh   # the project's three-rank trial on the one GPU: three Ray Train workers
#                                           # holding a third of it each, over gloo (scaling.workers_per_gpu)
#                                           # -> $OUT/gpu_sweep_shared.txt
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_suite_out}
mkdir -p "$OUT"
if ! python3 -c "import ray, mlflow" 2>/dev/null; then
    [[ -f .device_site.tar.xz ]] || { echo "gpu_sweep: no Ray/MLflow here and no .device_site.tar.xz to unpack" >&2; exit 2; }
    tar -xJf .device_site.tar.xz -C /tmp
    export PYTHONPATH=/tmp/device_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
cd "$WORK"
SHARE=() NAME=gpu_sweep
if [[ -n "${SHARED:-}" ]]; then
    SHARE=(--set "scaling.num_workers=$SHARED" --set "scaling.workers_per_gpu=$SHARED" --set scaling.cpus_per_worker=2)
    NAME=gpu_sweep_shared
fi
python3 -m raysweep tune "$ROOT/search_spaces/one_gpu.yaml" --set storage_path="$WORK/results" "${SHARE[@]}" \
    --set data.synthetic.train_size=20000 --set data.synthetic.val_size=2000 --set tune.num_samples=4 \
    --set train.epochs=8 --set train.checkpoint_every=2 \
    --set 'tune.asha={max_t: 8, grace_period: 2, reduction_factor: 2}' --set 'search.warmup_epochs={randint: [0, 2], default: 1}' \
    2>&1 | tee "$OUT/$NAME.txt"
