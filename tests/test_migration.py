"""Reselection moves fp32 masters and moments between owners without loss."""

from __future__ import annotations

import torch

from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.kernels import get_ops
from zenflow_triton.partition import init_matrix_state, migrate, select_columns
from zenflow_triton.transfer import Link

B1, B2 = 0.9, 0.99


def full_view(st, key_dev, key_host, cols):
    """Full-width [rows, cols] tensor assembled from the two compact halves."""
    rows = st[key_host].shape[0]
    out = torch.zeros(rows, cols)
    out[:, st["device_idx"]] = st[key_dev]
    out[:, st["host_idx"]] = st[key_host]
    return out


def corrected(st, cols):
    """Bias-corrected m and v of every column under its owner's step count."""
    m = torch.zeros(st["host_m"].shape[0], cols)
    v = torch.zeros_like(m)
    for side, s in (("device", st["device_step"]), ("host", st["host_step"])):
        idx = st[f"{side}_idx"]
        m[:, idx] = st[f"{side}_m"] / (1 - B1 ** s)
        v[:, idx] = st[f"{side}_v"] / (1 - B2 ** s)
    return m, v


def make_state(dtype):
    torch.manual_seed(0)
    p = torch.randn(5, 8).to(dtype)
    link = Link()
    ops = get_ops("torch")
    st = init_matrix_state(p, link, "device")
    migrate(p, st, torch.tensor([0, 1]), beta1=B1, beta2=B2, ops=ops, link=link,
            accumulate_on="device")
    # Give both halves distinct, non-trivial state and different step counts, as after
    # 8 device steps and 2 host windows.
    st["device_m"].copy_(torch.randn_like(st["device_m"]))
    st["device_v"].copy_(torch.rand_like(st["device_v"]))
    st["host_m"].copy_(torch.randn_like(st["host_m"]))
    st["host_v"].copy_(torch.rand_like(st["host_v"]))
    st["device_step"], st["host_step"] = 8, 2
    if dtype != torch.float32:
        st["device_master"].copy_(torch.randn_like(st["device_master"]))
        p[:, st["device_idx"]] = st["device_master"].to(dtype)
    return p, st, ops, link


def test_columns_moving_each_way_keep_their_adam_state():
    for dtype in (torch.float32, torch.bfloat16):
        p, st, ops, link = make_state(dtype)
        m0, v0 = corrected(st, 8)
        master_dev = (st["device_master"] if dtype != torch.float32
                      else p[:, st["device_idx"]].float()).clone()
        host_master = st["host_master"].clone()
        before = link.bytes_d2h, link.bytes_h2d
        # Column 1 leaves the device, column 6 enters it; column 0 stays.
        moved = migrate(p, st, torch.tensor([0, 6]), beta1=B1, beta2=B2, ops=ops, link=link,
                        accumulate_on="device")
        assert moved == 2
        assert st["device_idx"].tolist() == [0, 6]
        assert st["host_idx"].tolist() == [1, 2, 3, 4, 5, 7]
        m1, v1 = corrected(st, 8)
        torch.testing.assert_close(m1, m0, rtol=1e-6, atol=0)
        torch.testing.assert_close(v1, v0, rtol=1e-6, atol=0)
        # The raw moments did change (the step counts differ): the rescale was needed.
        assert not torch.allclose(st["device_m"][:, 1], st["host_m"][:, 5])
        # fp32 masters moved exactly, with no round trip through the param dtype.
        assert torch.equal(st["host_master"][:, 0], master_dev[:, 1])
        dev_master = st["device_master"] if dtype != torch.float32 else p[:, [0, 6]].float()
        assert torch.equal(dev_master[:, 1], host_master[:, 4])
        # The move crossed the link both ways (master + m + v of one column each way).
        assert link.bytes_d2h - before[0] == 3 * 5 * 4
        assert link.bytes_h2d - before[1] == 3 * 5 * 4
        assert st["acc"].shape == (5, 6)


def test_unchanged_selection_moves_nothing():
    p, st, ops, link = make_state(torch.float32)
    snap = {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
    assert migrate(p, st, torch.tensor([0, 1]), beta1=B1, beta2=B2, ops=ops, link=link,
                   accumulate_on="device") == 0
    for k, v in snap.items():
        assert torch.equal(st[k], v)


def test_selection_ties_go_to_lower_index():
    scores = torch.tensor([1.0, 3.0, 3.0, 0.5, 3.0])
    assert select_columns(scores, 2).tolist() == [1, 2]
    assert select_columns(scores, 0).numel() == 0
    assert select_columns(scores, 5).tolist() == [0, 1, 2, 3, 4]


def test_min_one_column_when_ratio_positive():
    from zenflow_triton.partition import num_selected
    assert num_selected(7, 0.01) == 1
    assert num_selected(7, 0.0) == 0
    assert num_selected(10, 0.25) == round(2.5)
    assert num_selected(3, 1.0) == 3
    assert ZenFlowConfig(topk_ratio=0.0).topk_ratio == 0.0
