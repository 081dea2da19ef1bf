"""Who owns what: device-owned vs host-owned columns of each matrix param.

A matrix param's optimizer state (a plain dict in ``optimizer.state[p]``, so it shows in
``state_dict``) holds two compact halves:

* ``device_idx`` [k] sorted, ``device_m``/``device_v`` fp32 [rows, k] on the param's device,
  ``device_master`` fp32 [rows, k] when the param is bf16/fp16, ``device_step``;
* ``host_idx`` [n] sorted (the complement), ``host_master``/``host_m``/``host_v`` fp32
  [rows, n] in host memory, ``host_step``.

Each half has one Adam step count. Migration moves a column's fp32 master and moments
between halves and rescales the moments so their bias-corrected values are unchanged under
the destination's step count: m' = m * (1 - b1**s_dst) / (1 - b1**s_src), same for v with b2.
"""

from __future__ import annotations

import torch

from .config import ZenFlowConfig
from .kernels import KernelOps
from .transfer import Link, host_zeros, pinned

MATRIX = "matrix"
SMALL = "small"


def classify(p: torch.Tensor, cfg: ZenFlowConfig) -> str:
    """MATRIX params are split by columns; SMALL ones are device-owned entirely."""
    return MATRIX if p.dim() >= 2 and p.numel() >= cfg.min_offload_numel else SMALL


def shape2d(p: torch.Tensor) -> tuple[int, int]:
    rows = p.shape[0]
    return rows, p.numel() // rows


def view2d(t: torch.Tensor) -> torch.Tensor:
    """The [rows, cols] view of a param or its grad (a grad may be non-contiguous: reshape)."""
    rows = t.shape[0]
    return t.reshape(rows, t.numel() // rows)


def num_selected(cols: int, topk_ratio: float) -> int:
    """k = round(topk_ratio * cols); at least 1 when topk_ratio > 0, none at 0."""
    if topk_ratio <= 0.0:
        return 0
    return min(cols, max(1, round(topk_ratio * cols)))


def select_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest scores; ties go to the lower index (stable sort), so
    every rank given the same scores picks the same set."""
    if k == 0:
        return torch.empty(0, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, descending=True, stable=True).indices[:k]
    return torch.sort(order).values


def complement(idx: torch.Tensor, cols: int) -> torch.Tensor:
    mask = torch.ones(cols, dtype=torch.bool, device=idx.device)
    mask[idx] = False
    return mask.nonzero().view(-1)


def moment_scales(beta1: float, beta2: float, s_src: int, s_dst: int) -> tuple[float, float]:
    """Factors that keep m/(1-b1**s) and v/(1-b2**s) unchanged from s_src to s_dst."""
    if s_src == s_dst or s_src == 0:  # equal counts, or state never updated (all zeros)
        return 1.0, 1.0
    return ((1.0 - beta1 ** s_dst) / (1.0 - beta1 ** s_src),
            (1.0 - beta2 ** s_dst) / (1.0 - beta2 ** s_src))


def init_matrix_state(p: torch.Tensor, link: Link, accumulate_on: str) -> dict:
    """Every column host-owned, zero moments, fp32 master copied from the param."""
    rows, cols = shape2d(p)
    dev = p.device
    return {
        "kind": MATRIX,
        "selected": False,
        "device_idx": torch.empty(0, dtype=torch.long, device=dev),
        "device_m": torch.zeros(rows, 0, device=dev),
        "device_v": torch.zeros(rows, 0, device=dev),
        **({"device_master": torch.zeros(rows, 0, device=dev)}
           if p.dtype != torch.float32 else {}),
        "device_step": 0,
        "host_idx": torch.arange(cols, dtype=torch.long),
        "host_master": link.to_host(view2d(p.detach()), dtype=torch.float32).contiguous(),
        "host_m": host_zeros((rows, cols)),
        "host_v": host_zeros((rows, cols)),
        "host_step": 0,
        "acc": new_accumulator(rows, cols, dev, accumulate_on),
        "acc_count": 0,
        "host_pending": False,
    }


def new_accumulator(rows: int, n: int, device: torch.device, accumulate_on: str):
    if accumulate_on == "device":
        return torch.zeros(rows, n, device=device)
    return host_zeros((rows, n))


def migrate(p: torch.Tensor, st: dict, new_idx: torch.Tensor, *, beta1: float, beta2: float,
            ops: KernelOps, link: Link, accumulate_on: str) -> int:
    """Make ``new_idx`` the device-owned columns of ``p``; return how many columns moved.

    Preconditions (the optimizer drains first): no host work in flight for ``p``, its host
    result applied, its accumulator empty.
    """
    assert st["acc_count"] == 0 and not st["host_pending"], "migrate needs a drained param"
    rows, cols = shape2d(p)
    dev = p.device
    old_dev = st["device_idx"]
    old_host = st["host_idx"]
    new_dev = new_idx.to(dev)
    owner_new = torch.zeros(cols, dtype=torch.bool)
    owner_new[new_dev.cpu()] = True
    owner_old = torch.zeros(cols, dtype=torch.bool)
    owner_old[old_dev.cpu()] = True
    if torch.equal(owner_new, owner_old):
        st["selected"] = True
        return 0

    # An empty half has no state: adopt the other half's step count, so nothing rescales.
    s_dev, s_host = st["device_step"], st["host_step"]
    if old_dev.numel() == 0:
        s_dev = s_host
    elif old_host.numel() == 0:
        s_host = s_dev
    elif s_host == 0:  # host half never updated (all zero): it starts at the device count
        s_host = s_dev
    elif s_dev == 0:
        s_dev = s_host
    to_dev_m, to_dev_v = moment_scales(beta1, beta2, s_host, s_dev)
    to_host_m, to_host_v = moment_scales(beta1, beta2, s_dev, s_host)

    p2d = view2d(p.detach())
    low_precision = p.dtype != torch.float32

    # Full-width fp32 staging of each half's state, indexed by global column. Device side:
    # master is the param itself for fp32 params (no round trip through a narrower dtype).
    dev_master_src = st["device_master"] if low_precision else ops.gather_columns(
        p2d, old_dev, torch.float32)
    leaving_dev = owner_old & ~owner_new   # device -> host
    entering_dev = owner_new & ~owner_old  # host -> device

    def pos_in(idx_cpu: torch.Tensor) -> torch.Tensor:
        pos = torch.full((cols,), -1, dtype=torch.long)
        pos[idx_cpu] = torch.arange(idx_cpu.numel())
        return pos

    pos_dev = pos_in(old_dev.cpu())
    pos_host = pos_in(old_host.cpu())
    new_dev_cpu = new_dev.cpu()
    new_host_cpu = complement(new_dev_cpu, cols)

    # Bring the leaving device columns to the host (counted), rescaled.
    leave_cols = leaving_dev.nonzero().view(-1)
    leave_pos = pos_dev[leave_cols].to(dev)
    moved_master = link.to_host(dev_master_src.index_select(1, leave_pos))
    moved_m = link.to_host(st["device_m"].index_select(1, leave_pos)).mul_(to_host_m)
    moved_v = link.to_host(st["device_v"].index_select(1, leave_pos)).mul_(to_host_v)
    # Send the entering host columns to the device (counted), rescaled.
    enter_cols = entering_dev.nonzero().view(-1)
    enter_pos = pos_host[enter_cols]
    in_master = link.to_device(st["host_master"].index_select(1, enter_pos), dev)
    in_m = link.to_device(st["host_m"].index_select(1, enter_pos), dev).mul_(to_dev_m)
    in_v = link.to_device(st["host_v"].index_select(1, enter_pos), dev).mul_(to_dev_v)

    # A new half = kept columns of the old half + the columns that moved in, in column order.
    def assemble(new_cols, old_src, pos_old, moved_src, moved_cols):
        pos_moved = pos_in(moved_cols) + old_src.shape[1]
        pos = torch.where(pos_old >= 0, pos_old, pos_moved)[new_cols]
        both = torch.cat([old_src, moved_src.to(old_src.device)], dim=1)
        return both.index_select(1, pos.to(old_src.device))

    host_master = pinned(assemble(new_host_cpu, st["host_master"], pos_host, moved_master,
                                  leave_cols))
    host_m = pinned(assemble(new_host_cpu, st["host_m"], pos_host, moved_m, leave_cols))
    host_v = pinned(assemble(new_host_cpu, st["host_v"], pos_host, moved_v, leave_cols))
    dev_m = assemble(new_dev_cpu, st["device_m"], pos_dev, in_m, enter_cols)
    dev_v = assemble(new_dev_cpu, st["device_v"], pos_dev, in_v, enter_cols)
    if low_precision:
        st["device_master"] = assemble(new_dev_cpu, st["device_master"], pos_dev, in_master,
                                       enter_cols)
    # Columns leaving the device take their fp32 values into the host master; columns that
    # enter the device take the host master's values (written to the param below, so a
    # low-precision param shows its rounded master).
    ops.scatter_columns(p2d, enter_cols.to(dev), in_master)

    st.update({
        "selected": True,
        "device_idx": new_dev,
        "device_m": dev_m, "device_v": dev_v, "device_step": s_dev,
        "host_idx": new_host_cpu,
        "host_master": host_master, "host_m": host_m, "host_v": host_v, "host_step": s_host,
        "acc": new_accumulator(rows, new_host_cpu.numel(), dev, accumulate_on),
    })
    return int(leave_cols.numel() + enter_cols.numel())
