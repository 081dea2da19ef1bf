"""A step-time model of offloaded AdamW training, per hardware profile (``zenflow-tune predict``).

Pure arithmetic over a hardware profile's facts and a workload's parameter shapes: for each
mode it lays out one steady-state window of ``update_interval`` training steps on four
lanes (``device`` compute, ``link-down`` device->host, ``link-up`` host->device, ``host``
compute) and reports the step time, the accelerator's idle (stall) fraction, the bytes that
cross the link, the host's busy fraction and the memory each side needs. Nothing is
measured here (``zenflow-tune measure``, :mod:`autotune.measure`, measures the host and link
figures a profile can carry; ``predict --measure-host`` the host rate alone); these are
predictions. Every formula, constant and assumption is written down in
``docs/stepmodel.md``; the short form:

* compute per step = model FLOPs / (MFU x peak bf16 FLOP/s), model FLOPs = 6 x (matmul
  weight elements) x tokens + attention (PaLM's definition); forward 1/3, backward 2/3;
* device optimizer work is memory bound: bytes moved / device memory bandwidth;
* a link transfer takes bytes / (its direction's link bandwidth); each direction is a FIFO
  lane of its own, and a transfer slows to its direction's contended figure for the part
  of it the other direction is busy (where the profile gives one: ``timeline.run_windows``);
* host AdamW takes elements / (host AdamW elements/s per process); the host is one FIFO
  lane per process;
* data parallelism over N GPUs: every GPU runs the full model on its own tokens; the
  offloaded (host-owned) elements are sharded by rows, so each GPU moves and each host
  process updates 1/N of them, and the processes on one node share its host; gradient
  all-reduce and the all-gather of updated rows go over the peer links and are not modelled.

Each mode is a small dependency graph (which transfer waits for which compute), scheduled
on the lanes for several windows until it repeats; the last window is the result. So a
case where one lane is the bottleneck gives exactly that lane's work per window, and the
graph for each mode is short enough to check by hand (the tests do).

The model lives in ``autotune/`` rather than ``zenflow_triton/``: it is a planning tool for
the tuner and the CLI, never used by the optimizer at run time, and it knows the optimizer
only through :class:`~zenflow_triton.config.ZenFlowConfig`, the optimizer's column count
(:func:`zenflow_triton.columns.selection.num_selected`) and the profiles' public loader.

Where each part lives (each file imports only from the ones above it in this list):

* ``inputs.py``: the names and constants, :class:`StepModelError`, :class:`Hardware` (a
  profile's facts) and :func:`zenflow_config`;
* ``workload.py``: :class:`ParamSpec`, :class:`Layer`, :data:`PRESETS` and
  :class:`Workload` (from a preset, an HF ``config.json`` or a ``torch.nn.Module``; its
  tokens per optimizer step and per micro-batch);
* ``activations.py``: the activation memory of one micro-batch;
* ``timeline.py``: :class:`Segment`, the four FIFO lanes, the scheduler that runs windows
  until they repeat (and reschedules until the link's contended transfers settle), and
  :class:`Prediction`;
* ``modes.py``: the durations and element counts one GPU sees, the memory of each mode, and
  the modes' graphs (AdamW on the device, ZeRO-Offload, ZeRO-Offload with a delayed
  update, per-layer overlapped offload, ZenFlow);
* ``step.py``: :func:`predict`, :func:`predict_all` and :func:`host_update_seconds`;
* ``batch.py``: :func:`predict_fitting` (a mode at the largest micro-batch that fits) and
  :func:`batch_curve` (ZenFlow against its fastest peer over tokens per optimizer step);
* ``report.py``: :func:`markdown_table`, :func:`plot_timelines`, and :func:`calibration` /
  :func:`calibration_table`, the model against DeepSpeed's published ZenFlow figures.

The public names are importable from here.
"""

from __future__ import annotations

from .inputs import (DEFAULT_ACCELERATORS_PER_NODE, DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE,
                     DEFAULT_HOST_CORES_PER_ACCELERATOR, DEFAULT_MFU, DEFAULT_SEQ_LEN,
                     DEFAULT_TOKENS, DEVICE_ADAMW_BYTES_PER_ELEMENT, DEVICE_HEADROOM,
                     HOST_ADAM_BYTES_PER_ELEMENT, HOST_MEMORY_EFFICIENCY, INDEX_BYTES, LANES,
                     LOSSES, MODES, SCRATCH_BYTES_PER_THREAD, SHARDINGS, Hardware, StepModelError,
                     zenflow_config)
from .workload import PRESETS, Layer, ParamSpec, Workload
from .timeline import Prediction, Segment
from .step import (LEAN_CHOICES, fitting_zenflow, host_update_seconds, lean_changes,
                   params_and_grads_bytes, predict, predict_all, resident_that_fits)
from .report import (CALIBRATION_ASSUMPTIONS, CALIBRATION_SOURCE, PUBLISHED_PEERS,
                     calibration, calibration_table, markdown_table, plot_timelines,
                     published_peers)
from .activations import activation_bytes
from .modes import DEEPSPEED_FP32_GRADIENT, optimizer_state_bytes
from .batch import (CURVE_TOKENS, MICRO_BATCH_CAP, BatchPoint, batch_curve, curve_table,
                    fitting_zenflow_at_batch, micro_batch_choices, plot_curves,
                    predict_fitting, verdict)

__all__ = [
    "MODES", "SHARDINGS", "LANES", "LOSSES", "PRESETS", "StepModelError", "Hardware",
    "ParamSpec", "Layer",
    "Workload", "Segment", "Prediction", "predict", "predict_all", "host_update_seconds",
    "fitting_zenflow", "lean_changes", "resident_that_fits", "params_and_grads_bytes", "LEAN_CHOICES",
    "plot_timelines", "markdown_table", "calibration", "calibration_table", "zenflow_config",
    "CALIBRATION_SOURCE", "CALIBRATION_ASSUMPTIONS", "PUBLISHED_PEERS", "published_peers",
    "activation_bytes", "DEVICE_HEADROOM", "optimizer_state_bytes", "DEEPSPEED_FP32_GRADIENT",
    "CURVE_TOKENS", "MICRO_BATCH_CAP", "BatchPoint", "batch_curve", "curve_table",
    "micro_batch_choices", "plot_curves", "predict_fitting", "verdict",
    "fitting_zenflow_at_batch",
    "DEFAULT_MFU", "DEFAULT_TOKENS", "DEFAULT_SEQ_LEN",
    "DEFAULT_HOST_CORES_PER_ACCELERATOR", "DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE",
    "DEFAULT_ACCELERATORS_PER_NODE", "HOST_MEMORY_EFFICIENCY", "HOST_ADAM_BYTES_PER_ELEMENT",
    "DEVICE_ADAMW_BYTES_PER_ELEMENT", "INDEX_BYTES", "SCRATCH_BYTES_PER_THREAD",
]
