"""``zenflow-tune predict``'s options (the parser only: importing it needs no Optuna)."""

from __future__ import annotations

import argparse
from typing import Any

from . import HOST_MEMORY_HELP, LOSS_HELP, LOSSES, MEMORY_HELP, MODEL_HELP, PROFILE_HELP, _pos_int


def add_predict_parser(sub: Any) -> None:
    pr = sub.add_parser("predict", help="model one training step per mode on a hardware "
                                        "profile (a prediction, not a measurement)",
                        description="The step-time model (autotune/stepmodel.py, "
                                    "docs/stepmodel.md): step time, stall, link bytes, host "
                                    "busy and memory of adamw, zero-offload, zero-offload-dpu, "
                                    "overlapped-offload, state-swap and zenflow for a model "
                                    "on a profile's hardware facts.")
    pr.add_argument("--profile", required=True, help=PROFILE_HELP)
    pr.add_argument("--model", required=True, help=MODEL_HELP)
    pr.add_argument("--device-memory-gb", type=float, default=None, help=MEMORY_HELP)
    pr.add_argument("--host-memory-gb", type=float, default=None, help=HOST_MEMORY_HELP)
    pr.add_argument("--gpus", type=_pos_int, default=1, help="data-parallel GPUs (default 1)")
    pr.add_argument("--sharding", choices=("ddp", "fsdp2"), default="ddp",
                    help="ddp: every GPU holds the whole model (default); fsdp2: "
                         "fully_shard, every GPU holds 1/N of the params, gradients and "
                         "device state (memory is per GPU either way)")
    pr.add_argument("--tokens", type=_pos_int, default=None,
                    help="tokens per GPU per optimizer step: the batch, all micro-batches "
                         "of a step together (default 4096)")
    pr.add_argument("--micro-batch-tokens", type=_pos_int, default=None,
                    help="tokens per GPU of one forward and backward pass, what the device "
                         "holds activations for; --tokens / this many passes accumulate "
                         "into a step (default: for each mode the largest that fits, at "
                         "most 4096, halved down to 256)")
    pr.add_argument("--no-curve", action="store_true",
                    help="leave out ZenFlow's speed-up over its fastest peer at 4k, 16k, 64k "
                         "and 256k tokens per step")
    pr.add_argument("--mfu", type=float, default=None,
                    help="model FLOP utilisation in (0, 1] (default 0.4)")
    pr.add_argument("--no-recompute", action="store_true",
                    help="count the activations of a step without activation recompute "
                         "(default: full recompute, as a 7-8B fine-tune on one card runs)")
    pr.add_argument("--loss", choices=LOSSES, default="logits", help=LOSS_HELP)
    _add_predict_settings(pr)


def _add_predict_settings(pr: argparse.ArgumentParser) -> None:
    """``predict``'s ZenFlow settings (over the profile's), state-swap's share and output."""
    pr.add_argument("--topk-ratio", type=float, default=None,
                    help="ZenFlow topk_ratio (default: the profile's)")
    pr.add_argument("--update-interval", type=_pos_int, default=None,
                    help="ZenFlow update_interval (default: the profile's)")
    pr.add_argument("--stream-grads", action="store_true", default=None,
                    help="ZenFlow stream_grads: gradients leave the device during backward "
                         "(default: the profile's, else off)")
    pr.add_argument("--accumulate-on", choices=("device", "host"), default=None,
                    help="ZenFlow accumulate_on (default: the profile's, else device)")
    pr.add_argument("--accumulator-dtype", choices=("float32", "bfloat16"), default=None,
                    help="ZenFlow accumulator_dtype: the window sum's dtype (default: the "
                         "profile's, else float32)")
    pr.add_argument("--host-state-dtype", choices=("float32", "bfloat16"), default=None,
                    help="ZenFlow host_state_dtype: the host moments' dtype, bfloat16 halves "
                         "them (default: the profile's, else float32)")
    pr.add_argument("--select-interval", type=_pos_int, default=None,
                    help="ZenFlow select_interval, a multiple of the update interval "
                         "(default: the profile's, else 16 windows)")
    pr.add_argument("--apply-delay", type=_pos_int, default=None,
                    help="ZenFlow apply_delay: steps after a window at whose end its host "
                         "result is applied, 1 to the update interval (default: the "
                         "profile's, else the update interval)")
    pr.add_argument("--dense-params", nargs="*", default=None, metavar="PATTERN",
                    help="ZenFlow dense_params: name patterns of matrices kept whole on the "
                         "device (default: the profile's, else embeddings and the LM head); "
                         "given with no pattern, every matrix is split")
    pr.add_argument("--resident-fraction", type=float, default=None,
                    help="state-swap: the share of the Adam state kept on the device, in "
                         "[0, 1] (default: the most that fits; NeMo-RL's "
                         "optimizer_offload_fraction is 1 minus this)")
    pr.add_argument("--measure-host", action="store_true",
                    help="time this machine's host AdamW (~1 s) and use it as the host rate")
    pr.add_argument("--json", action="store_true", help="one JSON object, keyed by mode")
    pr.add_argument("--plot", metavar="PNG", help="also draw one window per mode (matplotlib)")
