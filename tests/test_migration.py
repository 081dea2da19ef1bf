"""Reselection moves fp32 masters and moments between owners without loss."""

from __future__ import annotations

import torch

from zenflow_triton.config import ZenFlowConfig
from zenflow_triton.kernels import get_ops
from zenflow_triton.state import init_matrix_state
from zenflow_triton.columns.migration import migrate
from zenflow_triton.columns.selection import select_columns
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
    st = init_matrix_state(p, link)
    migrate(p, st, torch.tensor([0, 1]), beta1=B1, beta2=B2, ops=ops, link=link)
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
        raw = {k: st[k].clone() for k in ("device_m", "device_v", "host_m", "host_v")}
        before = link.bytes_d2h, link.bytes_h2d
        # Column 1 leaves the device, column 6 enters it; column 0 stays.
        moved = migrate(p, st, torch.tensor([0, 6]), beta1=B1, beta2=B2, ops=ops, link=link)
        assert moved == 2
        assert st["device_idx"].tolist() == [0, 6]
        assert st["host_idx"].tolist() == [1, 2, 3, 4, 5, 7]
        m1, v1 = corrected(st, 8)
        torch.testing.assert_close(m1, m0, rtol=1e-6, atol=0)
        torch.testing.assert_close(v1, v0, rtol=1e-6, atol=0)
        # The raw moments of the moved columns did change (the step counts differ, so the
        # rescale was needed): column 6 was host position 4, column 1 device position 1.
        assert not torch.allclose(st["device_m"][:, 1], raw["host_m"][:, 4])
        assert not torch.allclose(st["device_v"][:, 1], raw["host_v"][:, 4])
        assert not torch.allclose(st["host_m"][:, 0], raw["device_m"][:, 1])
        # Column 0 stayed on the device, untouched.
        assert torch.equal(st["device_m"][:, 0], raw["device_m"][:, 0])
        # fp32 masters moved exactly, with no round trip through the param dtype.
        assert torch.equal(st["host_master"][:, 0], master_dev[:, 1])
        dev_master = st["device_master"] if dtype != torch.float32 else p[:, [0, 6]].float()
        assert torch.equal(dev_master[:, 1], host_master[:, 4])
        # The move crossed the link both ways (master + m + v of one column each way), plus
        # the int64 index tables the device needs: the new device columns (2), the leaving
        # column's position (1), the new device half's layout (2), the entering column (1)
        # and the new host columns (6).
        assert link.bytes_d2h - before[0] == 3 * 5 * 4
        assert link.bytes_h2d - before[1] == 3 * 5 * 4 + 8 * (2 + 1 + 2 + 1 + 6)
        assert st["acc"] is None  # the next window that accumulates makes one of 6 columns


def test_unchanged_selection_moves_nothing():
    p, st, ops, link = make_state(torch.float32)
    snap = {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
    assert migrate(p, st, torch.tensor([0, 1]), beta1=B1, beta2=B2, ops=ops, link=link) == 0
    for k, v in snap.items():
        assert torch.equal(st[k], v)


def test_selection_ties_go_to_lower_index():
    scores = torch.tensor([1.0, 3.0, 3.0, 0.5, 3.0])
    assert select_columns(scores, 2).tolist() == [1, 2]
    assert select_columns(scores, 0).numel() == 0
    assert select_columns(scores, 5).tolist() == [0, 1, 2, 3, 4]


def test_min_one_column_when_ratio_positive():
    from zenflow_triton.columns.selection import num_selected
    assert num_selected(7, 0.01) == 1
    assert num_selected(7, 0.0) == 0
    # round(topk_ratio * cols), halves to even as Python's round() and torch.round do
    assert num_selected(10, 0.25) == 2      # 2.5
    assert num_selected(14, 0.25) == 4      # 3.5
    assert num_selected(10, 0.27) == 3      # 2.7
    assert num_selected(3, 1.0) == 3
    assert ZenFlowConfig(topk_ratio=0.0).topk_ratio == 0.0


def test_migration_keeps_bias_corrected_moments_under_other_step_counts():
    """An outside oracle for the rescale: with a gradient that is constant in time, Adam's
    bias-corrected moments are exactly g and g^2 whatever the step count. Train 8 steps with
    windows of 4 (device count 8, host count 2), then make the device columns unimportant:
    at step 9 the selection moves them to the host and brings the next columns in. Each
    moved column must still hold m_hat = g, v_hat = g^2 under its new owner's count (the
    columns that came in have also taken step 9 with the same g: still g and g^2)."""
    from zenflow_triton import ZenFlowOptimizer

    rows, cols, k = 6, 10, 3
    gen = torch.Generator().manual_seed(0)
    # Column j's gradient: sign pattern times a magnitude that ranks the columns clearly.
    mags = torch.tensor([0.3, 2.0, 0.5, 1.4, 3.0, 0.8, 1.0, 2.5, 0.6, 1.7])
    g_const = torch.randn(rows, cols, generator=gen).sign() * mags
    top = torch.sort(mags, descending=True).indices
    first, second = sorted(top[:k].tolist()), sorted(top[k:2 * k].tolist())
    p = torch.nn.Parameter(torch.randn(rows, cols, generator=gen))
    opt = ZenFlowOptimizer([p], lr=1e-3, betas=(B1, B2), topk_ratio=k / cols,
                           update_interval=4, select_interval=8, overlap=False,
                           min_offload_numel=1)
    for t in range(1, 10):
        g = g_const.clone()
        if t == 9:
            g[:, first] *= 0.01  # the device columns drop out of the top k
        p.grad = g
        opt.step()
        st = opt.state_dict()["state"][0]
        if t == 8:
            assert st["device_idx"].tolist() == first
            assert (st["device_step"], st["host_step"]) == (8, 2)
    opt.close(finish=False)  # st holds the live state: leave it as the last step left it
    assert st["device_idx"].tolist() == second, "the selection did move"
    assert st["device_step"] == 9 and st["host_step"] == 2
    host_pos = {c: i for i, c in enumerate(st["host_idx"].tolist())}
    into_host = [host_pos[c] for c in first]  # moved to the host, not yet updated there
    for side, pos, cols_ in (("device", list(range(k)), second), ("host", into_host, first)):
        s = st[f"{side}_step"]
        m_hat = st[f"{side}_m"][:, pos] / (1 - B1 ** s)
        v_hat = st[f"{side}_v"][:, pos] / (1 - B2 ** s)
        torch.testing.assert_close(m_hat, g_const[:, cols_], rtol=1e-5, atol=0, msg=side)
        torch.testing.assert_close(v_hat, g_const[:, cols_] ** 2, rtol=1e-5, atol=0, msg=side)
