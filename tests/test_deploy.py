"""deploy/make_env.py, cluster.yaml's first setup command, with the distribution's own python3 (Debian's here).

Where python3-venv is missing (a stock Ubuntu), ensurepip is not there: a mount namespace of the test's own hides
Debian's ensurepip folder behind an empty one, exactly that state, and make_env fetches pip from the index pip would
use (a real index on loopback, tests/wheel_index.py). tests/test_ray_up.py runs the same through `ray up`.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from wheel_index import Index, wheelhouse

from conftest import ROOT

STOCK_PYTHON = "/usr/bin/python3"
MAKE_ENV = str(ROOT / "deploy" / "make_env.py")


def _stock() -> tuple[str, Path]:
    if not Path(STOCK_PYTHON).is_file() or shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs the distribution's /usr/bin/python3, unshare and root")
    stdlib = subprocess.run([STOCK_PYTHON, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                            capture_output=True, text=True, check=True).stdout.strip()
    return STOCK_PYTHON, Path(stdlib) / "ensurepip"


def _without_ensurepip(tmp_path: Path, ensurepip: Path, command: list[str], env: dict) -> subprocess.CompletedProcess:
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    script = f"mount --bind {empty} {ensurepip} && exec \"$@\""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *command],
                          env=env, capture_output=True, text=True, timeout=300)


def _clean_env(**extra: str) -> dict:
    """No pip settings of this machine's (its mirror, its find-links): a stock machine's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    return {**env, "HOME": extra.pop("HOME"), "XDG_CONFIG_DIRS": "/nonexistent", **extra}


def test_make_env_without_ensurepip_takes_pip_from_the_index_pip_would_use(tmp_path):
    python, ensurepip = _stock()
    wheels = wheelhouse(tmp_path / "wheels", ["pip"])
    assert any(w.name.startswith("pip-") for w in wheels)
    index = Index(tmp_path / "wheels", "127.0.0.1")
    try:
        home = tmp_path / "home"
        (home / ".config" / "pip").mkdir(parents=True)  # the index named as a mirror is, in pip's own configuration
        (home / ".config" / "pip" / "pip.conf").write_text(f"[global]\nindex-url = {index.url}\n")
        env_dir = tmp_path / "node-env"
        made = _without_ensurepip(tmp_path, ensurepip, [python, MAKE_ENV, str(env_dir)], _clean_env(HOME=str(home)))
        assert made.returncode == 0, made.stderr
        assert f"pip from {index.url.removesuffix('simple/')}files/pip-" in made.stdout, made.stdout
        pip = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "--version"], capture_output=True,
                             text=True, timeout=60)
        assert pip.returncode == 0 and str(env_dir) in pip.stdout, pip.stdout + pip.stderr
        # run again (`ray up` reruns its setup): the working environment is kept
        again = subprocess.run([python, MAKE_ENV, str(env_dir)], capture_output=True, text=True, timeout=120,
                               env=_clean_env(HOME=str(home)))
        assert again.returncode == 0 and "is ready" in again.stdout and "kept" in again.stdout, again.stdout
    finally:
        index.close()


def test_make_env_with_ensurepip_and_its_one_line_failures(tmp_path):
    python, ensurepip = _stock()
    home = tmp_path / "home"
    home.mkdir()
    made = subprocess.run([python, MAKE_ENV, str(tmp_path / "env")], capture_output=True, text=True, timeout=300,
                          env=_clean_env(HOME=str(home)))
    assert made.returncode == 0 and "pip from ensurepip" in made.stdout, made.stdout + made.stderr
    # no ensurepip and an index that does not answer: exit 1, one line naming the index and the fix
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    failed = _without_ensurepip(tmp_path, ensurepip, [python, MAKE_ENV, str(tmp_path / "env2")],
                                _clean_env(HOME=str(home), PIP_INDEX_URL=f"http://127.0.0.1:{port}/simple/"))
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 1 and len(lines) == 1, failed.stderr
    assert f"127.0.0.1:{port}/simple/pip/" in lines[0] and "apt-get install python3-venv" in lines[0], lines
    # an interpreter older than requires-python (Ubuntu 20.04's 3.8, a real 3.9 where pyenv has one): one line
    older = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.[89].*/bin/python3.[89]")))
    if older:
        old = subprocess.run([older[-1], MAKE_ENV, str(tmp_path / "env3")], capture_output=True, text=True,
                             timeout=60, env=_clean_env(HOME=str(home)))
        assert old.returncode == 1 and "needs Python >= 3.10" in old.stderr, old.stderr
        assert len(old.stderr.strip().splitlines()) == 1 and not (tmp_path / "env3").exists(), old.stderr
