"""raysweep: Ray Tune sweeps over Ray Train DDP trials for large-batch training, recorded in MLflow."""

__version__ = "0.1.0"
