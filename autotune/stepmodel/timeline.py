"""The timeline every mode is laid out on: four FIFO lanes (device, link down, link up,
host), the scheduler that runs a mode's window after window until the schedule repeats,
the link's contention (a transfer slows while the other direction is busy, where the
profile says so), the last window's segments and each lane's busy time, and the prediction
that one mode's steady-state window gives."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .inputs import LANES

LINK_LANES = {"link-up": "link-down", "link-down": "link-up"}
"""Each link lane and the other direction's, whose busy time slows it (docs/stepmodel.md,
"The link, per direction")."""
CONTENTION_PASSES = 40
"""At most this many reschedules to settle the contended transfers' times."""
CONTENTION_TOL = 1e-9
"""Settled: a reschedule moved the steady window and each link lane's busy time in it by
less than this share of the window."""


@dataclass(frozen=True)
class Segment:
    lane: str
    start: float
    end: float
    label: str

    @property
    def duration(self) -> float:
        return self.end - self.start


class Lanes:
    """Four FIFO lanes. ``run`` starts a task when its lane is free and everything in
    ``after`` has ended; a zero-length task still moves its lane to that time (a stream
    waiting for an event).

    A transfer (a task on a link lane) is named by its lane, the step of the window that
    issued it and its rank among that step's transfers on the lane; ``slowdown`` stretches
    a named transfer (its time at the uncontended figure times the factor, for the share of
    it the other direction is busy: :func:`run_windows`)."""

    def __init__(self, slowdown: Mapping[tuple, float] | None = None) -> None:
        self.free = {lane: 0.0 for lane in LANES}
        self.segments: list[Segment] = []
        self.marks: dict[Any, float] = {}  # the builder's own event times (its state)
        self.cycle = 1
        self.slowdown = dict(slowdown or {})
        self.transfers: list[tuple[int, tuple, float, float]] = []  # (window, name, start, end)
        self._window, self._step, self._rank = 0, 0, {}

    def begin_step(self, w: int, i: int) -> None:
        """Step ``i`` of window ``w`` is being scheduled (names its transfers)."""
        self._window, self._step, self._rank = w, i, {}

    def relative_state(self, t0: float) -> tuple[float, ...]:
        """Every time that can still delay a later task, relative to ``t0`` (earlier ones
        cannot: every later task starts after a device event at or after ``t0``)."""
        times = [self.free[lane] for lane in LANES] + [self.marks[k] for k in sorted(
            self.marks, key=repr)]
        return tuple(max(0.0, t - t0) for t in times)

    def run(self, lane: str, duration: float, label: str, after: Iterable[float] = ()) -> float:
        start = max(self.free[lane], *after) if after else self.free[lane]
        name = None
        if lane in LINK_LANES:
            rank = self._rank.get(lane, 0)
            self._rank[lane] = rank + 1
            name = (lane, self._step, rank)
            if name in self.slowdown:
                duration *= self.slowdown[name]
        end = start + duration
        if duration > 0:
            self.segments.append(Segment(lane, start, end, label))
            if name is not None:
                self.transfers.append((self._window, name, start, end))
        self.free[lane] = end
        return end


@dataclass
class Prediction:
    """One mode's steady-state window. Times in seconds, bytes per GPU. ``step_time_s`` etc.
    are ``None`` when the mode does not fit in device memory (``fits`` False);
    ``modelled_step_time_s`` is then what it would take with memory to spare."""

    mode: str
    step_time_s: float | None
    stall_fraction: float | None
    link_bytes_per_step: float
    link_down_bytes_per_step: float
    link_up_bytes_per_step: float
    host_busy_fraction: float | None
    device_memory_bytes: int
    host_memory_bytes: int
    fits: bool
    modelled_step_time_s: float | None    # None: the mode cannot run this workload at all
    window_steps: int
    window_time_s: float
    timeline: list[Segment]
    memory: dict[str, dict[str, float]]
    settings: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    micro_batch_tokens: int | None = None  # tokens of one forward and backward pass
    micro_batches: int = 1                 # passes per optimizer step

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of ``zenflow-tune predict --json``."""
        out: dict[str, Any] = {
            "step_time_s": self.step_time_s,
            "stall_fraction": self.stall_fraction,
            "link_bytes_per_step": int(round(self.link_bytes_per_step)),
            "host_busy_fraction": self.host_busy_fraction,
            "device_memory_bytes": self.device_memory_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "fits": self.fits,
            "micro_batch_tokens": self.micro_batch_tokens,
            "micro_batches": self.micro_batches,
        }
        if self.settings is not None:
            out["settings"] = dict(self.settings)
        return out


# ---- running windows until they repeat ----------------------------------------------------
_MAX_WINDOWS = 5000


def run_windows(body, K: int,
                contention: Mapping[str, float] | None = None) -> tuple[Lanes, list[float]]:
    """Schedule ``body`` window after window until it repeats (:func:`schedule`), with the
    link's ``contention`` (per link lane, the share of its rate a transfer keeps while the
    other direction is busy, :meth:`~.inputs.Hardware.link_contention`; None or all 1: no
    contention, one schedule).

    With contention, a transfer's time depends on how much of it the other direction is
    busy, which depends on every transfer's time: the first schedule uses the uncontended
    figures; each next one stretches every transfer of the steady window by
    ``1 / (1 - s (1 - r))``, ``s`` the share of it (in the last schedule) during which the
    other lane is busy and ``r`` its lane's share (:func:`contended_slowdown`; a stretch that
    would turn back takes the mean with its last value, which damps the see-saw of a stretch
    that moves the overlap it comes from: :func:`_damped`); until a reschedule moves the
    steady window and the link lanes' busy time in it by less than :data:`CONTENTION_TOL` of
    the window, or for :data:`CONTENTION_PASSES` reschedules (the last is kept). Where the
    two directions never overlap, the first schedule stands."""
    lanes, starts = schedule(body, K)
    if not contention or all(r >= 1.0 for r in contention.values()):
        return lanes, starts
    slowdown: dict[tuple, float] = {}
    moved: dict[tuple, float] = {}
    last = _outcome(lanes, starts)
    for _ in range(CONTENTION_PASSES):
        new = _damped(contended_slowdown(lanes, starts, contention), slowdown, moved)
        if not new and not slowdown:
            break  # the directions never overlap: the first schedule stands
        moved = {k: new.get(k, 1.0) - slowdown.get(k, 1.0) for k in set(new) | set(slowdown)}
        slowdown = new
        lanes, starts = schedule(body, K, slowdown)
        now = _outcome(lanes, starts)
        if all(abs(a - b) <= CONTENTION_TOL * now[0] for a, b in zip(now, last)):
            break
        last = now
    return lanes, starts


def _outcome(lanes: Lanes, starts: list[float]) -> tuple[float, float, float]:
    """What a reschedule may change: the steady window and the link lanes' busy time in it."""
    window, _, busy = steady_window(lanes, starts)
    return window, busy["link-up"], busy["link-down"]


def _damped(new: Mapping[tuple, float], last: Mapping[tuple, float],
            moved: Mapping[tuple, float]) -> dict[tuple, float]:
    """The next stretches: each one's new value, or the mean of it and its last value where
    it would turn back (it moved the other way in the last pass: a see-saw)."""
    out = {}
    for k in set(new) | set(last):
        a, b = last.get(k, 1.0), new.get(k, 1.0)
        out[k] = (a + b) / 2 if (b - a) * moved.get(k, 0.0) < 0 else b
    return out


def schedule(body, K: int,
             slowdown: Mapping[tuple, float] | None = None) -> tuple[Lanes, list[float]]:
    """Call ``body(lanes, w, i)`` (which schedules step ``i`` of window ``w`` and returns
    the start of its first forward) window after window until the schedule repeats: the
    state at the end of a window (every lane's free time and every time the builder keeps
    in ``lanes.marks``, relative to the window's start) equals the state ``c`` windows
    earlier, so every later window repeats those ``c``. Returns the lanes (``lanes.cycle``
    = c) and the start of every window, the last one being the window after the cycle.
    ``slowdown``: the named transfers' stretch (:class:`Lanes`)."""
    lanes = Lanes(slowdown)
    starts: list[float] = []
    states: list[tuple[float, ...]] = []
    for w in range(_MAX_WINDOWS):
        for i in range(K):
            lanes.begin_step(w, i)
            t = body(lanes, w, i)
            if i == 0:
                starts.append(t)
        states.append(lanes.relative_state(starts[-1]))
        c = _cycle(states)
        if c:
            lanes.cycle = c
            break
    else:  # pragma: no cover - never seen; the mean of the last windows is then reported
        lanes.cycle = 8
    lanes.begin_step(len(starts), 0)
    starts.append(body(lanes, len(starts), 0))
    return lanes, starts


def contended_slowdown(lanes: Lanes, starts: list[float],
                       contention: Mapping[str, float]) -> dict[tuple, float]:
    """Each transfer's stretch for the next schedule: ``1 / (1 - s (1 - r))``, ``r`` its
    lane's ``contention`` and ``s`` the share of its time (in ``lanes``' schedule) during
    which the other link lane is busy, averaged over the windows of the repeating cycle
    (a transfer is named by lane, step and rank: :class:`Lanes`). The other lane's busy
    time is the cycle's transfers repeated at the cycle's period (the steady state, also
    where the schedule stopped: the transfers of the windows after it). A transfer the
    other direction never overlaps is not named (its stretch is 1)."""
    last = len(starts) - 1               # the window after the cycle: only its first step
    cycle = range(last - lanes.cycle, last)
    period = starts[last] - starts[last - lanes.cycle]
    steady = [(name, s, e) for w, name, s, e in lanes.transfers if w in cycle]
    busy = {lane: _merged([(s + k * period, e + k * period) for name, s, e in steady
                           if name[0] == lane for k in _REPEATS])
            for lane in LINK_LANES}
    shares: dict[tuple, list[float]] = {}
    for name, s, e in steady:
        shares.setdefault(name, []).append(_overlap(busy[LINK_LANES[name[0]]], s, e)
                                           / (e - s))
    out = {}
    for name, got in shares.items():
        share = sum(got) / len(got)
        if share > 0 and contention[name[0]] < 1.0:
            out[name] = 1.0 / (1.0 - share * (1.0 - contention[name[0]]))
    return out


_REPEATS = (-2, -1, 0, 1, 2)
"""The periods the cycle's transfers are repeated at around it (a transfer can run up to a
period past the windows that issued it)."""


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` sorted, the overlapping ones joined (repeats can touch by rounding)."""
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _overlap(intervals: list[tuple[float, float]], s: float, e: float) -> float:
    """Time within [s, e] covered by ``intervals`` (sorted and disjoint: :func:`_merged`)."""
    i = max(0, bisect.bisect_right(intervals, (s, s)) - 1)
    total = 0.0
    while i < len(intervals) and intervals[i][0] < e:
        lo, hi = max(intervals[i][0], s), min(intervals[i][1], e)
        if hi > lo:
            total += hi - lo
        i += 1
    return total


def _cycle(states: list[tuple[float, ...]], tol: float = 1e-9) -> int:
    """The period c (in windows) once the last state equals the one c windows before."""
    last = states[-1]
    scale = max(max(last, default=0.0), 1e-30)
    for c in (1, 2, 3, 4):
        if len(states) > c and all(abs(a - b) <= tol * scale
                                   for a, b in zip(last, states[-1 - c])):
            return c
    return 0


def steady_window(lanes: Lanes, starts: list[float]) -> tuple[float, list[Segment], dict]:
    """The last window's segments (clipped, relative to its start), the mean window length
    over the repeating cycle, and each lane's busy time per window over that cycle."""
    c = lanes.cycle
    t0, t1 = starts[-2], starts[-1]
    lo_c, hi_c = starts[-1 - c], starts[-1]
    segs = [Segment(s.lane, max(s.start, t0) - t0, min(s.end, t1) - t0, s.label)
            for s in lanes.segments if s.end > t0 and s.start < t1]
    busy = {lane: 0.0 for lane in LANES}
    for s in lanes.segments:
        lo, hi = max(s.start, lo_c), min(s.end, hi_c)
        if hi > lo:
            busy[s.lane] += (hi - lo) / c
    return (hi_c - lo_c) / c, segs, busy
