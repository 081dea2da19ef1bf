"""The step-time model (autotune/stepmodel/) against published figures: DeepSpeed's ZenFlow
blog, and the state-swap measurements of NeMo-RL and DeepSpeed.

Llama-2-7B fine-tuning on 4x A100 (DeepSpeed ZenFlow blog): about 0.5 s per step with
everything on the GPUs, over 7 s with ZeRO-Offload, of which the CPU optimizer step alone
takes over 4 s and the GPUs idle over 60%; ZeRO-Offload moves about 2x the (bf16) model
size over PCIe per step, ZenFlow about 1.13x. Then state-swap (the Adam state streamed
through the GPU every step) against NeMo-RL PR #3628 and DeepSpeed PR #8186, as ratios to
the same setup without offload; then DeepSpeed ZeRO-3 offload of Llama-3.1-8B on one
RTX 4090 at three batch sizes (SlideFormer's published baseline). Prints the model's value and relative error for each, and
the assumptions (docs/stepmodel.md, "Calibration"). Pure arithmetic: a few seconds.

    python bench/stepmodel_calibration.py
    python bench/stepmodel_calibration.py --tokens 4096 --mfu 0.5   # other assumptions
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.stepmodel import CALIBRATION_ASSUMPTIONS, calibration_table  # noqa: E402
from autotune.stepmodel.report import (state_swap_calibration_table,  # noqa: E402
                                       zero_offload_calibration_table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, help="tokens per GPU per step "
                    f"(default {CALIBRATION_ASSUMPTIONS['tokens']})")
    ap.add_argument("--mfu", type=float, help=f"default {CALIBRATION_ASSUMPTIONS['mfu']}")
    ap.add_argument("--profile", help=f"default {CALIBRATION_ASSUMPTIONS['profile']}")
    args = ap.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    print(calibration_table(**overrides))
    print()
    print("Why these assumptions: " + CALIBRATION_ASSUMPTIONS["why"] + ".")
    print()
    print("State-swap (and ZeRO-Offload) against published measurements:")
    print()
    print(state_swap_calibration_table())
    print()
    print("ZeRO-3 offload on a 24 GB desktop card (published) against the model's ZeRO-Offload:")
    print()
    print(zero_offload_calibration_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
