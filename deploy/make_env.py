"""Make raysweep's virtual environment on a machine as it comes: `python3 make_env.py ~/raysweep-env`.

cluster.yaml's first setup command (Python's standard library only, so the distribution's own `python3` runs it).
Stock Debian 12 and Ubuntu 23.04+ refuse `pip install` into the system Python (PEP 668: "externally-managed-
environment"), so everything raysweep needs goes into a virtual environment of its own; the later setup commands
install into it with its `pip`, and cluster.yaml puts its `bin` first on the PATH of every shell Ray opens.

Debian and Ubuntu ship the `venv` module without `ensurepip` unless python3-venv is installed (a stock Ubuntu image
has no python3-venv). Then the environment is made without pip and pip is installed into it from the index pip itself
would use (PIP_INDEX_URL, else `index-url` in pip's configuration files, else PyPI): the newest pip wheel, checked
against the index's sha256, run from the wheel file (pip supports `python pip.whl/pip install pip.whl`).

Run again, it keeps an environment whose Python and pip work (`ray up` reruns the setup commands). Exit 1 with one
line naming the cause and the fix otherwise.
"""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import urllib.parse
import urllib.request
import venv
from pathlib import Path

MIN_PYTHON = (3, 10)  # pyproject.toml's requires-python
PYPI = "https://pypi.org/simple/"
WHEEL = re.compile(r'href="([^"]*/)?(pip-(\d+(?:\.\d+)*)-py3-none-any\.whl)(#sha256=([0-9a-f]{64}))?"')


def fail(message: str) -> None:
    print(f"make_env: {message}", file=sys.stderr)
    raise SystemExit(1)


def works(env: Path) -> bool:
    python = env / "bin" / "python"
    if not python.exists():
        return False
    done = subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True, text=True)
    return done.returncode == 0


def index_url() -> str:
    """The index pip would use: PIP_INDEX_URL, else the last `index-url` of pip's configuration files
    (global, then user, then PIP_CONFIG_FILE: pip's own order), else PyPI."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    home = Path.home()
    xdg = [Path(p) for p in os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":") if p]
    files = [*(d / "pip" / "pip.conf" for d in xdg), Path("/etc/pip.conf"), home / ".pip" / "pip.conf",
             Path(os.environ.get("XDG_CONFIG_HOME", home / ".config")) / "pip" / "pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    found = PYPI
    for path in files:
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (OSError, configparser.Error):
            continue
        for section in ("global", "install"):
            if parser.has_option(section, "index-url"):
                found = parser.get(section, "index-url").split()[0]
    return found


def bootstrap_pip(env: Path) -> str:
    """pip into `env` from the index's newest pip wheel; returns where the wheel came from."""
    page_url = index_url().rstrip("/") + "/pip/"
    try:
        with urllib.request.urlopen(page_url, timeout=60) as reply:
            page = reply.read().decode("utf-8", "replace")
    except OSError as e:
        fail(f"{env}: this Python has no ensurepip and the index {page_url} did not answer ({e}); install "
             f"python3-venv (sudo apt-get install python3-venv) and run the setup again")
    wheels = sorted((tuple(int(x) for x in m.group(3).split(".")), m) for m in WHEEL.finditer(page))
    if not wheels:
        fail(f"{env}: no pip wheel listed at {page_url}; install python3-venv (sudo apt-get install python3-venv)")
    match = wheels[-1][1]
    url = urllib.parse.urljoin(page_url, (match.group(1) or "") + match.group(2))
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(tmp) / match.group(2)
        with urllib.request.urlopen(url, timeout=300) as reply, open(wheel, "wb") as out:
            shutil.copyfileobj(reply, out)
        if match.group(5) and hashlib.sha256(wheel.read_bytes()).hexdigest() != match.group(5):
            fail(f"{url}: its sha256 is not the one the index lists; run the setup again")
        done = subprocess.run([str(env / "bin" / "python"), f"{wheel}/pip", "install", "--no-index", str(wheel)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            fail(f"{env}: installing {wheel.name} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return url


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        fail("usage: python3 make_env.py ENV_FOLDER")
    if sys.version_info < MIN_PYTHON:
        fail(f"raysweep needs Python >= {'.'.join(map(str, MIN_PYTHON))}; {sys.executable} is "
             f"{sys.version.split()[0]} (install a newer python3 and run the setup again)")
    env = Path(argv[0]).expanduser()
    if works(env):
        print(f"make_env: {env} is ready ({sys.version.split()[0]}; kept)")
        return
    # Debian's and Ubuntu's python3 without python3-venv have no ensurepip/__main__.py (their venv checks the same
    # file, prints how to apt-install it and exits); clear: a half-made environment (an earlier failure, an
    # interpreter since removed) starts over
    source = "ensurepip"
    if (Path(sysconfig.get_path("stdlib")) / "ensurepip" / "__main__.py").is_file():
        try:
            venv.EnvBuilder(clear=True, symlinks=True, with_pip=True).create(env)
        except (subprocess.CalledProcessError, SystemExit):  # an ensurepip without its bundled wheels
            source = ""
    else:
        source = ""
    if not source:
        venv.EnvBuilder(clear=True, symlinks=True, with_pip=False).create(env)
        source = bootstrap_pip(env)
    if not works(env):
        fail(f"{env}: made, but its pip does not run; remove it and run the setup again")
    print(f"make_env: {env} made with Python {sys.version.split()[0]}, pip from {source}")


if __name__ == "__main__":
    main(sys.argv[1:])
