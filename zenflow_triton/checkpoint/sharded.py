"""Sharded checkpoints of an optimizer's state through ``torch.distributed.checkpoint``.

Works on a state dict, the params and the row shard (``ZenFlowOptimizer.save_sharded`` and
``load_sharded`` hand them over); it imports nothing of the optimizer.

``opt.state_dict()`` gives the full form: under data parallelism it gathers every rank's
rows of every host half onto every rank, which a large model may not afford. Here each rank
writes only its own rows instead: the host halves (``host_master``, ``host_m``, ``host_v``)
and the window accumulator (on either side) become DTensors sharded by rows
(``Shard(0)``: the row split of ``dist.shard.RowShard`` is ``torch.chunk``'s, which is DTensor's),
the device state is replicated (DCP writes it once), and the rest is JSON. DCP reshards on
load, so a checkpoint loads into any world size, a single process included. Under FSDP2
the state dict's per-row tensors are DTensors already (device halves included: each rank
holds its rows of everything), written as they are and read into templates of the same
layout (``dist.fsdp.rows_template``).

Flat keys, so no nested-dict flattening is involved: ``param_groups`` and ``zenflow``
(JSON), and per param index ``i``: ``state.i.<tensor key>`` and ``state.i.meta`` (the
param's non-tensor state, JSON).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Any, Sequence

import torch

from ..dist.fsdp import is_dtensor, rows_template
from ..state import MATRIX, ROW_SHARDED, state_side
from ..dist.shard import RowShard


@contextlib.contextmanager
def _single_process_is_meant():
    """DCP warns that it "assumes" a single process whenever no_dist is set; here it is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _mesh(shard: RowShard):
    """The 1-D device mesh of the shard's process group (None for a single process)."""
    if not shard.sharded:
        return None
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = shard.group if shard.group is not None else dist.group.WORLD
    return DeviceMesh.from_group(group, shard.device.type)


def _rows_of(params: Sequence[torch.Tensor]) -> list[int]:
    return [p.shape[0] if p.dim() else 1 for p in params]


def save_sharded(sd: dict, params: Sequence[torch.Tensor], shard: RowShard, checkpoint_id,
                 **dcp_kwargs: Any) -> None:
    """Write ``sd`` (a state dict whose host halves hold this rank's rows) with
    ``torch.distributed.checkpoint.save``; collective: every rank calls it. ``dcp_kwargs``
    go to ``dcp.save`` (``storage_writer``, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Shard

    mesh = _mesh(shard)
    rows = _rows_of(params)
    flat: dict[str, Any] = {"param_groups": json.dumps(sd["param_groups"]),
                            "zenflow": json.dumps(sd["zenflow"])}
    for i, st in sd["state"].items():
        if not (isinstance(i, int) and isinstance(st, dict)):
            continue  # not a param's state (torch allows any): not in a sharded checkpoint
        meta = {}
        for key, value in st.items():
            if not isinstance(value, torch.Tensor):
                meta[key] = value
            elif is_dtensor(value):  # FSDP2: already this rank's rows of the param's layout
                flat[f"state.{i}.{key}"] = value
            elif mesh is not None and key in ROW_SHARDED and st.get("kind") == MATRIX:
                width = value.shape[1]
                flat[f"state.{i}.{key}"] = DTensor.from_local(
                    value, mesh, [Shard(0)], run_check=False,
                    shape=torch.Size((rows[i], width)), stride=(width, 1))
            else:
                flat[f"state.{i}.{key}"] = value
        flat[f"state.{i}.meta"] = json.dumps(meta)
    dcp_kwargs.setdefault("no_dist", not shard.collective)  # one process: no collectives
    with _single_process_is_meant():
        dcp.save(flat, checkpoint_id=checkpoint_id, process_group=shard.group, **dcp_kwargs)


def read_sharded(params: Sequence[torch.Tensor], shard: RowShard, accumulate_on: str,
                 checkpoint_id, **dcp_kwargs: Any) -> dict:
    """Read a :func:`save_sharded` checkpoint (from any world size) as a state dict for
    ``load_state_dict``; collective. Each rank reads only its rows of the host halves."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor, Shard

    reader = dcp_kwargs.pop("storage_reader", None) or dcp.FileSystemReader(checkpoint_id)
    metadata = reader.read_metadata()
    mesh = _mesh(shard)
    rows = _rows_of(params)
    template: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            template[key] = ""  # a JSON string: DCP puts the saved object here
            continue
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() \
                or int(parts[1]) >= len(params):
            raise ValueError(f"checkpoint {checkpoint_id!r}: unexpected entry {key!r} (not a "
                             "ZenFlowOptimizer.save_sharded checkpoint of these params)")
        i, name = int(parts[1]), parts[2]
        size, dtype = torch.Size(md.size), md.properties.dtype
        host = state_side(name, accumulate_on) == "host"
        device = torch.device("cpu") if host else params[i].device
        fsdp = rows_template(params[i], name, size, dtype, device,
                             shard.chunk_rows(size[0])) if is_dtensor(params[i]) else None
        if fsdp is not None:  # FSDP2: this rank's rows, laid out as its param
            template[key] = fsdp
        elif mesh is not None and name in ROW_SHARDED and len(size) == 2 and size[0] == rows[i]:
            r0, r1 = shard.rows(size[0])
            local = torch.empty((r1 - r0, size[1]), dtype=dtype, device=device)
            template[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                               shape=size, stride=(size[1], 1))
        else:
            template[key] = torch.empty(size, dtype=dtype, device=device)
    dcp_kwargs.setdefault("no_dist", not shard.collective)
    with _single_process_is_meant():
        dcp.load(template, checkpoint_id=checkpoint_id, storage_reader=reader,
                 process_group=shard.group, **dcp_kwargs)
    state: dict[int, dict] = {}
    for key, value in template.items():
        if not key.startswith("state."):
            continue
        _, i, name = key.split(".")
        st = state.setdefault(int(i), {})
        if name == "meta":
            st.update(json.loads(value))
        elif isinstance(value, DTensor) and not is_dtensor(params[int(i)]):
            st[name] = value.to_local()  # DDP: this rank's rows of a host half
        else:
            st[name] = value  # FSDP2's DTensors as they are: load_state_dict takes them
    return {"param_groups": json.loads(template["param_groups"]),
            "zenflow": json.loads(template["zenflow"]), "state": state}
