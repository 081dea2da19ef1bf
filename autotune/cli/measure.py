"""``zenflow-tune measure``: the step model's speed inputs measured on this machine
(:mod:`autotune.measure`): the host AdamW rate and, with CUDA, the link each way, alone and
with the other direction busy; printed, and with ``--save-as`` written into a user profile
that starts from ``--profile`` (default: the detected card's built-in, or ``cpu``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .. import measure as ME
from . import EXIT_OK, UsageError


def cmd_measure(args: argparse.Namespace) -> int:
    if not args.seconds > 0:
        raise UsageError(f"--seconds must be > 0, got {args.seconds}")
    base = _base_profile(args.profile) if (args.save_as or args.profile) else None
    if args.save_as:
        from zenflow_triton.profiles import ProfileError, validate_name

        try:
            validate_name(args.save_as)
        except ProfileError as e:
            raise UsageError(f"--save-as: {e}") from None
    measured = ME.measure(args.seconds)
    if args.json:
        print(json.dumps(measured, indent=2))
    else:
        _print_report(measured, base)
    if args.save_as:
        _save(args, base, measured)
    return EXIT_OK


def _base_profile(spec: str | None) -> Any:
    """``--profile`` (a name or a path to a profile's JSON), else the built-in profile of the
    detected card (``cpu`` without one); a usage error names a bad one."""
    from zenflow_triton.profiles import ProfileError, load_profile, read_profile_file

    from ..detect import detect, matching_builtin

    if spec is None:
        info = detect()
        spec = matching_builtin(info)
        if spec is None:
            raise UsageError(f"no built-in profile matches this machine's accelerator "
                             f"({info['accelerators'][0]['name']}): give --profile NAME (or a "
                             "path to a profile's JSON) to start the saved profile from")
    try:
        if spec.endswith(".json") or os.path.sep in spec:
            return read_profile_file(spec)
        return load_profile(spec)
    except ProfileError as e:  # an unknown name lists the known ones
        raise UsageError(f"--profile {spec!r}: {e}") from None


def _print_report(m: dict[str, Any], base: Any) -> None:
    host, link = m["host"], m["link"]
    machine = m["machine"]["host"]
    accs = m["machine"]["accelerators"]
    print(f"Measured on this machine ({m['date']}): {machine['cpu']}, {host['cores']} usable "
          f"CPUs" + (f", {accs[0]['name']}" if accs else ""))
    print(f"host AdamW (HostAdamW, fp32, {host['numel']} elements per buffer): 1 core "
          f"{host['elements_per_s_per_core'] / 1e6:,.0f} M elements/s (median of "
          f"{host['repeats_per_core']}); all {host['cores']} cores "
          f"{host['elements_per_s_all_cores'] / 1e6:,.0f} M elements/s (median of "
          f"{host['repeats_all_cores']})")
    if not link["measured"]:
        print(f"link: {link['why']}; only the host rate was measured")
    else:
        print(f"link ({link['device']}, {link['bytes'] >> 20} MiB copies, GB = 1e9 B): host "
              f"to device {link['link_h2d_gb_s']:.1f} GB/s, device to host "
              f"{link['link_d2h_gb_s']:.1f} GB/s; host to device while device to host is "
              f"busy {link['link_h2d_while_d2h_gb_s']:.1f} GB/s, device to host while host "
              f"to device is busy {link['link_d2h_while_h2d_gb_s']:.1f} GB/s")
        for key in ("h2d_while_d2h", "d2h_while_h2d"):
            if not link[f"other_way_busy_throughout_{key}"]:
                print(f"  note: link_{key}_gb_s: the other direction's copy ended first in "
                      "some repeat, so that figure is partly uncontended")
    if base is not None:
        print(_assumed(base))


def _assumed(base: Any) -> str:
    """What the step model takes from ``base`` for the same inputs (to compare)."""
    from ..stepmodel import Hardware

    hw = Hardware.from_profile(base)
    rate, how = hw.host_rate_and_source(1)
    out = f"profile {base.name!r} assumes: host AdamW {rate / 1e6:,.0f} M elements/s ({how})"
    if hw.h2d and hw.d2h:
        out += f"; link {hw.link_summary()}"
    return out


def _save(args: argparse.Namespace, base: Any, measured: dict[str, Any]) -> None:
    from zenflow_triton.profiles import save_profile

    command = "zenflow-tune measure " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("seconds", args.seconds),
                                                     ("profile", args.profile),
                                                     ("save_as", args.save_as)) if v)
    prof = ME.measured_profile(base, args.save_as, measured, command)
    path = save_profile(prof)
    out = sys.stderr if args.json else sys.stdout
    what = "the host AdamW rate" + (" and the link" if measured["link"]["measured"] else "")
    print(f"wrote {path}: profile {args.save_as!r}, {base.name!r} with {what} measured here "
          "(provenance.inputs_measured says what, when and on what; the settings are those "
          f"of {base.name!r}). Use it: zenflow-tune predict --profile {args.save_as} --model "
          "MODEL", file=out)
