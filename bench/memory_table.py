"""Bytes per parameter the optimizer holds on the device and on the host, for every mode.

A model of 16 bf16 matrices of 1024 x 1024, 9 steps, then ``opt.stats()``:
``device_state_bytes``, ``host_state_bytes`` and ``host_pinned_bytes`` (the link buffers,
pinned where CUDA exists), each divided by the number of param elements. The first row is
``torch.optim.AdamW`` on an fp32 master copy of the params (mixed precision: master, m and
v on the device), counted the same way. The bf16 params and gradients themselves (4 B) are
the framework's and are not counted in any row.

    python bench/memory_table.py            # the table of docs/memory.md
"""

from __future__ import annotations

import sys

import torch

MODES = [
    ("ZeRO-Offload mode (`topk_ratio=0, update_interval=1, overlap=False`)",
     dict(topk_ratio=0.0, update_interval=1, overlap=False)),
    ("ZeRO-Offload mode, overlapped (`topk_ratio=0, update_interval=1`)",
     dict(topk_ratio=0.0, update_interval=1)),
    ("defaults (`topk_ratio=0.1, update_interval=4`)", {}),
    ("defaults, `host_state_dtype=\"bfloat16\"`", dict(host_state_dtype="bfloat16")),
    ("defaults, `accumulator_dtype=\"bfloat16\"`", dict(accumulator_dtype="bfloat16")),
    ("defaults, both bf16 options",
     dict(host_state_dtype="bfloat16", accumulator_dtype="bfloat16")),
    ("`accumulate_on=\"host\"`", dict(accumulate_on="host")),
    ("`accumulate_on=\"host\"`, both bf16 options",
     dict(accumulate_on="host", host_state_dtype="bfloat16", accumulator_dtype="bfloat16")),
]


def model16(n: int = 16, size: int = 1024):
    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(size, size, bias=False)
                                for _ in range(n)]).to(torch.bfloat16)


def grads_for(model, gen):
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype)


def zenflow_row(cfg: dict, steps: int = 9, **model_kw) -> dict[str, float]:
    from zenflow_triton import ZenFlowOptimizer

    model = model16(**model_kw)
    n = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    with ZenFlowOptimizer(model.parameters(), lr=1e-3, **cfg) as opt:
        for _ in range(steps):
            grads_for(model, gen)
            opt.step()
        st = opt.stats()
    return {k: st[k] / n for k in ("device_state_bytes", "host_state_bytes",
                                   "host_pinned_bytes")}


def adamw_row(steps: int = 2, **model_kw) -> dict[str, float]:
    """torch.optim.AdamW on fp32 master copies of the bf16 params: master + its state."""
    model = model16(**model_kw)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for m in masters:
            m.grad = torch.randn(m.shape, generator=gen) * 1e-2
        opt.step()
    held = sum(m.numel() * m.element_size() for m in masters)
    held += sum(t.numel() * t.element_size() for st in opt.state.values()
                for t in st.values() if isinstance(t, torch.Tensor))
    n = sum(m.numel() for m in masters)
    return dict(device_state_bytes=held / n, host_state_bytes=0.0, host_pinned_bytes=0.0)


def table(**model_kw) -> str:
    lines = ["| mode | device B/param | host B/param | of which pinned |",
             "| --- | --- | --- | --- |"]
    rows = [("`torch.optim.AdamW`, mixed precision (fp32 master, m, v)", adamw_row(**model_kw))]
    rows += [(label, zenflow_row(cfg, **model_kw)) for label, cfg in MODES]
    for label, r in rows:
        lines.append(f"| {label} | {r['device_state_bytes']:.2f} | "
                     f"{r['host_state_bytes']:.2f} | {r['host_pinned_bytes']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
