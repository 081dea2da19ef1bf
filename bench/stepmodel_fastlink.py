"""What a fast link changes: the step-time model's table for docs/stepmodel.md.

GH200's device and memory (the ``gh200`` profile), with the host link (the same figure
both ways, no contention: ``Hardware.with_link``) and the host AdamW rate replaced by each
pair given, for llama2-7b at 4096 tokens on 1 GPU; every offload mode
and ZenFlow at ``--topk-ratio`` x ``--update-interval`` (default: the paper's 0.1 x 4).
Model predictions, not measurements.

    python bench/stepmodel_fastlink.py
    python bench/stepmodel_fastlink.py --topk-ratio 0.3 --update-interval 8
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import stepmodel as M  # noqa: E402
from zenflow_triton.profiles import load_profile  # noqa: E402

MODES = ("zero-offload", "zero-offload-dpu", "overlapped-offload", "zenflow")


def table(topk_ratio: float, update_interval: int, links=(32, 64, 450),
          rates=(7.2e9, 28.8e9), profile: str = "gh200", model: str = "llama2-7b") -> str:
    prof = load_profile(profile)
    base = M.Hardware.from_profile(prof)
    wl = M.Workload.from_preset(model)
    settings = {k: v for k, v in prof.settings.items() if k != "select_interval"}
    cfg = M.zenflow_config(settings, topk_ratio=topk_ratio, update_interval=update_interval)
    out = ["| link GB/s per direction | host G elements/s | zero-offload | dpu | overlapped | "
           "zenflow | zenflow vs zero-offload | vs dpu |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rate in rates:
        for link in links:
            hw = dataclasses.replace(base.with_link(link * 1e9),  # symmetric, uncontended
                                     host_adam_elements_per_s=rate)
            p = M.predict_all(hw, wl, config=cfg)
            z, d, o, f = (p[m].step_time_s for m in MODES)
            out.append(f"| {link} | {rate / 1e9:g} | {z:.3f} | {d:.3f} | {o:.3f} | {f:.3f} | "
                       f"{z / f:.2f}x | {d / f:.2f}x |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    args = ap.parse_args(argv)
    print(table(args.topk_ratio, args.update_interval))
    return 0


if __name__ == "__main__":
    sys.exit(main())
