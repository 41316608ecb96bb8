"""What crosses between a slot's rank 0, the sweep's broker and a trial's relay, typed (Ray pickles them between
processes): the broker's answers. The calls themselves are slots.Broker's methods; a failure is failures.Failure.

No Ray and nothing heavy: the rank (worker/entry.py), the broker and the relay all import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from raysweep.failures import Failure


@dataclass(frozen=True)
class Task:
    """next_assignment's answer when there is a trial to run: what the slot's group trains next."""

    seq: int  # the assignment's number (report, recorded_through and finish name it)
    trial_id: str
    trial: dict  # TrialConfig dict
    run_dir: str  # the trial's own folder (layout.trial_dir): its checkpoints and clock
    slot_opened_at: float | None = None  # the group was built for this trial: when its slot asked for it


@dataclass(frozen=True)
class Retire:
    """next_assignment's answer to a group that leaves (its fit() returns)."""


RETIRE = Retire()


@dataclass(frozen=True)
class Polled:
    """poll's answer to a trial's relay: its reports after `since`, and whether (and how) it ended."""

    reports: list  # the epochs' metrics dicts
    done: bool
    failure: Failure | None = None
    timeline: dict = field(default_factory=dict)  # its start-up stamps (metrics.startup_phases)
    timeline_at: int = -1  # the report they came with
    restarts: int = 0
