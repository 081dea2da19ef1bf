"""What a modelled run returns: every point with its modelled step (:class:`ModelledRow`),
the pick and the peers beside it (:class:`ModelledOutcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zenflow_triton.profiles import Profile

from .. import stepmodel as M
from .grid import QualityPoint, QualityStore

PEER_MODES = tuple(m for m in M.MODES if m != "zenflow")
"""The modes a pick is printed beside (AdamW, ZeRO-Offload and its variants, state-swap)."""
PEER_SOFTWARE = {
    "adamw": "torch.optim.AdamW on the GPU, nothing offloaded",
    "zero-offload": ("DeepSpeed ZeRO-2 with offload_optimizer to the CPU, or this library "
                     "with topk_ratio=0, update_interval=1, overlap=False"),
    "zero-offload-dpu": ("ZeRO-Offload with its one-step delayed parameter update (the "
                         "ZeRO-Offload paper's DPU)"),
    "overlapped-offload": ("an exact AdamW stepped per layer inside backward with its state "
                           "on the host, such as torchao's CPUOffloadOptimizer with "
                           "offload_gradients=True (no gradient accumulation)"),
    "state-swap": ("the Adam state kept on the host and streamed through the GPU every step: "
                   "Megatron-LM's optimizer-state offload, NeMo-RL's "
                   "optimizer_offload_fraction"),
}
"""What a user runs for each peer mode the tuner may name instead of ZenFlow
(docs/stepmodel.md, "The modes")."""

SPEED_TOLERANCE = 0.03
"""Among the eligible settings within this share of the fastest's throughput, the tuner
takes the shortest window, then the largest ``topk_ratio`` (:func:`~.rank.quality_first`): where
speed is free, the fresher setting trains closer to AdamW."""


# ---- speed from the model, and the choice ---------------------------------------------------
@dataclass
class ModelledRow:
    point: QualityPoint
    prediction: M.Prediction
    settings: dict[str, Any]
    """The full profile settings the model was run with (base settings + the point)."""
    throughput: float = 0.0
    """Modelled tokens per second per GPU."""
    eligible: bool = False
    """Feasible by the quality guard and fits in device memory."""

    @property
    def fits(self) -> bool:
        return self.prediction.fits

    @property
    def step_time_s(self) -> float:
        return self.prediction.modelled_step_time_s


@dataclass
class ModelledOutcome:
    store: QualityStore
    hardware_profile: Profile
    hardware: M.Hardware
    workload: M.Workload
    gpus: int
    rows: list[ModelledRow]
    best: ModelledRow | None
    zero_offload: M.Prediction
    sharding: str = "ddp"
    peers: dict[str, M.Prediction] = field(default_factory=dict)
    """The peer modes' predictions (:data:`PEER_MODES`) at the profile's base settings."""
    profile: Profile | None = None
    profile_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def eligible(self) -> list[ModelledRow]:
        return [r for r in self.rows if r.eligible]
