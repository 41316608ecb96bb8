"""What a sweep across machines needs of them, checked once it has joined the cluster and before any trial starts:
every machine the cluster file lists is up, and `storage_path` is one place that every machine reads and writes.

A machine left out of the cluster is silent in Ray (its autoscaler keeps retrying, `ray status` shows no failure),
and a trial whose checkpoints went to one machine's own disk cannot continue on another: both are found here, and
said in one line, instead of in a sweep that waits for ever or a resume that starts a trial over.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from raysweep import storage
from raysweep.errors import UserError

# `ray up` writes the cluster file it brought the head up from here, on the head (the autoscaler's
# `--autoscaling-config`; ray/autoscaler/_private/commands.py, get_or_create_head_node)
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"
JOIN_WAIT_S = 180.0  # how long a sweep waits for the machines the cluster file lists (the monitor adds one per 5 s)
JOIN_SAY_EVERY_S = 30.0
SHARED_CHECK_S = 60.0  # a node's reader task (a worker process to start, one small file to read) ends within this
MARKER = ".raysweep-shared-check"


def listed_ips(path: str = BOOTSTRAP_CONFIG) -> list[str]:
    """The machines a `ray up` of `provider: local` lists (head_ip, then worker_ips: addresses or host names, as the
    user wrote them), read from the head's copy of the cluster file; [] where there is none (a `ray start` by hand,
    a cloud provider that scales on demand)."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        return []
    provider = (yaml.safe_load(file.read_text()) or {}).get("provider") or {}
    if provider.get("type") != "local" or "worker_ips" not in provider:
        return []
    return list(dict.fromkeys(ip for ip in [provider.get("head_ip"), *provider["worker_ips"]] if ip))


def addresses_of(host: str) -> set[str]:
    """Every address a listed machine's name or address stands for (a host name resolved; itself where it does
    not resolve)."""
    import socket

    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)} | {host}
    except OSError:
        return {host}


def _machine_addresses() -> dict:
    """On one node: every address of its machine (each network card's, loopback's) and its host name."""
    import socket

    import psutil

    found = {socket.gethostname()}
    for addrs in psutil.net_if_addrs().values():
        found |= {a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)}
    return {"addresses": sorted(found)}


_ADDRESSES: dict[str, frozenset] = {}  # node id → every address of its machine (asked once per node)


def _node_addresses(node: dict) -> frozenset:
    """Every address of a live node's machine (a task pinned to it, asked once; the address Ray reports alone where
    it does not answer in SHARED_CHECK_S)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = node["NodeID"]
    if node_id not in _ADDRESSES:
        ask = ray.remote(num_cpus=0, max_retries=0)(_machine_addresses)
        ref = ask.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        ready, _ = ray.wait([ref], timeout=SHARED_CHECK_S)
        found = set(ray.get(ref)["addresses"]) if ready else set()
        _ADDRESSES[node_id] = frozenset(found | {node["NodeManagerAddress"]})
    return _ADDRESSES[node_id]


def _node_ips() -> tuple[set[str], set[str]]:
    """(every address of the machines alive, the addresses Ray reports of nodes it marked dead): a machine that
    joined and was lost stays in `ray.nodes()` with Alive false."""
    import ray

    nodes = ray.nodes()
    alive = set().union(*(_node_addresses(n) for n in nodes if n["Alive"]))
    return alive, {n["NodeManagerAddress"] for n in nodes if not n["Alive"]} - alive


def _head_addresses() -> set[str]:
    """Every address of this cluster's head: the machine its GCS runs on."""
    import ray

    host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0].strip("[]")
    here = addresses_of(host)
    for node in ray.nodes():
        if node["Alive"] and (node["NodeManagerAddress"] in here or here & _node_addresses(node)):
            return set(_node_addresses(node)) | here
    return here


def wait_for_listed(say, path: str = BOOTSTRAP_CONFIG, wait_s: float = JOIN_WAIT_S, poll_s: float = 2.0) -> list[str]:
    """Wait until every machine the cluster file lists has joined, at most `wait_s`; returns the ones not up (as
    listed). A listed machine is matched by address: its name resolved, against every address of each node's
    machine (not only the one Ray reports). A file whose head is not this cluster's is one line, and no wait.
    `say(line)`: what it waits for (once, then every JOIN_SAY_EVERY_S) and one line naming the machines that never
    joined, or joined and were lost (Ray marked them dead: no wait for those). The sweep then goes on with what is
    up: a trial that needs more GPUs than are left is refused by the plan, and a sweep resumed after a machine was
    lost runs on the rest."""
    listed = listed_ips(path)
    if not listed:
        return []
    names = {host: addresses_of(host) for host in listed}
    head = _head_addresses()
    if not names[listed[0]] & head:  # `ray up` wrote it for another head: a file left from an earlier cluster
        say(f"{path} lists head {listed[0]}, which is not this cluster's head ({', '.join(sorted(head))}): a file "
            f"left from another cluster; its machines are not waited for")
        return []
    started = said = time.monotonic()
    first = True
    while True:
        alive, dead = _node_ips()
        lost = [ip for ip in listed if names[ip] & dead and not names[ip] & alive]
        joining = [ip for ip in listed if not names[ip] & alive and not names[ip] & dead]
        waited = time.monotonic() - started
        if not joining or waited >= wait_s:
            if lost or joining:
                up = len(listed) - len(lost) - len(joining)
                gone = ([f"{', '.join(joining)} never joined (in {wait_s:.0f} s)"] if joining else []) + \
                       ([f"{', '.join(lost)} joined and was lost"] if lost else [])
                say(f"{up} of the {len(listed)} machines listed in {path} are up: {'; '.join(gone)}. The sweep goes "
                    f"on with those up (on the machine you ran `ray up` from, `ray monitor cluster.yaml` shows why)")
            return joining + lost
        if first or time.monotonic() - said >= JOIN_SAY_EVERY_S:
            say(f"waiting up to {wait_s - waited:.0f} s more for {len(joining)} of the {len(listed)} machines listed "
                f"in {path}: {', '.join(joining)}")
            said, first = time.monotonic(), False
        time.sleep(poll_s)


def _read_marker(location: str) -> str | None:
    """On one node: what it reads at `location` (None where it has no such file)."""
    try:
        return storage.read_text(location)
    except Exception as e:  # noqa: BLE001 - a node that cannot reach the store at all says so, in the driver's line
        return f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def check_shared(storage_root: str, key: str = "storage_path", wait_s: float = SHARED_CHECK_S) -> None:
    """On a cluster of more than one node, every node must see `storage_root` as this driver does: each slot's rank 0
    writes its trials' checkpoints there, and a trial retried or resumed on another machine reads them there. The
    driver writes a file with a fresh token; a task pinned to each node reads it back. A node that reads nothing,
    or another token, is refused in one line naming the fix."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) < 2:
        return
    token = uuid.uuid4().hex
    marker = storage.join(storage_root, f"{MARKER}-{token[:8]}")
    try:
        storage.write_text(marker, token)
    except Exception as e:  # noqa: BLE001 - the driver's own store is refused with its cause
        raise UserError(f"{key} {storage_root}: cannot write there ({type(e).__name__}: {e})") from e
    try:
        read = ray.remote(num_cpus=0, max_retries=0)(_read_marker)
        refs = {n["NodeManagerAddress"] + f" ({n['NodeID'][:8]})":
                read.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(marker)
                for n in nodes}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
        seen = {name: (ray.get(ref) if ref in ready else f"no answer in {wait_s:.0f} s") for name, ref in refs.items()}
    finally:
        try:
            storage.delete(marker)
        except Exception:  # noqa: BLE001, S110 - a marker left behind is harmless (a new token every time)
            pass
    blind = {name: got for name, got in seen.items() if got != token}
    if blind:
        where = "this machine's own disk" if not storage.is_uri(storage_root) else "a store they cannot read"
        how = "; ".join(f"{name}: {'no such file' if got is None else got}" for name, got in sorted(blind.items()))
        raise UserError(
            f"{key} {storage_root} is {where}: {len(blind)} of the {len(seen)} nodes do not see the file this driver "
            f"wrote there ({how}). A sweep across machines needs storage every machine sees: an NFS folder mounted at "
            f"the same path on each, or s3://bucket/path")


def check_cluster(storage_root: str, say) -> None:
    """Both checks, in order (the machines first: the storage check reads on every node that has joined), then one
    line of what was found."""
    import ray

    missing = wait_for_listed(say)
    check_shared(storage_root)
    alive = len([n for n in ray.nodes() if n["Alive"]])
    listed = f"; {len(missing)} listed machine(s) not up" if missing else ""
    say(f"{alive} node{'s' if alive != 1 else ''} up{listed}; storage_path {storage_root} is seen by every node")
