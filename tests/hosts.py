"""Machines made on this one, for tests of what crosses a network (`ray up`, a sweep over several nodes).

Each host is a network namespace joined to a bridge by a veth pair (iproute2), with its own PID namespace
(`unshare --pid --fork --kill-child --mount-proc`: `ray stop` on one host cannot see another's processes) and its
own mount namespace: its own `/tmp`, `/dev/shm` and home (`/root`), so Ray's session folder, its object store and a
`~/raysweep` are the host's alone, as on a separate machine. The Python interpreter's folder is bound into that
home at its usual path and put on its PATH (a host needs an interpreter as a real machine does), unless the hosts
are `stock`: then `python3` is the distribution's own (Debian's /usr/bin/python3, externally managed) and what a
stock machine lacks is hidden (`hide`: an empty folder bound over each path, e.g. pip's machine-wide configuration or
`ensurepip`, which python3-venv brings). The rest of the file system is shared, as a machine's system files would be
identical; `shared` is bound at the same path in every host (what an
NFS mount looks like to a process). The host's PID 1 is `sshd`, reached from this machine (the launcher's side of
the bridge) exactly as `ray up` reaches real machines. Killing PID 1 ends every process on the host at once: a
power cut.

Needs root, iproute2, util-linux's unshare and Debian's openssh-server (.ci/run installs them).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"
SHARED_MOUNT = "/mnt/raysweep-shared"  # where every host sees the shared folder (made in the launcher's root too)


def missing_tools() -> list[str]:
    need = ["ip", "unshare", "ssh", "ssh-keygen", "rsync", SSHD]
    return [t for t in need if shutil.which(t) is None] + ([] if os.geteuid() == 0 else ["root"])


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    root: Path  # under it: this host's own tmp/ and home/ (its /dev/shm is a tmpfs of its own)
    proc: subprocess.Popen | None = None

    @property
    def home(self) -> Path:
        return self.root / "home"

    def pid1(self) -> int | None:
        """The host's PID 1 (its sshd) as this machine numbers it; None once the host is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def pids(self, needle: str = "") -> list[int]:
        """Every process in this host's PID namespace (whose command line holds `needle`)."""
        pid1 = self.pid1()
        if pid1 is None:
            return []
        ns = os.readlink(f"/proc/{pid1}/ns/pid")
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "ns" / "pid") != ns:
                    continue
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                found.append(int(entry.name))
        return found

    def power_off(self) -> None:
        """Every process on the host killed at once (PID 1 with SIGKILL: the kernel kills the rest of its namespace)."""
        pid1 = self.pid1()
        if pid1 is not None:
            os.kill(pid1, signal.SIGKILL)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class Hosts:
    """`n` hosts on one bridge: hosts[i].ip, reached over SSH as root with `key` (the launcher's own key)."""

    def __init__(self, base: Path, n: int, shared: Path | None = None, bashrc: str = "", stock: bool = False,
                 hide: dict[int, list[str]] | None = None):
        tag = f"{os.getpid() % 10000}"
        self.base, self.tag, self.shared, self.bashrc = base, tag, shared, bashrc
        self.stock, self.hide = stock, hide or {}
        third = 100 + os.getpid() % 150
        self.bridge, self.gateway, self.prefix = f"rsb{tag}", f"10.{third}.0.1", f"10.{third}.0"
        self.key = base / "launcher_key"
        self.hosts = [Host(f"h{i}", f"rs{tag}h{i}", f"{self.prefix}.{10 + i}", base / f"h{i}") for i in range(n)]

    def __enter__(self) -> Hosts:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self, deadline_s: float = 60) -> None:
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
        if self.shared is not None:
            Path(SHARED_MOUNT).mkdir(parents=True, exist_ok=True)
        for host in self.hosts:
            self._make(host)
        deadline = time.monotonic() + deadline_s
        for host in self.hosts:  # sshd answers a real login on each
            while self.ssh(host, "true", check=False, timeout=10).returncode != 0:
                assert host.proc.poll() is None, f"host {host.name} exited: {host.proc.stderr.read()}"
                assert time.monotonic() < deadline, f"host {host.name}: no SSH login in {deadline_s:.0f} s"
                time.sleep(0.5)

    def _make(self, host: Host) -> None:
        veth = f"rs{self.tag}v{host.name[1:]}"
        _run("ip", "netns", "add", host.netns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        _run("ip", "link", "set", veth, "master", self.bridge)
        _run("ip", "link", "set", veth, "up")
        for cmd in (["addr", "add", f"{host.ip}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                    ["link", "set", "lo", "up"],
                    # Ray picks its node IP from a UDP socket connected toward a public address (no packet is sent:
                    # src/ray/util/network_util.cc), which needs a route; nothing leaves: the bridge forwards nowhere
                    ["route", "add", "default", "via", self.gateway]):
            _run("ip", "-n", host.netns, *cmd)
        for sub in ("tmp", "home/.ssh", "home/.hostd"):
            (host.root / sub).mkdir(parents=True, exist_ok=True)
        (host.root / "tmp").chmod(0o1777)
        home = host.home
        shutil.copy(f"{self.key}.pub", home / ".ssh" / "authorized_keys")
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / ".hostd" / "host_key"))
        (home / ".hostd" / "sshd_config").write_text("\n".join([
            "ListenAddress 0.0.0.0", "HostKey /root/.hostd/host_key", "PidFile none",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "AuthorizedKeysFile /root/.ssh/authorized_keys", "MaxSessions 64",
            "MaxStartups 64:30:128", "AllowTcpForwarding yes", "Subsystem sftp internal-sftp", ""]))
        bindir = str(Path(sys.executable).parent)
        path = "" if self.stock else f"export PATH={bindir}:$PATH\n"
        (home / ".bashrc").write_text(f"{path}{self.bashrc}")
        (home / ".profile").write_text("")
        # the interpreter's folder, where it lives under this machine's home, is bound at the same place in the
        # host's home (a venv's python is a link into it)
        binds = []
        real_home = Path.home().resolve()
        for folder in set() if self.stock else {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}:
            if folder.is_relative_to(real_home):
                top = real_home / folder.relative_to(real_home).parts[0]
                (home / top.name).mkdir(exist_ok=True)
                binds.append(f"mount --rbind {top} {home / top.name}")
        empty = host.root / "empty"
        empty.mkdir(exist_ok=True)
        binds += [f"mount --bind {empty} {hidden}" for hidden in self.hide.get(int(host.name[1:]), [])
                  if Path(hidden).is_dir()]
        if self.shared is not None:
            binds.append(f"mount --bind {self.shared} {SHARED_MOUNT}")
        script = " && ".join([
            *binds,
            f"mount --rbind {home} /root",
            "mount -t tmpfs -o size=4g tmpfs /dev/shm",
            f"mount --bind {host.root / 'tmp'} /tmp",  # last: the host's own paths above live under /tmp
            f"exec {SSHD} -D -e -f /root/.hostd/sshd_config",
        ])
        host.proc = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
             "--propagation", "private", "sh", "-c", script],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def ssh(self, host: Host, command: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
             "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR", f"root@{host.ip}", command],
            capture_output=True, text=True, timeout=timeout, check=check)

    def down(self) -> None:
        """Every host's processes killed, its namespace and links removed; safe after a partial `up`."""
        for host in self.hosts:
            try:
                host.power_off()
            except Exception:  # noqa: BLE001 - keep removing the rest
                pass
            _run("ip", "netns", "del", host.netns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
