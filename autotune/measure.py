"""The step model's speed inputs, measured on this machine (``zenflow-tune measure``).

The step-time model (docs/stepmodel.md) divides by a host AdamW rate and by the link's
bandwidth in each direction, alone and with the other direction busy. A profile states them
from datasheets and public measurements; this module measures them here:

* the host AdamW rate: the library's own ``HostAdamW`` on fp32 buffers of 2^24 elements
  (64 MiB each, past the CPU caches), on one worker (the rate per core) and on every usable
  CPU (the node's rate, the profile's ``host_adam_elements_per_s``): the same call as
  ``zenflow-tune predict --measure-host`` (:func:`autotune.detect.host_adam_times`);
* with CUDA, the host-device link: copies between pinned host memory and the device of
  :data:`LINK_BYTES` bytes, host to device and device to host alone, and each of them while
  a copy :data:`BUSY_FACTOR` times as large goes the other way on a second stream (started
  at the same event, so the timed copy has the other direction busy from start to end),
  timed with CUDA events; GB/s = 1e9 bytes/s.

Each figure is the median of several repeats after one warm-up; the repeats fill
``seconds`` (between :data:`MIN_REPEATS` and :data:`MAX_REPEATS`). Every wait has a
timeout. :func:`measured_profile` writes what was measured into a profile that starts from
another one (its settings and other facts kept), with a provenance block saying what was
measured, when and on what.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import statistics
from typing import Any, Callable, Sequence

import torch

from .detect import detect, host_adam_settings, host_adam_times, usable_cpus

HOST_NUMEL = 1 << 24
"""Elements of each host AdamW buffer (master, grad, m, v: 64 MiB each in fp32)."""
LINK_BYTES = 1 << 27
"""Bytes of each timed copy across the link (128 MiB: milliseconds on any PCIe link)."""
BUSY_FACTOR = 3
"""The other direction's copy, as a multiple of the timed one: it outlasts the timed copy
unless that direction is over 3x faster while both run."""
MIN_REPEATS, MAX_REPEATS = 3, 51
"""The fewest and the most timed repeats of one figure, whatever ``seconds`` says."""
WAIT_TIMEOUT_S = 60.0
"""The longest wait for one batch of copies (they take milliseconds)."""
DEFAULT_SECONDS = 8.0
"""``zenflow-tune measure``'s default time budget, shared among the figures."""
LINK_FIGURES = ("link_h2d_gb_s", "link_d2h_gb_s", "link_h2d_while_d2h_gb_s",
                "link_d2h_while_h2d_gb_s")
"""The profile fields the link measurement fills (as the step model reads them)."""
NO_GPU = ("not measured: measuring the host-device link needs a CUDA GPU, and "
          "torch.cuda.is_available() is False here")


# ---- arithmetic ------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    """The median of ``values`` (at least one, all finite and > 0: timings)."""
    vals = list(values)
    if not vals:
        raise ValueError("median of no values")
    if not all(v > 0 and v != float("inf") for v in vals):
        raise ValueError(f"timings must be finite and > 0, got {vals}")
    return statistics.median(vals)


def gb_per_s(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (1e9 bytes per second) of ``nbytes`` moved in ``seconds``."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return nbytes / seconds / 1e9


def repeats_for(budget_s: float, one_s: float) -> int:
    """How many repeats of a ``one_s``-second measurement fit ``budget_s`` seconds, within
    [:data:`MIN_REPEATS`, :data:`MAX_REPEATS`]."""
    fit = int(budget_s / one_s) if one_s > 0 else MAX_REPEATS
    return max(MIN_REPEATS, min(MAX_REPEATS, fit))


# ---- the host --------------------------------------------------------------------------------
def measure_host(seconds: float, numel: int = HOST_NUMEL) -> dict[str, Any]:
    """The host AdamW rate on one worker and on every usable CPU, each the median of the
    timed calls that fill half of ``seconds`` (:func:`autotune.detect.host_adam_times`)."""
    cores = usable_cpus()
    out: dict[str, Any] = {"numel": numel, "cores": cores}
    for key, threads in (("per_core", 1), ("all_cores", cores)):
        times = host_adam_times(numel, MAX_REPEATS, threads=threads, seconds=seconds / 2)
        out[f"elements_per_s_{key}"] = numel / median(times)
        out[f"repeats_{key}"] = len(times)
    out["measured_with"] = host_adam_settings(cores)
    out["method"] = (f"HostAdamW.update_many on fp32 master, grad, m, v of {numel} elements "
                     "each, 1 worker and then every usable CPU, one warm-up, median of the "
                     "timed calls")
    return out


# ---- the link (CUDA) -------------------------------------------------------------------------
def measure_link(seconds: float, nbytes: int = LINK_BYTES,
                 device: torch.device | None = None) -> dict[str, Any]:
    """The link's four figures (GB/s) on ``device`` (default: the current CUDA device), each
    the median of the repeats that fill a quarter of ``seconds``. Needs CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError(NO_GPU)
    device = device or torch.device("cuda", torch.cuda.current_device())
    big = nbytes * BUSY_FACTOR
    up_host = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    up_dev = torch.empty(big, dtype=torch.uint8, device=device)
    down_host = torch.empty(big, dtype=torch.uint8, pin_memory=True)
    down_dev = torch.empty(big, dtype=torch.uint8, device=device)
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))

    def h2d(n: int) -> Callable[[], None]:
        return lambda: up_dev[:n].copy_(up_host[:n], non_blocking=True)

    def d2h(n: int) -> Callable[[], None]:
        return lambda: down_host[:n].copy_(down_dev[:n], non_blocking=True)

    cases = {"link_h2d_gb_s": (h2d(nbytes), None), "link_d2h_gb_s": (d2h(nbytes), None),
             "link_h2d_while_d2h_gb_s": (h2d(nbytes), d2h(big)),
             "link_d2h_while_h2d_gb_s": (d2h(nbytes), h2d(big))}
    out: dict[str, Any] = {"measured": True, "bytes": nbytes,
                           "device": torch.cuda.get_device_name(device)}
    for key, (timed, busy) in cases.items():
        times, outlasted = _repeat(timed, busy, streams, seconds / len(cases))
        out[key] = gb_per_s(nbytes, median(times))
        out[f"repeats_{key[5:-5]}"] = len(times)
        if busy is not None:
            out[f"other_way_busy_throughout_{key[5:-5]}"] = outlasted
    out["method"] = (f"torch copies of {nbytes} bytes between pinned host memory and the "
                     f"device, timed with CUDA events; 'while' figures: a copy of "
                     f"{BUSY_FACTOR}x the bytes the other way on a second stream, started at "
                     "the same event; one warm-up, median of the repeats; GB = 1e9 bytes")
    return out


def _repeat(timed: Callable[[], None], busy: Callable[[], None] | None, streams: tuple,
            budget_s: float) -> tuple[list[float], bool]:
    """One warm-up, then the repeats that fit ``budget_s``: the timed copy's seconds, and
    whether the other direction's copy outlasted every timed one."""
    first, other = _copies(timed, busy, streams)
    times: list[float] = []
    outlasted = True
    # a repeat lasts as long as the longer copy (the busy one, where there is one)
    for _ in range(repeats_for(budget_s, max(first, other or 0.0))):
        t, other = _copies(timed, busy, streams)
        times.append(t)
        outlasted = outlasted and (other is None or other >= t)
    return times, outlasted


def _copies(timed: Callable[[], None], busy: Callable[[], None] | None,
            streams: tuple) -> tuple[float, float | None]:
    """Start ``timed`` on the first stream and ``busy`` (if any) on the second at one event;
    the seconds from that event to the end of each. Every wait has a timeout."""
    from zenflow_triton.transfer import wait_event

    first, second = streams
    start, end, end_busy = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    first.wait_stream(torch.cuda.current_stream(first.device))
    second.wait_stream(torch.cuda.current_stream(second.device))
    start.record(first)
    if busy is not None:  # queued first: the other way is busy before the timed copy starts
        second.wait_event(start)
        with torch.cuda.stream(second):
            busy()
        end_busy.record(second)
    with torch.cuda.stream(first):
        timed()
    end.record(first)
    wait_event(end, WAIT_TIMEOUT_S, "the timed link copy")
    if busy is None:
        return start.elapsed_time(end) / 1e3, None
    wait_event(end_busy, WAIT_TIMEOUT_S, "the other direction's link copy")
    return start.elapsed_time(end) / 1e3, start.elapsed_time(end_busy) / 1e3


# ---- everything, and the profile -------------------------------------------------------------
def measure(seconds: float = DEFAULT_SECONDS) -> dict[str, Any]:
    """Every input this machine can measure: the host AdamW rate (the whole budget without
    CUDA, half with it) and, with CUDA, the link; when, and the machine's facts."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    info = detect()
    has_gpu = torch.cuda.is_available()
    out: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": info["host"], "accelerators": info["accelerators"],
                    "matching_profile": info["matching_profile"]},
        "versions": info["versions"],
        "host": measure_host(seconds / 2 if has_gpu else seconds),
        "link": (measure_link(seconds / 2) if has_gpu else {"measured": False,
                                                              "why": NO_GPU}),
    }
    return out


def measured_profile(base: Any, name: str, measured: dict[str, Any], command: str) -> Any:
    """``base`` (a :class:`~zenflow_triton.profiles.Profile`) named ``name``, with the
    ``measured`` figures (from :func:`measure`) in its ``hardware`` and a
    ``provenance.inputs_measured`` block: what was measured, when, on what, by ``command``.
    The settings are ``base``'s, not re-tuned for the figures (the block says so)."""
    host, link = measured["host"], measured["link"]
    hw = dict(base.hardware)
    hw["host_adam_elements_per_s"] = host["elements_per_s_all_cores"]
    hw["host_adam_elements_per_s_per_core"] = host["elements_per_s_per_core"]
    hw["host_adam_measured_with"] = host["measured_with"]
    hw["host_cores"] = host["cores"]
    fields = ["host_adam_elements_per_s", "host_adam_elements_per_s_per_core", "host_cores"]
    accelerators = measured["machine"]["accelerators"]
    if link["measured"]:
        for key in LINK_FIGURES:
            hw[key] = link[key]
        hw["link_measurements"] = [
            {"field": key, "value": link[key], "what": f"measured on this machine "
             f"({link['device']}) by zenflow-tune measure, {measured['date']}",
             "sources": [{"title": "this machine", "method": link["method"]}]}
            for key in LINK_FIGURES]
        fields += list(LINK_FIGURES)
        hw["accelerators_per_node"] = len(accelerators)
    block = {
        "date": measured["date"],
        "command": command,
        "base_profile": base.name,
        "measured": fields,
        "machine": measured["machine"],
        "versions": measured["versions"],
        "host": host,
        "link": link,
        "settings": (f"{base.name}'s, not re-tuned for these figures (zenflow-tune run "
                     f"--objective modelled --profile {name} re-tunes them)"),
    }
    if accelerators and link["measured"]:
        block["detected"] = {"accelerators_per_node": len(accelerators)}
    provenance = dict(base.provenance, inputs_measured=block)
    description = (f"{(base.description or base.name).rstrip('.')}; host AdamW rate"
                   + (" and link" if link["measured"] else "")
                   + f" measured on this machine {measured['date'][:10]}")
    return dataclasses.replace(base, name=name, hardware=hw, provenance=provenance,
                               description=description, path=None, source="memory")
