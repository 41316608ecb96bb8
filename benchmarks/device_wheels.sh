#!/usr/bin/env bash
# The few wheels gpu_suite.sh needs on a lent GPU machine that has PyTorch, numpy, PyYAML, psutil and
# pytest but not pydantic (raysweep's config: TrialConfig), and no network. Downloads them into .whl/
# (ignored by git; under 3 MB), for that machine's Python (3.12, x86-64), at the versions installed here.
# Ray, MLflow and captcha are not needed: the suite runs raysweep's worker code without them.
#
#   bash benchmarks/device_wheels.sh            # then copy .whl/ into the checkout on the GPU machine
#                                               # (CONTRIBUTING.md, "The GPU suite")
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
names=(pydantic pydantic-core annotated-types typing-inspection typing-extensions)
pins=$(python - "${names[@]}" <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
PY
)
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $pins
ls -l .whl
du -sh .whl
