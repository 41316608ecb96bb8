"""The broker: the sweep's slots and the trials on them, as a state machine with no Ray in it (tests drive it with a
stand-in for Ray Train's fit(); actors.BrokerActor runs it on Ray).

The rules the broker keeps:
- a trial ASHA stops (or that errors) is ended by the driver (`end`): its slot finishes the epoch it is in and
  takes the next trial;
- a worker that dies: Ray Train restarts the slot's group (FailureConfig), its new rank 0 asks again and gets the
  trial it was running, which resumes from its checkpoint; past `max_failures` restarts the trial fails with the
  workers' error (`group_error`, from a Ray Train callback in the slot's controller);
- a group whose set-up (everything before its rank 0's first ask) fails `scaling.max_setup_failures` times in a row
  ends its slot (its host is killed, with the controller that would restart it forever); the trial waiting for it
  fails (`infra`) with the workers' error, and while no slot of that shape has ever set up, every trial of the shape
  fails the same way at once: the sweep ends instead of restarting groups forever;
- a slot whose group cannot start (or restart), or whose host or controller is lost, ends; its trial fails as
  `infra` (failures.py) and its relay submits it again (`train.max_infra_retries`): it resumes from its checkpoint
  on another group;
- a trial whose scaling differs from every idle slot's gets a group of its own (an idle slot of another shape
  is retired to make room);
- the driver owns the broker and the broker owns the slots: a driver that dies takes them all with it, and
  `--resume` starts new ones.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from raysweep.failures import ERROR, INFRA, Failure, Kind
from raysweep.protocol import RETIRE, Polled, Retire, Task

log = logging.getLogger(__name__)

ASK_WAIT_S = 5.0  # one long poll (a slot asking for work, a trial waiting for reports) waits at most this long
DECISION_WAIT_S = 60.0  # the longest a slot waits for Tune's decision at a rung before it goes on anyway
CLOSE_WAIT_S = 60.0  # at the end of a sweep, how long retiring slots may take to leave before they are killed
# how long a caller asks a broker that is alive but does not answer (its loop held up: a stalled GCS call, a paused
# process) before it gives up: calls that may be repeated (a poll, a slot's ask for work) are asked again until then
BROKER_STALL_S = 300.0


def scaling_key(trial: dict) -> str:
    """What a worker group is built for: trials with the same key can share one (a TrialConfig dict's scaling)."""
    return json.dumps(trial["scaling"], sort_keys=True)


@dataclass
class Assignment:
    """One trial's run on a slot, as the broker tracks it."""

    seq: int  # the broker's number for it: a trial submitted again (a Tune retry) gets a new one
    trial_id: str
    trial: dict  # TrialConfig dict
    run_dir: str  # the trial's own folder (its checkpoints)
    key: str  # scaling_key(trial)
    max_failures: int  # worker-group restarts the trial may use
    decision_points: tuple[float, ...] = ()  # where Tune's scheduler may stop it (ASHA's rungs, max_t), in time_attr
    time_attr: str = "epoch"  # what the points count: epoch or train_seconds (a reported, monotonic metric)
    clock: float = 0.0  # time_attr's value in its last report
    acked: int = 0  # reports Tune has taken and let the trial go on after
    slot: int | None = None
    started: bool = False  # a slot's rank 0 has taken it
    restarts: int = 0
    group: str | None = None  # the worker group that last took it (a restart is a new group; an ask repeated is not)
    reports: list = field(default_factory=list)  # every epoch's metrics dict, in order
    timeline: dict = field(default_factory=dict)  # the start-up stamps of its first start (metrics.startup_phases)
    timeline_at: int = -1  # the report that came with them
    done: bool = False
    failure: Failure | None = None  # how it failed: agreed by its ranks, or the broker's
    cancelled: bool = False  # the driver ended the trial (ASHA, an error): stop at the next epoch's end
    last_error: str | None = None  # the workers' error behind the last restart of its group
    last_error_kind: Kind = ERROR  # its kind (actors.group_failure_kind): the trial's failure once restarts are spent


@dataclass
class Slot:
    slot_id: int
    key: str
    opened_at: float  # wall clock: when the broker asked Ray Train for its group
    max_setup_failures: int = 3  # set-ups that may fail in a row before the slot ends (scaling.max_setup_failures)
    current: Assignment | None = None
    retiring: bool = False  # its workers leave at their next ask
    trials_taken: int = 0
    set_up: bool = False  # its group (as last started) has asked for work: set-up done
    ever_set_up: bool = False
    setup_failures: int = 0  # set-ups failed in a row
    ended: str | None = None  # why the broker ended it (its fit() is cancelled: the host and controller killed)
    fit: asyncio.Future | None = None  # the launch (its fit()), cancelled to end the slot
    placement: object = None  # its group's Ray placement group, as rank 0 last reported it (removed when it ends)
    idle_since: float = field(default_factory=time.monotonic)  # when it last finished a trial (tune.keep_warm_s)


class Broker:
    """The sweep's slots and the trials on them; every method is called through Ray (an async actor), one at a
    time on its event loop. `launch(slot_id, trial)` builds and fits the slot's long-lived trainer and returns
    when its fit() ends (raising what fit() raised)."""

    def __init__(self, capacity: int, launch: Callable[[int, dict], Awaitable[None]], keep_warm_s: float | None = None):
        self.capacity, self.launch, self.keep_warm_s = capacity, launch, keep_warm_s
        self.broken: dict[str, str] = {}  # scaling key → why no group of that shape could be set up (its slot ended)
        self.queue: list[Assignment] = []  # submitted, not yet on a slot
        self.slots: dict[int, Slot] = {}
        self.trials: dict[str, Assignment] = {}  # trial id → its latest assignment
        self.changed = asyncio.Condition()
        self.seq = self.next_slot = 0
        self.stored: dict[str, int] = {}  # trial id → the last epoch the driver's MLflow writer holds
        self.busy_s = 0.0  # seconds the slots spent training and evaluating (every epoch's epoch_time_s)
        self.closing = False
        self.tasks: set = set()  # the slots' watchers (a task with no reference may be collected mid-run)

    # -- the trial side (relay.run_trial, in Tune's trial actor; the driver's callback)

    async def submit(self, trial_id: str, trial: dict, run_dir: str, max_failures: int,
                     decision_points: tuple[float, ...] = (), time_attr: str = "epoch") -> int:
        """Queue a trial for the next free slot of its shape; returns its assignment number. `decision_points`:
        where ASHA may stop it, in `time_attr` (`report`)."""
        old = self.trials.get(trial_id)
        if old is not None and not old.done:  # Tune runs the trial again (a retry): the old run stops
            self._cancel(old)
        self.seq += 1
        a = Assignment(self.seq, trial_id, trial, run_dir, scaling_key(trial), max_failures, tuple(decision_points),
                       time_attr)
        self.trials[trial_id] = a
        self.queue.append(a)
        await self._changed()
        return a.seq

    async def poll(self, trial_id: str, seq: int, since: int, wait_s: float = ASK_WAIT_S) -> Polled:
        """Reports after the first `since`, once there are some or the trial is done (or `wait_s` passed)."""
        def ready():
            a = self.trials.get(trial_id)
            return a is None or a.seq != seq or a.done or len(a.reports) > since

        await self._wait(ready, wait_s)
        a = self.trials.get(trial_id)
        if a is None or a.seq != seq:
            return Polled([], True, Failure(INFRA, "superseded by a newer run of the same trial"))
        return Polled(a.reports[since:], a.done, a.failure, a.timeline, a.timeline_at, a.restarts)

    async def end(self, trial_id: str) -> None:
        """The driver ended the trial (ASHA stopped it, or it errored): its slot stops after the current epoch."""
        a = self.trials.get(trial_id)
        if a is not None and not a.done:
            self._cancel(a)
            await self._changed()

    async def prewarm(self, trial: dict, count: int) -> None:
        """Start `count` groups for trials shaped like `trial` now, before any trial asks: they build while the
        driver opens MLflow and Tune starts its first trials."""
        key = scaling_key(trial)
        while count > 0 and len([s for s in self.slots.values() if not s.retiring]) < self.capacity:
            self._open(Assignment(0, "", trial, "", key, 0))
            count -= 1

    # -- the slot side (rank 0 of each slot's group; the controller's callback)

    async def next_assignment(self, slot_id: int, after: int | None, group: str | None = None) -> Task | Retire | None:
        """What the slot's group runs next: a Task, RETIRE (leave: fit() returns), or None (nothing yet: ask
        again). `after`: the last assignment this group took; None from a group that just
        started, which resumes the trial its slot was running when a worker died. `group`: the asking group's own
        token: the same group asking again (its first answer was slow to come) is not a restart (None: every
        ask with `after` None is a new group's)."""
        deadline = time.monotonic() + ASK_WAIT_S
        slot = self.slots.get(slot_id)
        if slot is not None and after is None:  # its group (as last started) got through its set-up
            slot.set_up = slot.ever_set_up = True
            slot.setup_failures = 0
        while True:
            slot = self.slots.get(slot_id)
            if slot is None or slot.retiring:
                return RETIRE
            a = slot.current
            if a is not None and not a.done:
                if a.cancelled:  # ended before (or while) this group held it: nothing to run
                    self._finish(a)
                    await self._changed()
                    continue
                if a.started and after is None and (group is None or group != a.group):  # a restarted group
                    a.restarts += 1  # the trial resumes on it, if it may
                    if a.restarts > a.max_failures:
                        self._finish(a, failure=Failure(a.last_error_kind, (
                            f"worker group restarted {a.restarts - 1} times (train.max_failures {a.max_failures}); "
                            f"last error: {a.last_error or 'unknown'}")))
                        await self._changed()
                        continue
                if after is None or a.seq > after:
                    first_on_slot = slot.trials_taken == 0
                    if not a.started:
                        slot.trials_taken += 1
                    a.started, a.group = True, group
                    return Task(a.seq, a.trial_id, a.trial, a.run_dir, slot.opened_at if first_on_slot else None)
            left = deadline - time.monotonic()
            if left <= 0:
                if self._idle_too_long(slot):  # tune.keep_warm_s: its resources go back to the cluster
                    slot.retiring = True
                    log.info("slot %d idle %.0f s with nothing queued: its group leaves", slot_id, self.keep_warm_s)
                    return RETIRE
                return None
            await self._wait_changed(left)

    async def report(self, seq: int, metrics: dict, timeline: dict | None = None, resent: bool = False) -> bool:
        """One epoch of an assignment (`timeline`: its start-up stamps, with its first epoch; `resent`: a restored
        checkpoint's report again, nothing trained); returns whether to go on (False: the trial was ended).

        At a report where ASHA decides (the first at or past one of the assignment's `decision_points`, a rung, in
        epochs or training seconds) the answer waits for Tune's decision (the trial's `ack`, or its end), so a cut
        trial stops here instead of training one more epoch while the next trial waits for its slot; between rungs
        ASHA never stops a trial and the slot goes on at once."""
        a = self._assignment(seq)
        if a is None or a.done:
            return False
        if timeline and not a.timeline:
            a.timeline, a.timeline_at = timeline, len(a.reports)
        a.reports.append(metrics)
        if not resent:
            self.busy_s += float(metrics.get("epoch_time_s", 0.0))
        await self._changed()
        before, a.clock = a.clock, float(metrics.get(a.time_attr, 0))
        if not resent and any(before < point <= a.clock for point in a.decision_points):
            count = len(a.reports)
            await self._wait(lambda: a.acked >= count or a.cancelled or a.done, DECISION_WAIT_S)
        return not a.cancelled

    async def recorded_through(self, seq: int, epoch: int, wait_s: float = DECISION_WAIT_S) -> bool:
        """Whether the store holds the assignment's trial through `epoch` (waiting for it): a checkpoint after
        `epoch` may be written only then. Otherwise a driver that stops (Ctrl-C, a kill) while the slot runs ahead
        would leave a checkpoint past epochs no tracker ever recorded, and the resumed trial, which re-sends only
        its checkpoint's own epoch, would leave a hole in its history. False: ended, or no answer in `wait_s`."""
        a = self._assignment(seq)
        if a is None:
            return False

        def held():
            return self.stored.get(a.trial_id, 0) >= epoch

        await self._wait(lambda: held() or a.cancelled or a.done, wait_s)
        if not held() and not a.cancelled and not a.done:  # a driver that no longer records, a store that stalled
            self._finish(a, failure=Failure(INFRA, f"MLflow recorded none of the trial's epochs after "
                                            f"{self.stored.get(a.trial_id, 0)} in {wait_s:.0f} s (mlflow.retry_s)"))
            await self._changed()
        return held() and not a.cancelled and not a.done

    async def recorded(self, trial_id: str, epoch: int) -> None:
        """The driver's MLflow writer holds the trial's epochs through `epoch` (callbacks.MLflowEvents)."""
        if epoch > self.stored.get(trial_id, 0):
            self.stored[trial_id] = epoch
            await self._changed()

    async def ack(self, trial_id: str, seq: int, count: int) -> None:
        """Tune took the trial's first `count` reports and let it go on."""
        a = self.trials.get(trial_id)
        if a is not None and a.seq == seq and count > a.acked:
            a.acked = count
            await self._changed()

    async def finish(self, seq: int, failure: Failure | None = None) -> None:
        """The slot's group is done with an assignment: it ran out of epochs, was ended, or failed as its ranks
        agreed (`failure`: an OOM past the downshifts, divergence)."""
        a = self._assignment(seq)
        if a is not None and not a.done:
            self._finish(a, failure)
            await self._changed()

    async def group_placement(self, slot_id: int, placement) -> None:
        """The placement group the slot's (re)started group runs in: when the slot ends, the broker removes it."""
        slot = self.slots.get(slot_id)
        if slot is not None:
            slot.placement = placement

    async def group_error(self, slot_id: int, text: str, kind: Kind = ERROR) -> None:
        """What the slot's workers raised (Ray Train's controller saw it; it restarts the group next). `kind`: oom
        where a rank ran out of memory, infra where a rank's process died without raising, else error
        (actors.group_failure_kind). Before the group's rank 0 asked for work it is a set-up failure: past
        the slot's `max_setup_failures` in a row, the slot ends."""
        slot = self.slots.get(slot_id)
        if slot is None or slot.ended:
            return
        if not slot.set_up:
            slot.setup_failures += 1
            if slot.setup_failures >= slot.max_setup_failures:
                first = text.strip().splitlines()[0] if text.strip() else "unknown error"  # the lowest rank's
                self._end_slot(slot, f"its worker group's set-up failed {slot.setup_failures} times in a row "
                                     f"(scaling.max_setup_failures {slot.max_setup_failures}): {first[:500]}")
                await self._changed()
            return
        slot.set_up = False  # the group restarts: its set-up begins again
        if slot.current is not None:
            slot.current.last_error, slot.current.last_error_kind = text, kind

    # -- the driver

    async def close(self, wait_s: float = CLOSE_WAIT_S) -> int:
        """Retire every slot and wait for their groups to leave; returns how many were still there."""
        self.closing = True
        for a in list(self.trials.values()):  # what runs stops at its next report; nothing queued starts
            if not a.done:
                self._cancel(a)
        for slot in self.slots.values():
            slot.retiring = True
        await self._changed()
        await self._wait(lambda: not self.slots, wait_s)
        return len(self.slots)

    async def watch(self) -> None:
        """Returns when the broker closes: the driver holds this call's result, which fails at once if the broker
        dies (broker_lost)."""
        while not self.closing:
            await self._wait_changed(60.0)

    async def state(self) -> dict:
        """For tests and the console: slots and their keys, trials and where they are."""
        return {"slots": {s.slot_id: {"key": s.key, "current": s.current.trial_id if s.current else None,
                                      "taken": s.trials_taken, "retiring": s.retiring} for s in self.slots.values()},
                "queued": [a.trial_id for a in self.queue], "busy_s": self.busy_s}

    # -- inside

    def _assignment(self, seq: int) -> Assignment | None:
        return next((a for a in self.trials.values() if a.seq == seq), None)

    def _cancel(self, a: Assignment) -> None:
        a.cancelled = True
        if not a.started:  # never reached a group: nothing to stop
            if a in self.queue:
                self.queue.remove(a)
            self._finish(a)

    def _finish(self, a: Assignment, failure: Failure | None = None) -> None:
        a.done, a.failure = True, failure
        slot = self.slots.get(a.slot) if a.slot is not None else None
        if slot is not None and slot.current is a:
            slot.current = None
            slot.idle_since = time.monotonic()

    def _idle_too_long(self, slot: Slot) -> bool:
        return (self.keep_warm_s is not None and slot.current is None and not self.queue and not self.closing
                and time.monotonic() - slot.idle_since >= self.keep_warm_s)

    def _end_slot(self, slot: Slot, reason: str) -> None:
        """End a slot now: its fit() is cancelled (the host and the controller that would restart it are killed)."""
        slot.ended, slot.retiring = reason, True
        if not slot.ever_set_up:
            self.broken[slot.key] = f"no worker group of this shape could be set up: {reason}"
        if slot.fit is not None:
            slot.fit.cancel()

    def _unplaceable(self, a: Assignment) -> str | None:
        """Why `a` can never run: its shape's set-up failed past the limit, and no slot of it ever set up."""
        if a.key in self.broken and not any(s.key == a.key and s.ever_set_up and not s.retiring
                                            for s in self.slots.values()):
            return self.broken[a.key]
        return None

    def _place(self) -> None:
        """Put queued trials on slots: an idle one of their shape, else a new one while there is room, else (at
        capacity) in place of an idle one of another shape."""
        for a in list(self.queue):
            if self.closing:
                return
            reason = self._unplaceable(a)
            if reason is not None:
                self.queue.remove(a)
                self._finish(a, failure=Failure(INFRA, reason))
                continue
            idle = [s for s in self.slots.values() if s.current is None and not s.retiring]
            live = [s for s in self.slots.values() if not s.retiring]
            slot = next((s for s in idle if s.key == a.key), None)
            if slot is None and len(live) >= self.capacity and idle:
                idle[0].retiring = True  # its group leaves at its next ask, and frees its resources for the new one
                live.remove(idle[0])
            if slot is None and len(live) < self.capacity:
                slot = self._open(a)
            if slot is None:
                continue  # every slot is busy: the next one to finish takes it
            self.queue.remove(a)
            a.slot, slot.current = slot.slot_id, a

    def _open(self, a: Assignment) -> Slot:
        """A new slot for trials shaped like `a` (its group is built from a's trial dict)."""
        slot = Slot(self.next_slot, a.key, time.time(), int(a.trial["scaling"].get("max_setup_failures", 3)))
        self.next_slot += 1
        self.slots[slot.slot_id] = slot
        task = asyncio.get_running_loop().create_task(self._run_slot(slot, a.trial))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return slot

    async def _run_slot(self, slot: Slot, trial: dict) -> None:
        error = None
        slot.fit = asyncio.ensure_future(self.launch(slot.slot_id, trial))
        try:
            await slot.fit
        except asyncio.CancelledError:
            if slot.ended is None:  # not this broker's doing: the broker itself is going
                raise
        except Exception as e:  # its group could not start (or restart), its host or controller was lost
            error = f"{type(e).__name__}: {e}"
        await self._release(slot)
        if slot.ended is not None:
            error = slot.ended
        if error and (slot.ended or not slot.retiring):
            log.warning("slot %d ended: %s", slot.slot_id, error.splitlines()[0])
        del self.slots[slot.slot_id]
        if slot.current is not None and not slot.current.done:
            if slot.ended is not None:
                failure = slot.ended
            else:
                failure = f"worker group lost: {error or 'its worker group ended'}"
                if slot.current.last_error:
                    failure += f"; the workers' last error: {slot.current.last_error}"
            self._finish(slot.current, failure=Failure(INFRA, failure))
        await self._changed()

    async def _release(self, slot: Slot) -> None:
        """What a slot that ended may have left holding resources (on Ray: its group's placement group)."""

    async def _changed(self) -> None:
        self._place()
        async with self.changed:
            self.changed.notify_all()

    async def _wait_changed(self, wait_s: float) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait(), wait_s)
            except asyncio.TimeoutError:
                pass

    async def _wait(self, ready, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            await self._wait_changed(left)
