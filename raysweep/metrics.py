"""Metric names: API (MLflow keys, Tune metrics, summary columns). Listed once, here."""

# Reported once per epoch by every trial, reduced across ranks (sums, or max for the *_max / memory ones).
EPOCH_METRICS = {
    "epoch": "epochs completed (1-based); ASHA's time attribute and the MLflow step",
    "samples_seen": "training samples consumed so far, all ranks",
    "train_loss": "mean multi-label soft-margin loss over the epoch's training samples",
    "val_loss": "mean loss on the validation split",
    "val_exact_acc": "share of validation captchas with every character right",
    "val_char_acc": "share of validation characters right",
    "lr": "learning rate after the epoch's last optimizer step",
    "grad_norm": "mean pre-clip global gradient norm over the epoch's optimizer steps",
    "grad_norm_max": "largest pre-clip global gradient norm in the epoch",
    "clip_fraction": "share of optimizer steps whose norm exceeded train.grad_clip",
    "epoch_time_s": "wall seconds of the epoch (train + validation), slowest rank",
    "samples_per_s": "global training throughput: samples ÷ slowest rank's training seconds",
    "peak_mem_allocated_gb": "CUDA allocator peak allocated in the epoch, max over ranks (0 on CPU)",
    "peak_mem_reserved_gb": "CUDA allocator peak reserved in the epoch, max over ranks (0 on CPU)",
    "rss_gb": "resident memory of the worker process at epoch end, max over ranks",
}
METRIC_NAMES = tuple(EPOCH_METRICS)
RANKABLE_METRICS = ("val_loss", "val_exact_acc", "val_char_acc", "train_loss")
