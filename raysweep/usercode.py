"""A user's model code on every node, the way Ray ships code: as `py_modules` of the runtime_env of the sweep's
actors and workers (docs/your-model.md, "How your code reaches the workers").

The driver uploads the factory's top-level package or module (models.code_to_ship: not installed, not raysweep's)
once, as Ray's own `ray.init(runtime_env={"py_modules": [...]})` would (ray/_private/runtime_env/py_modules.py,
`upload_py_modules_if_needed`), and hands the resulting `gcs://` URI to the actors it starts (the broker, the slot
hosts, their Ray Train workers, the probe's workers), which every node then downloads once and puts on the
workers' `sys.path`. Not the job's runtime_env: a driver that joins Ray after it was started (a notebook, the
tests' session cluster, `ray job submit`, whose job already has its runtime_env) could not add to it. A task's or
actor's runtime_env replaces the job's key by key (ray/runtime_env/runtime_env.py, `_merge_runtime_env`), so the
job's own `py_modules`, where it has some, are kept beside the factory's. Ray keeps an uploaded package while an
actor that names it lives (and 10 minutes after the upload: `pin_runtime_env_uri` in
ray/_private/runtime_env/packaging.py): the broker names it for the whole sweep.

Before any trial, one zero-CPU task on every node imports the factory there (`check_on_nodes`): a module that
imports on the driver and not on a node (a package installed only on the driver's machine) ends the sweep in one
line naming the module and the node.
"""

from __future__ import annotations

import logging

from raysweep.errors import UserError

log = logging.getLogger(__name__)

NODE_CHECK_S = 180.0  # the per-node import check: a new node downloads the package and starts a worker for it


def ship(paths: list[str]) -> dict:
    """The runtime_env part that carries `paths` (folders or .py files) to every worker: {"py_modules": [URIs]},
    the job's own py_modules first; {} when there is nothing to ship."""
    if not paths:
        return {}
    import ray
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.worker import global_worker

    uploaded = upload_py_modules_if_needed({"py_modules": list(paths)}, include_gitignore=True,
                                           scratch_dir=global_worker.node.get_runtime_env_dir_path(), logger=log)
    job = list((ray.get_runtime_context().runtime_env or {}).get("py_modules") or [])
    return {"py_modules": [*job, *(uri for uri in uploaded["py_modules"] if uri not in job)]}


def _import_factory(factory: str, address: str, node_id: str) -> str | None:
    """On one node: None when the factory imports there, else the one line saying why not."""
    from raysweep.config import ModelConfig
    from raysweep.models import ModelCodeError, resolve_on_worker

    try:
        resolve_on_worker(ModelConfig(factory=factory), address, node_id)
    except ModelCodeError as e:
        return str(e)
    return None


def check_on_nodes(factory: str, code: dict, wait_s: float = NODE_CHECK_S) -> None:
    """Import the factory on every live node, with the sweep's shipped code (`code`: `ship`'s runtime_env); one
    UserError line for the first node where it does not. A node that has not answered within `wait_s` is left to
    the ranks' own check at set-up (entry.start_rank), with a warning."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from raysweep.models import node_label

    task = ray.remote(num_cpus=0, max_retries=0)(_import_factory)
    refs = {}
    for node in (n for n in ray.nodes() if n["Alive"]):
        address, node_id = node["NodeManagerAddress"], node["NodeID"]
        refs[node_label(address, node_id)] = task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env=code or None).remote(factory, address, node_id)
    ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=wait_s)
    for name, ref in refs.items():
        if ref not in ready:
            log.warning("model.factory %r: node %s did not answer the import check in %.0f s; its ranks check at "
                        "set-up", factory, name, wait_s)
            continue
        try:
            problem = ray.get(ref)
        except Exception as e:  # the runtime_env could not be set up there (the package not downloadable)
            text = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
            problem = f"model.factory: {factory!r}: its code could not be set up on node {name}: {text}"
        if problem:
            raise UserError(problem)
    for ref in pending:
        ray.cancel(ref, force=True)


def ship_for(config) -> dict:
    """Once Ray runs: the spec's model code uploaded for the sweep's actors and workers, and imported on every node;
    the runtime_env part that names it ({} for the built-in CNN: raysweep is installed on every node). Call after
    models.check_spec_model (which imported the factory here)."""
    from raysweep.models import code_to_ship

    if config.model.builtin:
        return {}
    code = ship(code_to_ship(config.model))
    try:
        check_on_nodes(config.model.factory, code)
    except UserError as e:
        raise UserError(f"{config.source}: {e}") from None
    return code
