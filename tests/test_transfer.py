"""The transfer layer: byte counts, and the cast-on-host path of CopyQueue (the path a CUDA
copy with a dtype change takes; here driven directly on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

import zenflow_triton.transfer as transfer
from zenflow_triton.transfer import Link


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.bfloat16),
                                                 (torch.float32, torch.float16)])
@pytest.mark.parametrize("bounce", [1, 7, 1 << 20])
def test_cast_on_host_equals_copy(monkeypatch, src_dtype, dst_dtype, bounce):
    monkeypatch.setattr(transfer, "BOUNCE_ELEMS", bounce)
    g = torch.Generator().manual_seed(0)
    src = (torch.randn(13, 29, generator=g) * 3).to(src_dtype)
    want = torch.empty(13, 29, dtype=dst_dtype).copy_(src)
    got = torch.full((13, 29), float("nan"), dtype=dst_dtype)
    Link().copy_queue([torch.device("cpu")], timeout=5.0).copy_cast_on_host(got, src)
    assert torch.equal(got, want)


def test_cast_on_host_strided_source_and_bad_destination(monkeypatch):
    monkeypatch.setattr(transfer, "BOUNCE_ELEMS", 5)
    queue = Link().copy_queue(["cpu"], timeout=5.0)
    src = torch.randn(8, 6).t()  # non-contiguous source: fine
    got = torch.empty(6, 8, dtype=torch.bfloat16)
    queue.copy_cast_on_host(got, src)
    assert torch.equal(got, src.to(torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous destination"):
        queue.copy_cast_on_host(torch.empty(8, 6, dtype=torch.bfloat16).t(), src)
    with pytest.raises(ValueError, match="shape mismatch"):
        queue.copy_cast_on_host(torch.empty(48, dtype=torch.bfloat16), src)


def test_cpu_queue_is_plain_and_counts_are_per_direction():
    link = Link()
    queue = link.copy_queue(["cpu"], timeout=5.0)
    a, b = torch.randn(10), torch.empty(10)
    queue.copy(b, a)
    assert torch.equal(a, b)
    queue.zero_(a)
    queue.flush()
    assert not a.any()
    link.count_d2h(12)
    link.count_h2d(5)
    link.to_device(torch.ones(3, dtype=torch.float32), "cpu", dtype=torch.bfloat16)
    assert (link.bytes_d2h, link.bytes_h2d) == (12, 5 + 3 * 2)


@pytest.mark.parametrize("sum_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_copy_in_mean_is_fp32_division_rounded_once(sum_dtype, dst_dtype):
    """What a window sum crosses as: the fp32 quotient sum / n (true division), rounded once
    to the param's dtype, whatever the accumulator's dtype: a bf16 sum of an fp16 param is
    widened first (80000 / 4 fits in fp16, 80000 does not). On CUDA the same
    (tests/test_cuda_pipeline.py)."""
    from zenflow_triton.transfer import CopyIn

    gen = torch.Generator().manual_seed(0)
    total = (torch.randn(4096, generator=gen) * 3).to(sum_dtype)
    total[:4] = 80000.0
    for n in (3, 4, 7):
        want = (total.float() / n).to(dst_dtype)
        dst = torch.empty(4096, dtype=dst_dtype)
        src = total.clone()
        copy_in = CopyIn(Link(), [(dst, src, True, float(n))])
        copy_in.wait_on_host(timeout=5.0)
        assert torch.equal(dst, want), n
        assert torch.isfinite(dst).all()
        assert not src.any()  # zeroed after its copy
