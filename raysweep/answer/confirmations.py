"""Confirmations (`raysweep confirm`) as the answer reads them: the recipe run outside ASHA for its whole budget on
two seeds (metrics.ConfirmationRecord, as the store holds it). Only seeds that finished count; a confirmation with a
seed that failed, was stopped or is still running is partial, and the newest complete one is the one reported."""

from __future__ import annotations

import dataclasses
import math

from raysweep.answer.records import Answer
from raysweep.metrics import SweepRecord


def close(a: float | None, b: float, within: float = 0.1) -> bool:
    return a is not None and abs(a / b - 1) <= within


def with_confirmations(record: SweepRecord, answer: Answer, notes: list[str]) -> Answer:
    """The answer with the sweep's confirmations: `confirmed` is the newest complete one of this very recipe (same
    global batch and peak LR); a newer partial one, or one of another recipe only, is said."""
    r = answer.recipe
    runs = list(getattr(record, "confirmations", []) or [])
    mine = [c for c in runs if c.global_batch == r.global_batch and close(c.peak_lr, r.peak_lr, 1e-6)]
    complete = [c for c in mine if c.complete]
    confirmed = complete[-1] if complete else None
    if mine and mine[-1] is not confirmed:
        c = mine[-1]
        ended = ", ".join(f"seed {run.get('seed')} {run.get('status')}" for run in c.runs) or "no seed ran"
        notes.append(f"the newest confirmation of this recipe is partial ({ended}): it counts only its finished seeds"
                     + (", and the one reported is the newest complete one" if confirmed else
                        "; none is complete yet"))
    if runs and not mine and answer.ran:
        notes.append(f"{len(runs)} confirmation(s) of other recipes; none of this one yet")
    return dataclasses.replace(answer, confirmed=confirmed, confirmations=runs, notes=(*answer.notes, *notes))


def shortfall(measured: float | None, expected: float | None, mode: str) -> float | None:
    """How much worse a measured value is than another, as a fraction of the other (negative: better; `mode`:
    tune.mode); None where either is missing."""
    if measured is None or expected is None or not math.isfinite(measured) or expected == 0:
        return None
    return (measured - expected if mode == "min" else expected - measured) / abs(expected)


def miss(measured: float | None, expected: float | None, mode: str) -> float | None:
    """How far a measured value falls short of the expected one (0 where it is as good or better)."""
    short = shortfall(measured, expected, mode)
    return None if short is None else max(short, 0.0)
