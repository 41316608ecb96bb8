"""Python 3.10 (Ubuntu 22.04's python3), the oldest requires-python admits, on a real 3.10 interpreter.

A virtual environment of that interpreter gets every dependency of pyproject.toml but torch from this machine's index
(torch's only 3.10 builds on PyPI for this platform are CUDA builds whose nvidia-* packages this machine's index does
not serve, so no trial can run here under 3.10), and runs under 3.10:
- every file of the repository compiled (its syntax);
- the sweep's driver-side tests of the quick tier (the spec, the search, the answer, the records, the report, the
  plan), with the repository on PYTHONPATH;
- `raysweep check` on the quickstart's spec (Ray, MLflow and the config as the CLI loads them);
- deploy/make_env.py, cluster.yaml's first setup command, making a working environment.
The rest (the worker's torch code) is held to 3.10 by vermin, which fails on any standard-library name or syntax
newer than 3.10 in any file.

The interpreter: $RAYSWEEP_PYTHON310, else pyenv's 3.10, else `python3.10` on the PATH. .ci/run sets
RAYSWEEP_REQUIRE_PY310=1: there a missing interpreter fails the test instead of skipping it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib  # novermin: this module runs on the suite's interpreter (it makes the 3.10 one)

from conftest import ROOT

# the quick tier's modules that need no torch (the rest import the worker's code)
DRIVER_TESTS = ["test_config.py", "test_search.py", "test_answer.py", "test_report.py", "test_data.py",
                "test_asha.py"]


def python310() -> str | None:
    which = shutil.which("python3.10")
    found = [os.environ.get("RAYSWEEP_PYTHON310"),
             *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10.*/bin/python3.10"))),
             None if which is None or "/shims/" in which else which]  # a pyenv shim runs only where 3.10 is chosen
    return next((p for p in found if p and Path(p).is_file()), None)


def test_the_repository_holds_to_python_3_10():
    vermin = str(Path(sys.executable).parent / "vermin")
    done = subprocess.run([vermin, "-t=3.10-", "--violations", "--eval-annotations", "--no-tips",
                           "raysweep", "deploy", "benchmarks", "tests", "docs"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.10"


@pytest.mark.py310
@pytest.mark.timeout(900)
def test_under_python_3_10_the_driver_and_the_node_setup_run(tmp_path):
    interpreter = python310()
    if interpreter is None:
        if os.environ.get("RAYSWEEP_REQUIRE_PY310") == "1":
            pytest.fail("no Python 3.10 interpreter (RAYSWEEP_PYTHON310, python3.10, ~/.pyenv/versions/3.10.*); "
                        "RAYSWEEP_REQUIRE_PY310=1 (set by .ci/run)")
        pytest.skip("no Python 3.10 interpreter")
    env_dir = tmp_path / "py310"
    subprocess.run([interpreter, "-m", "venv", str(env_dir)], check=True, timeout=120)
    python = str(env_dir / "bin" / "python")
    assert subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                          text=True, check=True).stdout.strip() == "(3, 10)"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = [d for d in project["dependencies"] if not d.startswith("torch")]
    tests = [d for d in project["optional-dependencies"]["test"] if d.startswith(("pytest", "pytest-timeout"))]
    installed = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", *deps, *tests],
                               capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    # the repository on the path; its bytecode beside the test, not in the repository's __pycache__ folders
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache")}
    env.pop("PYTHONHOME", None)

    compiled = subprocess.run([python, "-m", "compileall", "-q", "-d", "repo", "raysweep", "deploy", "benchmarks",
                               "tests", "docs"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env=env)
    assert compiled.returncode == 0, compiled.stdout[-3000:]

    ran = subprocess.run([python, "-m", "pytest", "-q", "-m", "quick", "-p", "no:cacheprovider",
                          *(f"tests/{t}" for t in DRIVER_TESTS)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    assert " passed" in ran.stdout and "error" not in ran.stdout.splitlines()[-1], ran.stdout[-2000:]

    checked = subprocess.run([python, "-m", "raysweep", "check", "search_spaces/quickstart.yaml"], cwd=ROOT,
                             capture_output=True, text=True, timeout=300,
                             env=env)
    assert checked.returncode == 0, checked.stdout[-2000:] + checked.stderr[-2000:]

    made = subprocess.run([interpreter, str(ROOT / "deploy" / "make_env.py"), str(tmp_path / "node-env")],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0 and "made with Python 3.10." in made.stdout, made.stdout + made.stderr
    pip = subprocess.run([str(tmp_path / "node-env" / "bin" / "python"), "-m", "pip", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert "(python 3.10)" in pip.stdout, pip.stdout + pip.stderr
