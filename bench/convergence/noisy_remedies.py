"""Screening experiments (issue 42), not library features: what explains the noisy task's
gap? Each remedy is applied by wrapping one library function, then a workload of the study
is trained and its final held-out metrics printed (to set beside the study's rows of the
same seeds).

``--remedy vkind``: the second moment a column carries across a migration.

The device half's ``v`` is an EMA of per-step squared gradients, the host half's an EMA of
squared window means, whose noise part is ``n`` times smaller. A column that changes owner
keeps its ``v`` (rescaled only for the step counts' bias corrections): leaving the device
its ``v`` is up to ``n`` times too large for the host's steps, entering it up to ``n`` times
too small for the device's; with ``beta2 = 0.999`` neither forgets within a run. This run
converts it at migration, per element, under the model ``g = mu + noise``: to the host
``v' = m^2 + (v - m^2) / n``, to the device ``v' = m^2 + n (v - m^2)`` (bias-corrected
``m`` and ``v``; ``n = update_interval``), by wrapping the migration's plan, then trains a
workload of the study with it and prints the final held-out metrics beside the study's
rows of the same seeds.

``--remedy betas``: the host moments' time constants in steps. The host's ``m`` and ``v``
are EMAs over windows with AdamW's per-step betas, so they remember ``n`` times longer in
steps than AdamW's (``beta1 = 0.9``: 10 windows = 40 steps at ``n = 4``, against 10 steps).
This run gives each window the betas of ``n`` steps: ``beta1**n``, ``beta2**n``;
``--remedy beta1`` only the first moment's (over a run shorter than ``1 / (1 - beta2)``
steps both v's are close to plain means of the run's windows).

    python bench/convergence/noisy_remedies.py --remedy vkind --seeds 0 1 --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from study import WORKLOADS  # noqa: E402
from train import OPTIMIZERS, run  # noqa: E402
from workloads import BUILDERS  # noqa: E402

import zenflow_triton.columns.migration as MG  # noqa: E402
import zenflow_triton.host.window as W  # noqa: E402


def convert_v(n: int) -> None:
    """Wrap the migration so the moving columns' v changes kind (see the docstring). The
    columns are converted where they sit before the move (the device half's leaving ones on
    the device, the host half's entering ones on the host), in place."""
    plan = MG._plan

    def wrapped(mv, rows, cols, owner_old, owner_new):
        out = plan(mv, rows, cols, owner_old, owner_new)
        st = mv.st
        b1, b2 = mv.beta1, mv.beta2
        for side, pos, s in (("device", out["leave_pos"], out["s_dev"]),
                             ("host", out["enter_pos"], out["s_host"])):
            if len(pos) == 0 or s == 0:
                continue
            m, v = st[f"{side}_m"], st[f"{side}_v"]
            idx = torch.as_tensor(pos, dtype=torch.long, device=m.device)
            mh = m[:, idx].float() / (1 - b1 ** s)
            vh = v[:, idx].float() / (1 - b2 ** s)
            var = (vh - mh * mh).clamp_min(0)
            new = mh * mh + (var / n if side == "device" else var * n)
            v[:, idx] = (new * (1 - b2 ** s)).to(v.dtype)
        return out

    MG._plan = wrapped


def window_betas(which: tuple[str, ...] = ("beta1", "beta2")) -> None:
    """Wrap the host step's hyperparameters so a window of ``n`` gradients decays the
    moments named in ``which`` as ``n`` AdamW steps would (``beta ** n``)."""
    make = W.HostHyper

    def hyper(**kw):
        n = kw.get("grad_divisor", 1.0)
        return make(**dict(kw, **{b: kw[b] ** n for b in which}))

    W.HostHyper = hyper


REMEDIES = ("vkind", "betas", "beta1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="minilm-tweets", choices=list(WORKLOADS))
    ap.add_argument("--optimizer", default="zenflow-adaptive-dense", choices=list(OPTIMIZERS))
    ap.add_argument("--remedy", nargs="+", default=["vkind"], choices=REMEDIES)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = OPTIMIZERS[args.optimizer]
    lr, steps, every, options, *more = WORKLOADS[args.workload]
    n = (cfg or {}).get("update_interval", 4)
    if "vkind" in args.remedy:
        convert_v(n)
    if "betas" in args.remedy:
        window_betas()
    elif "beta1" in args.remedy:
        window_betas(("beta1",))
    rows = []
    for seed in args.seeds:
        out = run(BUILDERS[args.workload](seed, **options), zenflow=cfg, lr=lr, steps=steps,
                  eval_every=every, **(more[0] if more else {}))
        r = dict(workload=args.workload, seed=seed, remedy="+".join(args.remedy),
                 optimizer=f"{args.optimizer}-{'-'.join(args.remedy)}", **out)
        rows.append(r)
        print(json.dumps({k: r[k] for k in ("workload", "optimizer", "seed", "final")}),
              flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
