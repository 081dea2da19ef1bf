"""Migration: columns that change owner at a reselection carry their fp32 master and Adam
moments to the other half, rescaled so their bias-corrected values are unchanged under the
destination's step count: m' = m * (1 - b1**s_dst) / (1 - b1**s_src), same for v with b2."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..kernels import KernelOps
from ..transfer import Link, pinned
from .layout import shape2d, view2d
from .selection import Move

def moment_scales(beta1: float, beta2: float, s_src: int, s_dst: int) -> tuple[float, float]:
    """Factors that keep m/(1-b1**s) and v/(1-b2**s) unchanged from s_src to s_dst."""
    if s_src == s_dst or s_src == 0:  # equal counts, or state never updated (all zeros)
        return 1.0, 1.0
    return ((1.0 - beta1 ** s_dst) / (1.0 - beta1 ** s_src),
            (1.0 - beta2 ** s_dst) / (1.0 - beta2 ** s_src))


def migrate(p: torch.Tensor, st: dict, new_idx: torch.Tensor, *, beta1: float, beta2: float,
            ops: KernelOps, link: Link) -> int:
    """:func:`migrate_many` for one param; ``new_idx`` the new device-owned columns (any
    device, sorted)."""
    return migrate_many([Move(p, st, new_idx.cpu().numpy(), beta1, beta2)], ops=ops,
                        link=link)[0]


def migrate_many(moves: Sequence[Move], *, ops: KernelOps, link: Link,
                 shard=None) -> tuple[int, dict]:
    """Make each move's ``new_idx`` the device-owned columns of its param, carrying the fp32
    master and moments of the columns that change owner (rescaled so their bias-corrected
    values are unchanged under the destination's step count). Returns how many columns moved,
    and ``{p: (st["host_idx"], that index on p's device)}`` for every param whose split
    changed (uploaded with the other tables, so the next accumulation need not copy it).

    Preconditions (the optimizer drains first): no host work in flight, host results applied,
    accumulators empty.

    Host syncs, whatever the number of params: the bookkeeping of who moves where is done on
    the host (numpy, from the host-side ``host_idx``), so per device the columns leaving the
    device cross in one blocking copy (the host needs them), and the index tables and the
    entering columns in one non-blocking copy each.

    ``shard`` (a ``dist.shard.RowShard``, data parallelism): this rank's host state holds only its
    rows; the columns leaving the device keep this rank's rows, and those entering it are
    gathered from every rank's rows (one all-gather per device).
    """
    moved = 0
    plans = []
    for mv in moves:
        st = mv.st
        assert st["acc_count"] == 0 and not st["host_pending"], "migrate needs a drained param"
        rows, cols = shape2d(mv.p)
        old_host = st["host_idx"].numpy()
        owner_old = np.ones(cols, dtype=bool)
        owner_old[old_host] = False
        owner_new = np.zeros(cols, dtype=bool)
        owner_new[mv.new_idx] = True
        if np.array_equal(owner_new, owner_old):
            st["selected"] = True
            continue
        plans.append(_plan(mv, rows, cols, owner_old, owner_new))
    by_device: dict[torch.device, list] = {}
    for plan in plans:
        by_device.setdefault(plan["p"].device, []).append(plan)
    indices = {}
    for dev, group in by_device.items():
        moved += _migrate_on(dev, group, ops=ops, link=link, shard=shard)
        for plan in group:
            indices[plan["p"]] = (plan["st"]["host_idx"], plan["new_host_d"])
    return moved, indices


def _plan(mv: Move, rows: int, cols: int, owner_old: np.ndarray, owner_new: np.ndarray) -> dict:
    """Host-side bookkeeping of one param's move: every index array it needs (numpy)."""
    st = mv.st
    old_dev = np.flatnonzero(owner_old)
    old_host = st["host_idx"].numpy()
    new_dev = np.flatnonzero(owner_new)
    new_host = np.flatnonzero(~owner_new)

    # An empty half has no state: adopt the other half's step count, so nothing rescales.
    s_dev, s_host = st["device_step"], st["host_step"]
    if old_dev.size == 0:
        s_dev = s_host
    elif old_host.size == 0:
        s_host = s_dev
    elif s_host == 0:  # host half never updated (all zero): it starts at the device count
        s_host = s_dev
    elif s_dev == 0:
        s_dev = s_host

    def pos_in(idx: np.ndarray) -> np.ndarray:
        pos = np.full(cols, -1, dtype=np.int64)
        pos[idx] = np.arange(idx.size)
        return pos

    pos_dev, pos_host = pos_in(old_dev), pos_in(old_host)
    leave = np.flatnonzero(owner_old & ~owner_new)  # device -> host
    enter = np.flatnonzero(owner_new & ~owner_old)  # host -> device

    def assemble_pos(new_cols, pos_old, n_old, moved_cols):
        """Positions in cat([old half, moved columns]) of the new half's columns, in order."""
        pos_moved = pos_in(moved_cols) + n_old
        return np.where(pos_old >= 0, pos_old, pos_moved)[new_cols]

    return dict(
        p=mv.p, st=st, rows=rows, s_dev=s_dev, s_host=s_host,
        to_dev=moment_scales(mv.beta1, mv.beta2, s_host, s_dev),
        to_host=moment_scales(mv.beta1, mv.beta2, s_dev, s_host),
        new_dev=new_dev, new_host=new_host, leave=leave, enter=enter,
        leave_pos=pos_dev[leave], enter_pos=pos_host[enter],
        dev_pos=assemble_pos(new_dev, pos_dev, old_dev.size, enter),
        host_pos=assemble_pos(new_host, pos_host, old_host.size, leave))


def _migrate_on(dev: torch.device, plans: list, *, ops: KernelOps, link: Link,
                shard=None) -> int:
    """The moves of ``plans`` (one device's): index tables up, leaving columns down,
    entering columns up, then the new halves assembled and the params' entering columns
    written from the host master."""
    sharded = shard is not None and shard.sharded
    _upload_tables(dev, plans, link)
    _bring_leaving(plans, ops, link, shard if sharded else None)
    _send_entering(dev, plans, link, shard if sharded else None)
    return _assemble(plans, ops)


def _upload_tables(dev: torch.device, plans: list, link: Link) -> None:
    """Index tables for the device, in one non-blocking copy: per param new_dev, leave_pos,
    dev_pos, enter, new_host (as ``plan[key + "_d"]``)."""
    keys = ("new_dev", "leave_pos", "dev_pos", "enter", "new_host")
    flat = np.concatenate([plan[k] for plan in plans for k in keys]).astype(np.int64)
    on_dev = link.indices_to_device(flat, dev)
    off = 0
    for plan in plans:
        for k in keys:
            n = plan[k].size
            plan[k + "_d"] = on_dev[off:off + n]
            off += n


def _bring_leaving(plans: list, ops: KernelOps, link: Link, shard) -> None:
    """Columns leaving the device (fp32 master, m, v): gathered on the device, one blocking
    copy to the host for all params, rescaled to the host's step count (``plan["moved_host"]``;
    ``shard``: this rank keeps its rows of them)."""
    parts = []
    for plan in plans:
        st, p2d = plan["st"], view2d(plan["p"].detach())
        low = plan["p"].dtype != torch.float32
        master_src = (st["device_master"] if low
                      else ops.gather_columns(p2d, st["device_idx"], torch.float32))
        for src in (master_src, st["device_m"], st["device_v"]):
            parts.append(src.index_select(1, plan["leave_pos_d"]).reshape(-1))
    left = link.to_host(torch.cat(parts)) if parts else None
    off = 0
    for plan in plans:
        n = plan["rows"] * plan["leave"].size
        got = [left[off + j * n: off + (j + 1) * n].view(plan["rows"], plan["leave"].size)
               for j in range(3)]
        off += 3 * n
        if shard is not None:  # this rank keeps its rows of the columns that leave the device
            r0, r1 = shard.rows(plan["rows"])
            got = [g[r0:r1] for g in got]
        got[1].mul_(plan["to_host"][0])
        got[2].mul_(plan["to_host"][1])
        plan["moved_host"] = got


def _send_entering(dev: torch.device, plans: list, link: Link, shard) -> None:
    """Columns entering the device, from the host state: one non-blocking copy for all, every
    rank's rows gathered under ``shard``, rescaled to the device's step count
    (``plan["moved_dev"]``)."""
    host_parts = []
    for plan in plans:
        st = plan["st"]
        enter_pos = torch.from_numpy(plan["enter_pos"])
        for key in ("host_master", "host_m", "host_v"):
            host_parts.append(st[key].index_select(1, enter_pos).reshape(-1))
    entered = link.to_device_async(pinned(torch.cat(host_parts)), dev)
    off = 0
    for plan in plans:
        own = plan["st"]["host_master"].shape[0]  # this rank's rows (all of them unsharded)
        n = own * plan["enter"].size
        got = [entered[off + j * n: off + (j + 1) * n].view(own, plan["enter"].size)
               for j in range(3)]
        off += 3 * n
        plan["moved_dev"] = got
    if shard is not None:  # every rank's rows of the entering columns, on every rank
        parts = [t for plan in plans for t in plan["moved_dev"]]
        full = shard.gather_rows(parts, [plan["rows"] for plan in plans for _ in range(3)])
        for i, plan in enumerate(plans):
            plan["moved_dev"] = full[3 * i:3 * i + 3]
    for plan in plans:
        got = plan["moved_dev"]
        if plan["to_dev"] != (1.0, 1.0):
            got[1] = got[1] * plan["to_dev"][0]
            got[2] = got[2] * plan["to_dev"][1]
        plan["moved_dev"] = got


def _assemble(plans: list, ops: KernelOps) -> int:
    """The new halves: kept columns of the old half + the columns that moved in, in order;
    the params' entering columns written from the host master. Returns the columns moved."""
    moved = 0
    scatter = ([], [], [])
    for plan in plans:
        st, p = plan["st"], plan["p"]
        host_pos = torch.from_numpy(plan["host_pos"])
        mh, md = plan["moved_host"], plan["moved_dev"]

        def assemble_host(old, moved_cols):  # pageable host state, in the old half's dtype
            return torch.cat([old, moved_cols.to(old.dtype)], dim=1).index_select(1, host_pos)

        def assemble_dev(old, moved_cols):
            return torch.cat([old, moved_cols], dim=1).index_select(1, plan["dev_pos_d"])

        new_state = {
            "selected": True,
            "device_idx": plan["new_dev_d"].clone(),
            "device_m": assemble_dev(st["device_m"], md[1]),
            "device_v": assemble_dev(st["device_v"], md[2]),
            "device_step": plan["s_dev"],
            "host_idx": torch.from_numpy(plan["new_host"].copy()),
            "host_master": assemble_host(st["host_master"], mh[0]),
            "host_m": assemble_host(st["host_m"], mh[1]),
            "host_v": assemble_host(st["host_v"], mh[2]),
            "host_step": plan["s_host"],
            "acc": None,  # the next window that accumulates makes one of the new width
        }
        if p.dtype != torch.float32:
            new_state["device_master"] = assemble_dev(st["device_master"], md[0])
        # Columns that enter the device take the host master's values (a low-precision
        # param then shows its rounded master); leaving ones keep theirs in the host master.
        scatter[0].append(view2d(p.detach()))
        scatter[1].append(plan["enter_d"])
        scatter[2].append(md[0])
        st.update(new_state)
        moved += plan["leave"].size + plan["enter"].size
    ops.scatter_columns_multi(*scatter)
    return int(moved)
