"""A step-time model of offloaded AdamW training, per hardware profile (``zenflow-tune predict``).

Pure arithmetic over a hardware profile's facts and a workload's parameter shapes: for each
mode it lays out one steady-state window of ``update_interval`` training steps on four
lanes (``device`` compute, ``link-down`` device->host, ``link-up`` host->device, ``host``
compute) and reports the step time, the accelerator's idle (stall) fraction, the bytes that
cross the link, the host's busy fraction and the memory each side needs. Nothing is
measured here (except the host AdamW rate, on request); these are predictions. Every
formula, constant and assumption is written down in ``docs/stepmodel.md``; the short form:

* compute per step = model FLOPs / (MFU x peak bf16 FLOP/s), model FLOPs = 6 x (matmul
  weight elements) x tokens + attention (PaLM's definition); forward 1/3, backward 2/3;
* device optimizer work is memory bound: bytes moved / device memory bandwidth;
* a link transfer takes bytes / (link bandwidth per direction); each direction is a FIFO
  lane of its own;
* host AdamW takes elements / (host AdamW elements/s per process); the host is one FIFO
  lane per process;
* data parallelism over N GPUs: every GPU runs the full model on its own tokens; the
  offloaded (host-owned) elements are sharded by rows, so each GPU moves and each host
  process updates 1/N of them, and the processes on one node share its host; gradient
  all-reduce and the all-gather of updated rows go over the peer links and are not modelled.

Each mode is a small dependency graph (which transfer waits for which compute), scheduled
by :class:`_Lanes` for several windows until it repeats; the last window is the result. So
a case where one lane is the bottleneck gives exactly that lane's work per window, and the
graph for each mode is short enough to check by hand (the tests do).

The model lives in ``autotune/`` rather than ``zenflow_triton/``: it is a planning tool for
the tuner and the CLI, never used by the optimizer at run time, and it knows the optimizer
only through :class:`~zenflow_triton.config.ZenFlowConfig` and the profiles' public loader.

Where each part lives (each file imports only from the ones above it in this list):

* ``base.py``: the mode and lane names, the constants, :class:`StepModelError`;
* ``hardware.py``: :class:`Hardware`, a profile's facts: accelerator, device-host link,
  host cores and the host AdamW rate per process;
* ``shapes.py``: :class:`ParamSpec` and :class:`Layer`;
* ``presets.py``: :data:`PRESETS`, the named architectures, and how one is built;
* ``workload.py``: :class:`Workload`, from a preset or a ``torch.nn.Module``;
* ``settings.py``: :func:`zenflow_config` and the optimizer's column rounding;
* ``timeline.py``: :class:`Segment`, the lanes (:class:`_Lanes`), the window scheduler and
  :class:`Prediction`;
* ``costs.py``: the durations and element counts one GPU's process sees;
* ``memory.py``: the device and host memory of each mode;
* ``modes.py``: the modes' graphs (AdamW on the device, ZeRO-Offload, ZeRO-Offload with a
  delayed update, per-layer overlapped offload, ZenFlow);
* ``step.py``: :func:`predict` and :func:`predict_all`;
* ``host.py``: :func:`host_update_seconds`, the host AdamW job alone;
* ``report.py``: :func:`markdown_table`;
* ``plot.py``: :func:`plot_timelines`;
* ``calibrate.py``: :func:`calibration` and :func:`calibration_table`, the model against
  DeepSpeed's published ZenFlow figures.

Everything is importable from here, as when the model was one file.
"""

from __future__ import annotations

from .base import (_DTYPE_BYTES, DEFAULT_ACCELERATORS_PER_NODE,
                   DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE, DEFAULT_HOST_CORES_PER_ACCELERATOR,
                   DEFAULT_MFU, DEFAULT_SEQ_LEN, DEFAULT_TOKENS, DEVICE_ADAMW_BYTES_PER_ELEMENT,
                   HOST_ADAM_BYTES_PER_ELEMENT, HOST_MEMORY_EFFICIENCY, INDEX_BYTES, LANES,
                   MODES, SCRATCH_BYTES_PER_THREAD, SHARDINGS, StepModelError)
from .hardware import Hardware, _profile_hardware
from .shapes import Layer, ParamSpec
from .presets import PRESETS, _build_preset
from .workload import Workload, _group_key
from .settings import _SETTING_KEYS, _k, zenflow_config
from .timeline import _MAX_WINDOWS, Prediction, Segment, _cycle, _Lanes, _run_windows, _window
from .costs import _Costs, _costs
from .memory import _memory
from .modes import (_adamw, _overlapped_offload, _small_adam, _zenflow, _zero_offload,
                    _zero_offload_dpu)
from .step import predict, predict_all
from .host import host_update_seconds
from .report import markdown_table
from .plot import _COLORS, plot_timelines
from .calibrate import (CALIBRATION_ASSUMPTIONS, CALIBRATION_SOURCE, calibration,
                        calibration_table)

__all__ = [
    "MODES", "SHARDINGS", "LANES", "PRESETS", "StepModelError", "Hardware", "ParamSpec", "Layer",
    "Workload", "Segment", "Prediction", "predict", "predict_all", "host_update_seconds",
    "plot_timelines", "markdown_table", "calibration", "calibration_table", "zenflow_config",
    "DEFAULT_MFU", "DEFAULT_TOKENS", "DEFAULT_SEQ_LEN",
    "DEFAULT_HOST_CORES_PER_ACCELERATOR", "DEFAULT_HOST_ADAM_ELEMENTS_PER_S_PER_CORE",
]
