"""Warm worker groups: one long-lived Ray Train `TorchTrainer` per concurrency slot, running the trials Tune hands it.

Ray Train builds a worker group from nothing for every `fit()`: placement group, worker processes, imports, the
process group (NCCL/gloo), the data on each device: 10-35 s before the first step, for epochs of a second or two.
A sweep's trials all want the same group (the spec's `scaling`), so a slot's group lives for the whole sweep:

    Tune trial (relay.run_trial)  ── submit ──▶  Broker (broker.py, one async actor per sweep)
        relays every epoch's report     ◀── report ──  slot's rank 0 (worker/entry.slot_worker)
        to Tune (ASHA decides)                         takes the next assignment, runs it, takes the next

Each trial stays a Tune trial: its own search point, ASHA decisions, MLflow child run, checkpoints in its own
folder (`<storage>/<name>/train/trial-<id>`) and its own restart budget (`train.max_failures`). What the slot
keeps across trials is its processes, their CUDA context and process group, the data on each device, the compile
caches in memory and cuDNN's autotuning; a trial builds only what is its own (model, optimizer, restore).

The rules the broker keeps between trials and slots are in broker.py. The package, one job a module:

    broker.py      the state machine: trials, slots, assignments and their rules (no Ray: tested as it is)
    actors.py      the broker and slot-host Ray actors, what a slot's trainer is built from (SlotPlan), and the
                   callback that hands the broker what a group's workers raised
    lifecycle.py   what the sweep's driver calls: open_broker, broker_lost, active, recorded, close_broker
    resources.py   what a worker group holds, and waiting until the cluster has it free
"""

from __future__ import annotations

from raysweep.slots.actors import SlotPlan
from raysweep.slots.broker import ASK_WAIT_S, Broker
from raysweep.slots.lifecycle import active, broker_lost, close_broker, open_broker, recorded

__all__ = ["ASK_WAIT_S", "Broker", "SlotPlan", "active", "broker_lost", "close_broker", "open_broker", "recorded"]
