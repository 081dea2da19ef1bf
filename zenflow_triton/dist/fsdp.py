"""FSDP2 (``fully_shard``): params that are DTensors sharded by rows over a 1-D mesh.

``fully_shard`` makes every param a DTensor placed ``Shard(0)``: rank ``r`` holds rows
``[r * c, (r + 1) * c)`` of it (``c = ceil(rows / world)``, clipped: ``torch.chunk``'s split,
which is also ``shard.RowShard``'s), and after the backward its gradient's same rows. The
optimizer then works on each rank's local rows as it works on a whole param in one process:
the device half, the host half, the accumulator and the moments of its own rows only. What
it must see whole it reduces over the mesh (``shard.RowShard`` with ``split_rows=False``):
the column scores of a selection, the adaptive step size's statistics, the NaN/inf flags,
the vote on the host work. It classifies a param by its global shape, so every rank makes
the same collectives whatever its rows (none, for a param with fewer rows than ranks).

This module is the door: whether a param is such a DTensor, its local tensor, and the
process group of its mesh. Nothing else here reaches into DTensor."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, MutableMapping

import torch

from ..state import MATRIX, by_rows


def is_dtensor(t: torch.Tensor | None) -> bool:
    return t is not None and type(t).__name__ == "DTensor"


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``t``: a DTensor's local shard (one object for the
    DTensor's life, so it can key caches; writes land in the DTensor), else ``t``."""
    if not is_dtensor(t):
        return t
    inner = getattr(t, "_local_tensor", None)
    return inner if inner is not None else t.to_local()


def check_param(p: torch.Tensor, name: str) -> None:
    """TypeError naming a DTensor param this optimizer cannot take: anything but a
    ``Shard(0)`` placement on a 1-D mesh (FSDP2's ``fully_shard``)."""
    from torch.distributed.tensor import Shard

    mesh, placements = p.device_mesh, tuple(p.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise TypeError(
            f"{name} is a DTensor placed {placements} on a {mesh.ndim}-D mesh; "
            "ZenFlowOptimizer takes FSDP2's fully_shard on a 1-D mesh (Shard(0): each "
            "rank holds whole rows), not HSDP (2-D meshes), tensor parallelism or "
            "replicated DTensors")
    if mesh.device_type != "cpu" and local(p).device.type == "cpu":
        raise TypeError(
            f"{name} lies in host memory on a {mesh.device_type} mesh: FSDP2's "
            "CPUOffloadPolicy; ZenFlowOptimizer does that part itself (the host half and "
            "its Adam state live in host memory, the important columns stay on the "
            "accelerator), so wrap the model with fully_shard without offload_policy")


def mesh_group(params: Iterable[torch.Tensor]):
    """The process group of the params' mesh, or None when none is a DTensor; ValueError
    when they lie on different meshes (one optimizer shards over one group) or are a mix of
    DTensors and plain tensors (a plain one's rows would be counted once per rank)."""
    meshes, plain = [], 0
    for p in params:
        if not is_dtensor(p):
            plain += 1
        elif not any(p.device_mesh == m for m in meshes):
            meshes.append(p.device_mesh)
    if not meshes:
        return None
    if plain:
        raise ValueError(f"{plain} param(s) are plain tensors beside FSDP2's DTensors; "
                         "ZenFlowOptimizer takes one or the other (fully_shard every module "
                         "whose params it optimizes, or give the plain ones their own "
                         "optimizer)")
    if len(meshes) > 1:
        raise ValueError(f"the params lie on {len(meshes)} different device meshes; "
                         "ZenFlowOptimizer shards over one (give each mesh's params their "
                         "own optimizer)")
    return meshes[0].get_group()


class LocalState(MutableMapping):
    """``optimizer.state`` (keyed by the params, DTensors included) seen through each
    param's local tensor: the step's code reads and writes a param's state by the tensor
    it computes on. Built per step from the params."""

    def __init__(self, state: dict, params: Iterable[torch.Tensor]) -> None:
        self._state = state
        self._owner = {local(p): p for p in params}

    def owner(self, t: torch.Tensor) -> torch.Tensor:
        return self._owner.get(t, t)

    def __getitem__(self, t: torch.Tensor) -> dict:
        return self._state[self.owner(t)]

    def __setitem__(self, t: torch.Tensor, value: dict) -> None:
        self._state[self.owner(t)] = value

    def __delitem__(self, t: torch.Tensor) -> None:
        del self._state[self.owner(t)]

    def __contains__(self, t: object) -> bool:
        return self.owner(t) in self._state  # type: ignore[arg-type]

    def get(self, t, default=None):
        return self._state.get(self.owner(t), default)

    def __iter__(self) -> Iterator[torch.Tensor]:
        inverse = {p: t for t, p in self._owner.items()}
        return (inverse.get(p, p) for p in self._state)

    def __len__(self) -> int:
        return len(self._state)


def localize(work: list, name_of: Callable[[torch.Tensor], str]) -> list:
    """``(group, param, grad)`` triples with each DTensor param and gradient replaced by
    their local tensors; TypeError naming a param whose gradient is not a DTensor of its
    placement (or is one while the param is not)."""
    def layout(t: torch.Tensor) -> str:
        return f"a DTensor placed {tuple(t.placements)}" if is_dtensor(t) else "a plain tensor"

    out = []
    for group, p, g in work:
        if layout(p) != layout(g):
            raise TypeError(f"{name_of(p)}: the gradient is {layout(g)} but the param is "
                            f"{layout(p)}")
        out.append((group, local(p), local(g)))
    return out


def check_same_kind(params, fsdp: bool) -> None:
    """Params added to an optimizer must be of its kind: all FSDP2 DTensors, or none."""
    if any(is_dtensor(p) != fsdp for p in params):
        raise ValueError("add_param_group: the new params must be "
                         + ("FSDP2 DTensors" if fsdp else "plain tensors")
                         + ", as this optimizer's are")


def refuse(what: str) -> None:
    """Raise: ``what`` does not take FSDP2 params yet; where to go instead."""
    raise NotImplementedError(
        f"{what} is not supported for FSDP2 params yet; save and load through "
        "save_sharded() / load_sharded(), or "
        "torch.distributed.checkpoint.state_dict (get_optimizer_state_dict / "
        "set_optimizer_state_dict), which state_dict() and load_state_dict() serve "
        "(docs/distributed.md)")


def wrap_state_dict(sd: dict, params: list[torch.Tensor], accumulator_dtype: torch.dtype) -> None:
    """In a packed state dict, each DTensor param's state as DTensors of its placement (each
    rank's rows, no copies), as ``torch.distributed.checkpoint.state_dict`` expects of an
    optimizer over FSDP2 params; an accumulator even where no window is open (zeros), so
    that a fresh optimizer's state dict, which DCP loads into, has every key of a saved one."""
    for i, st in sd["state"].items():
        if not (isinstance(i, int) and isinstance(st, dict) and is_dtensor(params[i])):
            continue
        if st.get("kind") == MATRIX and st.get("acc") is None:
            st["acc"] = torch.zeros(st["host_master"].shape[0], st["host_idx"].numel(),
                                    dtype=accumulator_dtype)
        sd["state"][i] = state_as_dtensors(st, params[i])


def local_view(p: torch.Tensor, saved: dict, shard) -> tuple[torch.Tensor, dict]:
    """A param and its saved state as this rank checks and holds them (a DTensor param: its
    local rows, and the saved state's same rows)."""
    if not is_dtensor(p):
        return p, saved
    return local(p), state_as_local(saved, p, shard.chunk_rows(p.shape[0]))


def _has_rows(key: str, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and by_rows(key, value.dim())


def state_as_dtensors(st: dict, p: torch.Tensor) -> dict:
    """A DTensor param's packed state as ``state_dict()`` gives it under FSDP2: each tensor
    laid out by rows as a DTensor of the param's placement and global row count (no copy:
    this rank's rows are its local tensor), the column indices and counts as they are (the
    same on every rank). What ``torch.distributed.checkpoint.state_dict`` expects of an
    optimizer over FSDP2 params: it saves each rank's rows, or gathers them."""
    out = {}
    for key, value in st.items():
        if _has_rows(key, value):
            value = _wrap(value, p, (p.shape[0], *value.shape[1:]))
        out[key] = value
    return out


def _wrap(value: torch.Tensor, p: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``value`` (this rank's rows, where it lies) as a DTensor of ``p``'s mesh and
    placement with global ``shape``. Not ``DTensor.from_local``: that moves a local tensor
    to the mesh's device type, which would copy every host half onto the accelerator at
    each ``state_dict()`` (a host half stays in host memory, as FSDP2's own CPU offload
    keeps its shards)."""
    from torch.distributed.tensor import DTensor

    stride = _contiguous_strides(shape)
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    except ImportError:  # another torch layout: the public door (moves across devices)
        return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                                  shape=shape, stride=stride)
    spec = DTensorSpec(p.device_mesh, tuple(p.placements),
                       tensor_meta=TensorMeta(torch.Size(shape), stride, value.dtype))
    return DTensor(value.view_as(value), spec, requires_grad=False)


def rows_template(p: torch.Tensor, key: str, size: torch.Size, dtype: torch.dtype,
                  device: torch.device, rows: tuple[int, int]) -> torch.Tensor | None:
    """An empty DTensor of ``p``'s placement to read this rank's ``rows`` of a saved state
    tensor of global ``size`` into (a checkpoint reader's template), ``device`` holding
    them; None for a tensor not laid out by ``p``'s rows (column indices, counts)."""
    if not by_rows(key, len(size)) or size[0] != p.shape[0]:
        return None
    mine = torch.empty((rows[1] - rows[0], *size[1:]), dtype=dtype, device=device)
    return _wrap(mine, p, tuple(size))


def state_as_local(saved: dict, p: torch.Tensor, rows: tuple[int, int]) -> dict:
    """A saved param state as this rank holds it: a DTensor as this rank's rows of it (its
    local tensor when placed as the param is, else the rows of its full tensor), a whole
    tensor of the param's global row count as this rank's ``rows``; anything else as it
    is (then checked against the local param by the caller)."""
    out = {}
    for key, value in saved.items():
        if is_dtensor(value):
            if tuple(value.placements) == tuple(p.placements) \
                    and value.device_mesh == p.device_mesh:
                value = local(value)
            else:
                value = value.full_tensor()
        if _has_rows(key, value) and value.shape[0] == p.shape[0]:
            value = value[rows[0]:rows[1]]
        out[key] = value
    return out


def _contiguous_strides(shape: tuple) -> tuple:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))
