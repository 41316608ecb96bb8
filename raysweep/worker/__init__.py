"""Every DDP rank of a trial. Imports none of the driver's rooms (Tune, MLflow, console); only entry.py talks
to Ray, inside its functions, so the rest runs (and is tested) in a plain process.

    entry.py          the Ray Train entry point: start-up, the epoch loop, reports and checkpoints
    run.py            one rank's run: build, restore, fit in memory (OOM downshift), epoch, checkpoint state
    clock.py          rank 0's clock of a trial's training seconds, written off the epoch's path
    net.py            one rank's model: CNN, compile, DDP, optimizer, precision, scaler, compile time
    step.py           the training step (eager or a CUDA graph) and one epoch of it; the divergence watch
    evaluate.py       the validation pass
    reduce.py         the epoch's collectives and the metrics they make
    shard.py          data on the rank: the shard on the device, equal micro-batches, the model's input layout
    noise_meter.py    the gradient noise scale's measurements
    probe_step.py     the OOM probe step, agreed across ranks
    device.py         precision, compile and CUDA-graph choices per device; host memory tuning on CPU
    compile_cache.py  Inductor's caches shared by a sweep's trials; Dynamo's, sized for a slot's trials
    faults.py         agreed failures and the test-only fault switches
"""
