"""Shared fixtures: one local Ray cluster per session (2 CPUs, gloo), tiny specs and data in tmp_path."""

from __future__ import annotations

import os

# Ray reads these when first imported (before any test module imports it)
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
# S3 in the tests is moto's server on loopback (test_cluster.py), reached with dummy credentials. A developer's
# real AWS settings (keys, session token, profile, endpoint overrides, ~/.aws files) must reach no test process:
# every AWS_* variable is dropped and the dummies forced, here, before any Ray process starts, so that every one
# of them (Tune's, Train's) inherits exactly these (test_cluster.py checks it in a child pytest).
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # botocore and pyarrow's AWS SDK read ~/.aws/credentials and ~/.aws/config (profiles, endpoint_url) otherwise
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",  # never ask a cloud VM's metadata service for its role
}
for _key in [k for k in os.environ if k.startswith("AWS_")]:
    del os.environ[_key]
os.environ.update(AWS_TEST_ENV)
# Ray fixes its auth mode for the process when first imported: import it now, with the environment above, so
# that no test that changes RAY_AUTH_MODE (test_auth.py) decides it for the session's cluster. The GPU suite's
# machine has no Ray (tests/test_gpu.py needs none): there, nothing to fix.
try:
    import ray  # noqa: E402, F401
except ImportError:
    pass

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER_START_TIMEOUT_S = 15  # small, so the "cannot start" test waits 2 × 15 s, not minutes


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Synthetic sets are cached per test session, never in the user's cache."""
    os.environ["RAYSWEEP_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from raysweep.cluster import ray_init_kwargs

    ray.init(num_cpus=2, **ray_init_kwargs(worker_start_timeout_s=WORKER_START_TIMEOUT_S))
    yield ray
    ray.shutdown()


def tiny_spec(tmp_path: Path, **sections) -> dict:
    """A spec small enough for 2 CPU workers in seconds: 64×24 images, 192 train / 64 val."""
    spec = {
        "name": "t",
        "storage_path": str(tmp_path / "results"),
        "data": {"width": 64, "height": 24, "synthetic": {"train_size": 192, "val_size": 64, "seed": 0}},
        "scaling": {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1},
        "train": {"epochs": 3, "reference_batch_size": 64},
        "search": {"per_gpu_batch_size": 16, "base_lr": 2.0e-3, "warmup_epochs": 1, "weight_decay": 1.0e-4},
        "tune": {"num_samples": 1, "asha": {"grace_period": 1}},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def write_spec(tmp_path: Path, spec: dict | str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    return path
