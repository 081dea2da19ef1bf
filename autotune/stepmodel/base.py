"""Shared by every part of the step-time model: the mode and lane names, the model's
constants (each written down in docs/stepmodel.md, "Constants") and the error it raises on
bad input. Nothing here imports another part of the model."""

from __future__ import annotations

MODES = ("adamw", "zero-offload", "zero-offload-dpu", "overlapped-offload", "zenflow")
SHARDINGS = ("ddp", "fsdp2")
"""How params are laid out over the GPUs: ``ddp`` (each GPU holds the whole model; the
offloaded rows and ``adamw``'s state sharded 1/N) or ``fsdp2`` (``fully_shard``: params,
gradients and every optimizer state sharded 1/N by rows)."""
LANES = ("device", "link-down", "link-up", "host")


# ---- constants (docs/stepmodel.md, "Constants") --------------------------------------------
DEFAULT_MFU = 0.40
"""Model FLOP utilisation (PaLM's definition: model FLOPs, no recomputation, over peak)."""
DEFAULT_TOKENS = 4096
"""Tokens per GPU per optimizer step (e.g. 2 sequences of 2048)."""
DEFAULT_SEQ_LEN = 2048
"""Sequence length of the presets (for the attention FLOPs); capped at the tokens."""
DEFAULT_HOST_CORES_PER_ACCELERATOR = 16
"""Host cores per accelerator when a profile does not say (a 2-socket host of 128 cores for
8 GPUs, as in NVIDIA's DGX A100; 112 for 8 in the DGX H100)."""
DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE = 1.0e8
"""Host AdamW elements/s per core when a profile has no measured figure: host AdamW is memory
bound (28 B per element), and current 2-socket servers sustain about 2.5-4 GB/s of memory
bandwidth per core when every core streams (e.g. 16 channels of DDR4-3200, 409.6 GB/s peak,
~75% sustained, over 128 cores = 2.4 GB/s), i.e. 0.9-1.4e8 elements/s per core."""
DEFAULT_ACCELERATORS_PER_NODE = 8
"""Accelerators sharing one host when a profile does not say (an HGX/DGX node)."""
HOST_MEMORY_EFFICIENCY = 0.8
"""Sustained fraction of a host's peak memory bandwidth (STREAM-like), used only to cap the
default host AdamW rate of a profile that states its host memory bandwidth."""
HOST_ADAM_BYTES_PER_ELEMENT = 28
"""fp32 AdamW on the host: reads master, grad, m, v and writes master, m, v (docs/host.md)."""
DEVICE_ADAMW_BYTES_PER_ELEMENT = 28
"""Fused mixed-precision AdamW on the device per element: bf16 grad read (2), fp32 master,
m and v read and written (24), bf16 param written (2); an fp32 param is its own master (28)."""
INDEX_BYTES = 8
"""int64 column indices (device_idx / host_idx) of a split matrix."""
SCRATCH_BYTES_PER_THREAD = 2 * 1024 * 1024
"""Each host AdamW worker's pinned scratch (STREAM_PIECE = 2^19 fp32 elements)."""
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class StepModelError(ValueError):
    """A bad input to the step-time model: an unknown preset, a profile without the facts
    the model needs, an out-of-range setting."""
