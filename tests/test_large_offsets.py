"""Params past 2**31 elements: launch arguments and tables keep every size and offset exact.

A 3 x 2**30-element bf16 matrix ([49152, 65536]) and a flat param of as many elements, on
the ``meta`` device (shapes without memory), through each launcher with the launches
recorded and not run (``tests/specialisations.py``). Checked: the tables a multi-tensor
launch sends (int64, the sizes and tile counts exact), each launch's grid (below CUDA's
2**31 - 1 programs), and the argument types Triton's binder gives the single-param kernels'
sizes (i64 where a value passes 2**31). The kernels' own index arithmetic is checked on
their IR by ``gpu_compile_check.py`` (``tests/ir_checks.py``: no i32 product of a runtime
size).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from zenflow_triton.kernels import triton_available

pytestmark = pytest.mark.skipif(not triton_available()[0], reason=triton_available()[1])

ROWS, COLS = 49152, 65536  # 3 * 2**30 elements
BIG = ROWS * COLS


@pytest.fixture
def sent(monkeypatch):
    """The host arrays each launch turns into device tables, in order."""
    from zenflow_triton.kernels import _multi

    out = []
    real = _multi.to_device_table

    def spy(rows, device):
        out.append(np.array(rows, copy=True))
        return real(rows, device)

    monkeypatch.setattr(_multi, "to_device_table", spy)
    monkeypatch.setattr(_multi, "_cache", type(_multi._cache)())  # no hits from other tests
    return out


def test_multi_tensor_tables_past_2_31(sent):
    from zenflow_triton.kernels import adamw, selective_adamw_multi

    from .support.specialisations import recording

    meta = torch.device("meta")
    p = torch.empty(ROWS, COLS, dtype=torch.bfloat16, device=meta)
    k, n = 6554, COLS - 6554
    dev_idx = torch.empty(k, dtype=torch.int64, device=meta)
    host_idx = torch.empty(n, dtype=torch.int64, device=meta)
    state = [torch.empty(ROWS, k, device=meta) for _ in range(3)]
    acc = torch.empty(ROWS, n, device=meta)
    flat = torch.empty(BIG, dtype=torch.bfloat16, device=meta)
    flat_state = [torch.empty(BIG, device=meta) for _ in range(3)]
    with recording(dry=True) as rec:
        selective_adamw_multi.selective_adamw_accumulate(
            [p], [p], [dev_idx], [state[0]], [state[1]], [state[2]], [3], [acc], [host_idx],
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
        adamw.adamw_multi([flat], [flat], [flat_state[0]], [flat_state[1]], [flat_state[2]],
                          [3], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert [name for name, _ in rec.launches] == [
        "selective_adamw_multi._selective_adamw_accumulate_kernel", "adamw._adamw_multi_kernel"]
    rows_tab, cum_tab, _, flat_tab, flat_cum, _ = sent
    for tab in (rows_tab, cum_tab, flat_tab, flat_cum):
        assert tab.dtype == np.int64
    # selective: ROWS, k, n exact; adamw: the flat numel exact (past 2**31).
    assert rows_tab[0, 8:11].tolist() == [ROWS, k, n]
    assert BIG in flat_tab[0].tolist() and BIG > 2**31
    # Every program count fits a CUDA grid's x dimension; the tile counts add up exactly.
    for cum in (cum_tab, flat_cum):
        assert 0 < cum[-1] < 2**31 - 1
    from zenflow_triton.kernels import _launch
    block = _launch.block_1d(BIG)[0]
    assert flat_cum[-1] == _launch.cdiv(BIG, block)


def test_single_param_kernels_take_i64_sizes():
    """Sizes past 2**31 reach the single-param kernels as i64 (Triton's binder types a
    Python int by its value): the flat AdamW's numel; a gather from a transposed 3 x 2**30
    view launches with its sizes as given."""
    from zenflow_triton.kernels import adamw, columns

    from .support.specialisations import recording

    meta = torch.device("meta")
    flat = torch.empty(BIG, dtype=torch.bfloat16, device=meta)
    # A transposed view: its row stride is 1, its column stride ROWS; the gather's sizes
    # and strides each fit an i32, their products do not (the IR check covers those).
    big2d = torch.empty(COLS, ROWS, dtype=torch.bfloat16, device=meta).t()
    idx = torch.empty(7, dtype=torch.int64, device=meta)
    st = [torch.empty(BIG, device=meta) for _ in range(3)]
    with recording(dry=True) as rec:
        adamw.adamw_scalars_launch([flat], [flat], [st[0]], [st[1]], [st[2]], 1.0, 0.1,
                                   0.999, 0.001, 1e-8, [-1e-3], [1.0])
        columns.gather_columns(big2d, idx)
    (_, key), (_, gather_key) = rec.launches
    spec = dict(zip(["p_ptr", "g_ptr", "m_ptr", "v_ptr", "master_ptr", "n"], key[0]))
    assert spec["n"][0] == "i64", key
    gspec = [t for t, *_ in gather_key[0][3:7]]  # rows, k, stride_sr, stride_sc
    assert gspec == ["i32", "i32", "constexpr", "i32"], gather_key
