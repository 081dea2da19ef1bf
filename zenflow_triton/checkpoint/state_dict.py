"""The state-dict format: packing, checks on load, and the conversions from and to
``torch.optim.AdamW``'s state. Knows the per-param state layout (``state``), not the
optimizer class.

A ZenFlow state dict is torch's ``{"state": {index: ...}, "param_groups": [...]}`` plus a
``"zenflow"`` entry (format version, global step, config). Per matrix param the state holds
the two halves of ``state`` (column indices in the param's memory order, see
``columns.layout.view2d``); per small param AdamW's own ``exp_avg``/``exp_avg_sq``/``step``.
Every tensor of a saved param state is checked against the param before anything is
changed: a state that does not fit would otherwise make a kernel read or write out of
bounds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import ZenFlowConfig
from ..state import (MATRIX, ROW_SHARDED, SMALL, matrix_state, misplaced,
                     restore_param_state, state_side)
from ..columns.migration import moment_scales
from ..columns.layout import shape2d, view2d
from ..dist.fsdp import wrap_state_dict

SD_KEY = "zenflow"
SD_VERSION = 1

# torch.optim.AdamW options that change the update, which this optimizer does not implement
# (set, they are refused: maximize=True would otherwise be ignored silently).
UNSUPPORTED_FLAGS = {"maximize": False, "amsgrad": False}
KERNEL_CHOICES = ("foreach", "fused", "capturable", "differentiable")
"""torch.optim.AdamW options that choose a kernel, not the update or the state: accepted in a
group, a saved group (HF's default ``adamw_torch_fused`` saves fused=True) or as a keyword,
and dropped: ZenFlowOptimizer runs its own kernels."""


def check_group_flags(group: dict, where: str) -> None:
    """ValueError naming the first AdamW option of ``group`` that is set but not supported,
    or a Tensor lr."""
    if isinstance(group.get("lr"), torch.Tensor):
        raise ValueError(f"{where}: lr as a Tensor is not supported; give a float")
    for key in UNSUPPORTED_FLAGS:
        if group.get(key):
            raise ValueError(f"{where}: {key}={group[key]!r} is not supported by "
                             "ZenFlowOptimizer (AdamW without it only)")


def without_kernel_choices(options: dict, where: str) -> dict:
    """``options`` (a param group, or keywords given to the optimizer) without AdamW's kernel
    choices (:data:`KERNEL_CHOICES`) and the options it does not implement, refused if set."""
    check_group_flags(options, where)
    return {k: v for k, v in options.items()
            if k not in KERNEL_CHOICES and k not in UNSUPPORTED_FLAGS}


def pack(param_groups: list[dict], state: dict) -> dict[str, Any]:
    """torch's state-dict layout: params replaced by their order index, in the groups and as
    the state's keys; any other state key and value kept as it is. Param states are copied
    one level deep (the caller may add to them)."""
    index: dict[int, int] = {}
    groups = []
    for group in param_groups:
        packed = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            index.setdefault(id(p), len(index))
        packed["params"] = [index[id(p)] for p in group["params"]]
        groups.append(packed)
    out = {}
    for key, value in state.items():
        if isinstance(key, torch.Tensor):
            out[index[id(key)]] = dict(value) if isinstance(value, dict) else value
        else:
            out[key] = value
    return {"state": out, "param_groups": groups}


def is_adamw(sd: dict) -> bool:
    """Whether ``sd`` is a ``torch.optim.AdamW`` (or Adam) state dict, not one of ours."""
    if SD_KEY in sd:
        return False
    entries = [v for v in sd.get("state", {}).values() if isinstance(v, dict)]
    return bool(entries) and all("kind" not in v and "exp_avg" in v for v in entries) or (
        not entries and any("amsgrad" in g for g in sd.get("param_groups", [])))


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def _tensor(name: str, value: Any, shape: tuple, rows_ok: tuple[int, ...] = ()) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {value.dtype}")
    got = tuple(value.shape)
    if rows_ok and len(got) == len(shape) and got[0] in rows_ok and got[1:] == shape[1:]:
        return
    if got != tuple(shape):
        want = (f"[{' or '.join(map(str, rows_ok))}, {shape[1]}]" if rows_ok
                else str(list(shape)))
        raise ValueError(f"{name} has shape {list(got)}, expected {want}")


def _indices(name: str, value: Any, cols: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        raise ValueError(f"{name} must be a 1-D tensor of column indices")
    if value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {value.dtype}")
    idx = value.detach().cpu()
    if idx.is_floating_point():  # torch's default load casts every state tensor
        if not bool(torch.all(idx == idx.round())):
            raise ValueError(f"{name} holds non-integer values")
    idx = idx.long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= cols):
        raise ValueError(f"{name} holds column indices outside [0, {cols})")
    if idx.numel() > 1 and not bool(torch.all(idx[1:] > idx[:-1])):
        raise ValueError(f"{name} must be sorted and without repeats")
    return idx


def check_param_state(label: str, p: torch.Tensor, saved: Any, kind: str,
                      own_rows: int) -> None:
    """ValueError unless ``saved`` is a state of ``kind`` that fits ``p``: every tensor's
    shape and dtype, every column index in range, the halves complementary. ``own_rows``:
    the rows this rank keeps of a host half (all of them in a single process); a host half
    may hold all rows (the full form) or exactly those."""
    if not isinstance(saved, dict):
        raise ValueError(f"state for {label} must be a dict, got {type(saved).__name__}")
    got = saved.get("kind")
    if got not in (MATRIX, SMALL):
        raise ValueError(f"state for {label} has unknown kind {got!r}")
    if got != kind:
        raise ValueError(f"state for {label} is of kind {got!r}, but this optimizer treats "
                         f"the param as {kind!r} (different shape, min_offload_numel or "
                         "dense_params?)")
    where = f"state for {label}"
    if kind == SMALL:
        _as_int(f"{where}: step", saved.get("step"))
        for key in ("exp_avg", "exp_avg_sq"):
            _tensor(f"{where}: {key}", saved.get(key), tuple(p.shape))
        has_master = saved.get("master") is not None
        if has_master != (p.dtype != torch.float32):
            raise ValueError(f"{where}: a {p.dtype} param "
                             f"{'needs' if p.dtype != torch.float32 else 'has no'} fp32 master")
        if has_master:
            _tensor(f"{where}: master", saved["master"], tuple(p.shape))
        return
    rows, cols = shape2d(p)
    dev = _indices(f"{where}: device_idx", saved.get("device_idx"), cols)
    host = _indices(f"{where}: host_idx", saved.get("host_idx"), cols)
    if dev.numel() + host.numel() != cols or (
            dev.numel() and host.numel() and bool(torch.isin(dev, host).any())):
        raise ValueError(f"{where}: device_idx and host_idx must split the {cols} columns")
    k, n = dev.numel(), host.numel()
    for key in ("device_m", "device_v"):
        _tensor(f"{where}: {key}", saved.get(key), (rows, k))
    has_master = saved.get("device_master") is not None
    if has_master != (p.dtype != torch.float32):
        raise ValueError(f"{where}: a {p.dtype} param "
                         f"{'needs' if p.dtype != torch.float32 else 'has no'} device_master")
    if has_master:
        _tensor(f"{where}: device_master", saved["device_master"], (rows, k))
    row_options = tuple(dict.fromkeys((rows, own_rows)))
    for key in ("host_master", "host_m", "host_v"):
        _tensor(f"{where}: {key}", saved.get(key), (rows, n), row_options)
    for key in ("device_step", "host_step"):
        _as_int(f"{where}: {key}", saved.get(key))
    lr_sum = saved.get("acc_lr")
    if lr_sum is not None:  # the sum of the open window's lrs (absent in older states)
        if isinstance(lr_sum, torch.Tensor) and lr_sum.numel() == 1:
            lr_sum = lr_sum.item()
        if isinstance(lr_sum, bool) or not isinstance(lr_sum, (int, float)) \
                or not math.isfinite(lr_sum) or lr_sum < 0:
            raise ValueError(f"{where}: acc_lr must be a finite number >= 0 (the sum of the "
                             f"open window's learning rates), got {saved.get('acc_lr')!r}")
    if _as_int(f"{where}: acc_count", saved.get("acc_count")) > 0:
        _tensor(f"{where}: acc", saved.get("acc"), (rows, n), row_options)


def from_adamw(p: torch.Tensor, entry: dict, kind: str, rows: tuple[int, int],
               label: str) -> dict:
    """One param's ``torch.optim.AdamW`` state as a ZenFlow one: a small param keeps it; a
    matrix param's columns all start host-owned with AdamW's moments and step count (the
    next step selects and moves the device's columns with them, unchanged)."""
    if not isinstance(entry, dict) or not {"exp_avg", "exp_avg_sq"} <= entry.keys():
        raise ValueError(f"AdamW state for {label} lacks exp_avg/exp_avg_sq")
    if entry.get("max_exp_avg_sq") is not None:
        raise ValueError(f"AdamW state for {label} has max_exp_avg_sq (amsgrad=True), which "
                         "ZenFlowOptimizer does not implement")
    step = _as_int(f"AdamW state for {label}: step", entry.get("step", 0))
    for key in ("exp_avg", "exp_avg_sq"):
        _tensor(f"AdamW state for {label}: {key}", entry[key], tuple(p.shape))
    m, v = entry["exp_avg"].detach().float(), entry["exp_avg_sq"].detach().float()
    if kind == SMALL:
        out = {"kind": SMALL, "step": step, "exp_avg": m, "exp_avg_sq": v}
        if p.dtype != torch.float32:
            out["master"] = p.detach().float()
        return out
    r0, r1 = rows
    return matrix_state(p, torch.device("cpu"), view2d(p.detach()).float()[r0:r1],
                        view2d(m, like=p)[r0:r1], view2d(v, like=p)[r0:r1], step)


def to_adamw(p: torch.Tensor, st: dict, beta1: float, beta2: float) -> dict:
    """One param's ZenFlow state (host halves with all rows) as ``torch.optim.AdamW``'s: one
    step count, the moments of both halves rescaled to it so their bias-corrected values are
    unchanged, in the param's shape and layout."""
    if st["kind"] == SMALL:
        return {"step": torch.tensor(float(st["step"])),
                "exp_avg": st["exp_avg"].detach().float().cpu().clone(),
                "exp_avg_sq": st["exp_avg_sq"].detach().float().cpu().clone()}
    step = max(st["device_step"], st["host_step"])
    out = {}
    for key, dev_key, host_key, which in (("exp_avg", "device_m", "host_m", 0),
                                         ("exp_avg_sq", "device_v", "host_v", 1)):
        full = torch.empty_like(p, dtype=torch.float32, device="cpu")
        f2d = view2d(full)
        for idx_key, key_half, s in (("device_idx", dev_key, st["device_step"]),
                                     ("host_idx", host_key, st["host_step"])):
            idx = st[idx_key].cpu().long()
            if idx.numel():
                scale = moment_scales(beta1, beta2, s, step)[which]
                f2d[:, idx] = st[key_half].detach().float().cpu() * scale
        out[key] = full
    return {"step": torch.tensor(float(step)), **out}


# Config fields that change how, not what, is computed (results are bit-identical across them).
EXECUTION_ONLY = frozenset({"chunk_size", "host_threads", "host_cores", "backend",
                            "host_timeout", "check_finite", "check_finite_at"})


def config_change(saved: Any, mine: ZenFlowConfig) -> str | None:
    """A warning naming the fields (``name: saved -> mine``) in which a saved config differs
    from this optimizer's in what is computed (its schedule or step rule), or None."""
    if not isinstance(saved, dict):
        return None
    now = json.loads(json.dumps(mine.to_dict()))
    saved = json.loads(json.dumps(saved))
    changed = sorted(k for k in saved.keys() & now.keys()
                     if k not in EXECUTION_ONLY and saved[k] != now[k])
    if not changed:
        return None
    what = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
    return (f"load_state_dict: the state was saved with a different ZenFlowConfig ({what}); "
            "this optimizer continues with its own. Pass the saved values to the constructor "
            "to continue the saved run unchanged.")




_SAVE_GATHER = ("the state dict's all-gather of the host halves' rows (collective under data "
                "parallelism: every rank must call state_dict(); for a framework that saves on "
                "rank 0 only, call prepare_state_dict() on every rank first, e.g. with "
                "zenflow_triton.hf.ZenFlowCallback for the HF Trainer)")
GATHER_BYTES = 256 << 20
"""At most this many bytes of gathered rows (every rank's) on the collective's device at a
time while a state dict gathers the host halves (one tensor larger than this goes alone)."""


def gather_host_halves(state: dict, params: list[torch.Tensor], shard) -> None:
    """In ``state`` (a state dict's, keyed by param index), replace each host half that
    holds this rank's rows by all the rows, gathered from every rank (every rank gets the
    full form, which loads into any world size). In batches of at most ``GATHER_BYTES`` of
    gathered rows (one all-gather per dtype of a batch), each moved to host memory before
    the next: the collective's device (an accelerator under NCCL) never holds the whole
    model's fp32 masters and moments."""
    items = [(i, key) for i, st in sorted((i, st) for i, st in state.items()
                                          if isinstance(i, int) and isinstance(st, dict))
             if st.get("kind") == MATRIX
             for key in ROW_SHARDED if isinstance(st.get(key), torch.Tensor)]
    batches: list[list[tuple[int, str]]] = [[]]
    size = 0
    for i, key in items:
        t = state[i][key]
        full_bytes = view2d(params[i]).shape[0] * t.shape[1] * t.element_size()
        if batches[-1] and size + full_bytes > GATHER_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((i, key))
        size += full_bytes
    for batch in filter(None, batches):
        full = shard.gather_rows([state[i][key].to(shard.device) for i, key in batch],
                                 [view2d(params[i]).shape[0] for i, _ in batch],
                                 what=_SAVE_GATHER)
        for (i, key), t in zip(batch, full):
            state[i][key] = t.cpu()


def window_open(st: Any) -> bool:
    """Whether a param state's window is open (gradients not yet on the host)."""
    return isinstance(st, dict) and st.get("acc_count", 0) > 0


def open_windows(params: list[torch.Tensor], state: dict, name_of) -> list[str]:
    """The names of the params whose window is open."""
    return [name_of(p) for p in params if window_open(state.get(p))]


def refuse_open_windows(params: list[torch.Tensor], state: dict, name_of) -> None:
    """Raise where a window is open: AdamW's state has no place for its gradients."""
    still_open = open_windows(params, state, name_of)
    if still_open:
        raise ValueError("to_adamw_state_dict: a window is open (accumulated gradients "
                         f"not yet on the host) for {', '.join(still_open[:3])}; call "
                         "it after a step that ends a window")


def build(param_groups: list[dict], state: dict, params: list[torch.Tensor], shard, *,
          gather: bool, meta: dict, fsdp: bool, config: ZenFlowConfig) -> dict[str, Any]:
    """The state dict of an optimizer whose host work is finished: torch's layout (``pack``),
    under data parallelism with ``gather`` every rank's rows of each host half (the full
    form), the format's ``meta`` (also in the first param group, where frameworks keep only
    ``state`` and ``param_groups``: DCP's state_dict API), and under FSDP2 each param's state
    as DTensors (``dist.fsdp.wrap_state_dict``)."""
    sd = pack(param_groups, state)
    if gather and shard.sharded:
        gather_host_halves(sd["state"], params, shard)
    sd[SD_KEY] = meta
    if sd["param_groups"]:
        sd["param_groups"][0][SD_KEY] = dict(meta)
    if fsdp:
        wrap_state_dict(sd, params, config.accumulator_torch_dtype)
    return sd


def adamw_state_dict(sd: dict, params: list[torch.Tensor]) -> dict:
    """A full-form ZenFlow state dict (every row of every host half) as torch.optim.AdamW's:
    each param's state by :func:`to_adamw`, each group with AdamW's defaults for the options
    it lacks."""
    betas = {i: g["betas"] for g in sd["param_groups"] for i in g["params"]}
    defaults = torch.optim.AdamW([torch.zeros(1)]).defaults
    groups = [{**{k: v for k, v in defaults.items() if k not in g},
               **{k: v for k, v in g.items() if k != SD_KEY}}  # (our meta: not AdamW's)
              for g in sd["param_groups"]]
    state = {i: to_adamw(params[i], st, *betas[i]) for i, st in sd["state"].items()
             if isinstance(i, int) and isinstance(st, dict) and "kind" in st}
    return {"state": state, "param_groups": groups}




@dataclass
class Loaded:
    """A state dict checked and converted for this optimizer, nothing of it applied yet."""
    adamw: bool
    meta: dict
    state: dict
    groups: list[dict]


def read(state_dict: dict, param_groups: list[dict], config: ZenFlowConfig,
         rows_of: Callable[[int], tuple[int, int]],
         name_of: Callable[[torch.Tensor], str],
         kind_of: Callable[[torch.Tensor], str],
         local_of: Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]] | None = None
         ) -> Loaded:
    """Check ``state_dict`` (ours, or torch.optim.AdamW's) against this optimizer's groups
    and params and build the state to hold, raising ValueError before anything is
    applied. ``rows_of(total)``: this rank's rows of a host half of ``total`` rows;
    ``kind_of(p)``: MATRIX or SMALL, as this optimizer classifies ``p``; ``local_of(p,
    saved)``: the tensor this rank computes on for ``p`` and ``saved`` as it holds it
    (FSDP2: its rows; see ``dist.fsdp.state_as_local``), None for whole params.

    The format's meta (``"zenflow"``: version, global step, config) is read from the state
    dict, or from its first param group where a framework kept only ``state`` and
    ``param_groups`` (``torch.distributed.checkpoint.state_dict`` does)."""
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("not an optimizer state_dict: missing 'state' or 'param_groups'")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} param groups, this optimizer has "
            f"{len(param_groups)}: build the optimizer with the groups it was saved with, in "
            "the same order (the HF Trainer saves two: weight decay on every param but biases "
            "and norm weights, then those without; zenflow_triton.hf.trainer_kwargs(model) "
            "builds them alike)")
    for gi, (g, sg) in enumerate(zip(param_groups, saved_groups)):
        if len(g["params"]) != len(sg["params"]):
            raise ValueError(f"param group {gi}: state_dict has {len(sg['params'])} "
                             f"params, this optimizer has {len(g['params'])}")
        check_group_flags(sg, f"state_dict param group {gi}")
    adamw = is_adamw(state_dict)
    meta = state_dict.get(SD_KEY) or (saved_groups[0].get(SD_KEY) if saved_groups else None) \
        or {}
    if meta.get("version", SD_VERSION) > SD_VERSION:
        raise ValueError(f"state_dict format version {meta['version']} is newer than this "
                         f"zenflow-triton supports ({SD_VERSION})")
    id_map = {}
    for g, sg in zip(param_groups, saved_groups):
        id_map.update(zip(sg["params"], g["params"]))
    state: dict[Any, Any] = {}
    for key, saved in state_dict["state"].items():
        if key not in id_map:
            state[key] = saved  # not a param's: kept as it is (as torch does)
            continue
        param = p = id_map[key]
        kind = kind_of(p)
        if local_of is not None and isinstance(saved, dict):
            p, saved = local_of(p, saved)
        rows = rows_of(view2d(p).shape[0]) if kind == MATRIX else (0, 0)
        if adamw:
            saved = from_adamw(p, saved, kind, rows, name_of(p))
        check_param_state(name_of(p), p, saved, kind, rows[1] - rows[0])
        state[param] = restore_param_state(p, saved, config, rows)
    skip = {"params", SD_KEY, *KERNEL_CHOICES} | (set(UNSUPPORTED_FLAGS)
                                                  | {"decoupled_weight_decay"} if adamw else set())
    groups = [{k: tuple(v) if k == "betas" else v for k, v in sg.items() if k not in skip}
              for sg in saved_groups]
    return Loaded(adamw, meta, state, groups)


__all__ = ["SD_KEY", "SD_VERSION", "UNSUPPORTED_FLAGS", "EXECUTION_ONLY", "Loaded",
           "adamw_state_dict", "check_group_flags", "check_param_state", "config_change",
           "from_adamw", "gather_host_halves", "is_adamw", "misplaced", "pack", "read",
           "restore_param_state", "to_adamw"]
