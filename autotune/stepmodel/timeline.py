"""The timeline every mode is laid out on: four FIFO lanes (device, link down, link up,
host), the scheduler that runs a mode's window after window until the schedule repeats,
the last window's segments and each lane's busy time, and the prediction that one mode's
steady-state window gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from .inputs import LANES


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
    waiting for an event)."""

    def __init__(self) -> None:
        self.free = {lane: 0.0 for lane in LANES}
        self.segments: list[Segment] = []
        self.marks: dict[Any, float] = {}  # the builder's own event times (its state)
        self.cycle = 1

    def relative_state(self, t0: float) -> tuple[float, ...]:
        """Every time that can still delay a later task, relative to ``t0`` (earlier ones
        cannot: every later task starts after a device event at or after ``t0``)."""
        times = [self.free[lane] for lane in LANES] + [self.marks[k] for k in sorted(
            self.marks, key=repr)]
        return tuple(max(0.0, t - t0) for t in times)

    def run(self, lane: str, duration: float, label: str, after: Iterable[float] = ()) -> float:
        start = max(self.free[lane], *after) if after else self.free[lane]
        end = start + duration
        if duration > 0:
            self.segments.append(Segment(lane, start, end, label))
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
    modelled_step_time_s: float
    window_steps: int
    window_time_s: float
    timeline: list[Segment]
    memory: dict[str, dict[str, float]]
    settings: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

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
        }
        if self.settings is not None:
            out["settings"] = dict(self.settings)
        return out


# ---- running windows until they repeat ----------------------------------------------------
_MAX_WINDOWS = 5000


def run_windows(body, K: int, lanes: Lanes | None = None) -> tuple[Lanes, list[float]]:
    """Call ``body(lanes, w, i)`` (which schedules step ``i`` of window ``w`` and returns
    the start of its first forward) window after window until the schedule repeats: the
    state at the end of a window (every lane's free time and every time the builder keeps
    in ``lanes.marks``, relative to the window's start) equals the state ``c`` windows
    earlier, so every later window repeats those ``c``. Returns the lanes (``lanes.cycle``
    = c) and the start of every window, the last one being the window after the cycle."""
    lanes = lanes or Lanes()
    starts: list[float] = []
    states: list[tuple[float, ...]] = []
    for w in range(_MAX_WINDOWS):
        for i in range(K):
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
    starts.append(body(lanes, len(starts), 0))
    return lanes, starts


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
