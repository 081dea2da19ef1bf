"""How far the host-owned columns travel, how stale their updates are, and how the host's
second moment normalises them: a mechanism diagnostic of a ZenFlow setting against AdamW
(issue 42).

Two copies of a workload's model (``workloads.py``, the recipe of ``study.py``: its lr,
steps, schedule; clipping at 1.0, weight decay 0.01) train in lock-step from the same init
on the same batches (and the same dropout masks: the RNG state is replayed for the second
copy, so each copy's trajectory is the one ``study.py`` gives it alone): one with
``torch.optim.AdamW``, one with ``ZenFlowOptimizer`` at a setting. ZenFlow's pending host
results are applied every ``--drain-every`` steps (``opt.eval()``), as the study's held-out
evaluations do, so the ZenFlow trajectory is the study's too; the held-out metrics are
computed only at the end.

Every ``--every`` steps (default 24: a multiple of windows of 4 and 8) and at the end,
per split matrix and summed over all of them:

(a) travel: the RMS displacement from the init of the columns that stayed host-owned the
    whole run (never selected), of those device-owned at every step, and of the rest, under
    ZenFlow and under AdamW (the same columns), their ratio, and the projection of ZenFlow's
    displacement on AdamW's (``<dz, da> / <da, da>``: the share of AdamW's path travelled
    along it) and their cosine. The params as the forward pass sees them (host-owned columns
    as of their last apply).
(b) staleness: for each host window, the steps from each of its gradients to the step that
    applies it (the forward pass after that step is the first to see it; AdamW's is 0). The
    config fixes it (``d`` to ``d + n - 1``, ``d = apply_delay``, ``n = update_interval``)
    except where a reselection or a drain applies a window early; both are measured (an
    apply is seen as a change of the param's host-owned columns) and stated.
(c) normalisation: over the coordinates of the never-selected columns, a script-side
    per-step EMA of ``g^2`` (``beta2`` per step, bias-corrected: AdamW's ``v_hat`` on the
    gradients ZenFlow saw, after clipping) against the host's own ``v_hat`` (``host_v`` of
    ``opt.state[p]``, bias-corrected by ``host_step``): ``q = v_step_hat / v_host_hat``
    (``n`` for a noise-dominated coordinate, 1 for a steady one) and the effective
    per-coordinate step ratio ``e = (c / n) * sqrt(q)`` (one host step of multiplier ``c``
    against ``n`` AdamW steps, same ``m``; 1 = AdamW's travel per window), their 10th/50th/
    90th percentiles. ``c`` is the multiplier of the window the host ran last (the host
    pipeline's record of the adaptive rule; the fixed rules' from ``step_size``), ``cap``
    the trust cap of ``step_size.cap_of_sums``. The host moments are read after
    ``opt.state_dict()`` has waited for the job in flight (which changes nothing), at the
    last window boundary; the script EMA is taken at the same step. Also ``q`` of the
    columns that changed owner at a reselection (a migrated column takes its ``v`` along,
    rescaled to the destination's step count but not to its gradient's kind): host-owned
    ones that were device-owned (``q_host_moved``), device-owned ones that were host-owned
    (``q_dev_moved``: ``v_step_hat / device v_hat``) and, for reference, those device-owned
    every step (``q_dev_always``, about 1).

    PYTHONPATH=. HF_HUB_OFFLINE=1 python bench/convergence/travel.py --workload minilm-tweets \\
        --seed 0 --setting 0.1x4 --json bench/convergence/data/travel_tweets_0.1x4_s0.json

``--setting KxN[/selW][/applyD]`` (``topk_ratio=K, update_interval=N``; the other fields are
the library's defaults, e.g. ``host_lr_scale="adaptive"`` and the dense set), plus
``--set key=value`` for any other config field (``--set host_lr_scale=auto``).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from study import WORKLOADS  # noqa: E402
from workloads import BUILDERS  # noqa: E402

from zenflow_triton import ZenFlowOptimizer  # noqa: E402
from zenflow_triton.host import step_size as SS  # noqa: E402
from zenflow_triton.schedule import plan_step  # noqa: E402
from zenflow_triton.state import MATRIX, classify  # noqa: E402

PCTS = (10, 50, 90)
PROBE = 64  # host-owned columns of row 0 watched for applies


def parse_setting(text: str, extra: list[str]) -> dict:
    """``"0.02x8/sel2/apply4"`` plus ``["host_lr_scale=auto"]`` -> config fields."""
    main, *mods = text.split("/")
    k, ui = main.split("x")
    out: dict = dict(topk_ratio=float(k), update_interval=int(ui))
    for m in mods:
        if m.startswith("sel"):
            out["select_interval"] = int(m[3:]) * out["update_interval"]
        elif m.startswith("apply"):
            out["apply_delay"] = int(m[5:])
        else:
            raise ValueError(f"bad setting modifier {m!r}")
    for kv in extra:
        key, _, val = kv.partition("=")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def pct(x: np.ndarray) -> list[float]:
    return [float(v) for v in np.percentile(x, PCTS)] if x.size else [math.nan] * 3


class Matrix:
    """What the script keeps of one split matrix (fp32 CPU, its [rows, cols] view)."""

    def __init__(self, name: str, pz: torch.Tensor, pa: torch.Tensor) -> None:
        self.name, self.pz, self.pa = name, pz, pa
        self.rows = pz.shape[0]
        self.cols = pz.numel() // self.rows
        self.w0 = self.view(pz).clone()
        self.ema = torch.zeros(self.rows, self.cols)  # per-step EMA of g^2 (ZenFlow's grads)
        self.ema_b = None  # ... as of the last window boundary
        self.dev_steps = torch.zeros(self.cols, dtype=torch.long)  # steps device-owned
        self.probe_cols = None
        self.probe_vals = None
        self.launches: list[tuple[int, int]] = []  # (step, gradients in the window)
        self.applies: list[tuple[int, int]] = []  # (step, 0 in the step / 1 at a drain)
        self.travel: list[dict] = []  # per checkpoint: per-column sums (float64 numpy)
        self.c: dict[int, float] = {}  # launch step -> multiplier

    def view(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(self.rows, self.cols)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="minilm-tweets", choices=list(WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--setting", default="0.1x4")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--every", type=int, default=24)
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop after this step (the schedule stays that of --steps): smoke tests")
    ap.add_argument("--drain-every", type=int, default=None,
                    help="apply ZenFlow's pending results every this many steps, as the "
                         "study's evaluations do (default: the workload's eval_every)")
    ap.add_argument("--no-heldout", action="store_true", help="skip the final evaluation")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lr, steps, eval_every, options, *more = WORKLOADS[args.workload]
    schedule = (more[0] if more else {}).get("schedule", "constant")
    steps = args.steps or steps
    drain_every = args.drain_every or eval_every
    setting = parse_setting(args.setting, args.set)
    t_start = time.perf_counter()

    job = BUILDERS[args.workload](args.seed, **options)
    model_z = job.model
    model_a = copy.deepcopy(model_z)
    model_z.train()
    model_a.train()
    named_z = [(n, p) for n, p in model_z.named_parameters() if p.requires_grad]
    named_a = dict((n, p) for n, p in model_a.named_parameters() if p.requires_grad)
    params_z = [p for _, p in named_z]
    params_a = [named_a[n] for n, _ in named_z]
    opt_a = torch.optim.AdamW(params_a, lr=lr, weight_decay=0.01)
    opt_z = ZenFlowOptimizer(named_z, lr=lr, weight_decay=0.01,
                             **{"fresh_if_spread": False, **setting})
    cfg = opt_z.config
    n_win = cfg.update_interval
    delay = cfg.effective_apply_delay if cfg.overlap else 0  # overlap=False: in the step
    b1, b2 = opt_z.param_groups[0]["betas"]
    warm = max(1, int(0.1 * steps))

    def factor(s: int) -> float:  # as train.run
        if s + 1 < warm or schedule == "constant":
            return min(1.0, (s + 1) / warm)
        return max(0.0, (steps - s) / (steps - warm + 1))

    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, factor)
    sched_z = torch.optim.lr_scheduler.LambdaLR(opt_z, factor)
    mats = [Matrix(n, p, named_a[n]) for n, p in named_z
            if classify(p, cfg, n) == MATRIX]  # the split matrices, as the optimizer will
    lr_at: dict[int, float] = {}
    checkpoints: list[dict] = []
    b_step = 0

    def probe(m: Matrix, st: dict, step: int, phase: int) -> None:
        """Record an apply when the watched host-owned columns of row 0 changed."""
        host = st["host_idx"]
        row = m.view(m.pz)[0]
        if m.probe_cols is not None:
            still = torch.isin(m.probe_cols, host)
            if still.any() and not torch.equal(row[m.probe_cols[still]],
                                               m.probe_vals[still]):
                m.applies.append((step, phase))
        m.probe_cols = host[:: max(1, host.numel() // PROBE)][:PROBE].clone()
        m.probe_vals = row[m.probe_cols].clone()

    def checkpoint(step: int, boundary_step: int) -> dict:
        opt_z.state_dict()  # waits for the host job in flight; changes nothing
        mult = dict(opt_z._pipeline.multipliers)  # noqa: SLF001 (read only)
        out = dict(step=step, boundary_step=boundary_step, lr=opt_z.param_groups[0]["lr"],
                   matrices=[])
        agg = {"q": [], "e": [], "v_step_over_adamw": [], "q_host_moved": [],
               "q_dev_moved": [], "q_dev_always": []}
        sums = {cls: np.zeros(3) for cls in ("host", "device", "mixed")}
        counts = {cls: 0 for cls in sums}
        for m in mats:
            st = opt_z.state[m.pz]
            dz = (m.view(m.pz) - m.w0).double()
            da = (m.view(m.pa) - m.w0).double()
            m.travel.append(dict(step=step, zz=(dz * dz).sum(0).numpy(),
                                 aa=(da * da).sum(0).numpy(), za=(dz * da).sum(0).numpy()))
            row = dict(name=m.name, rows=m.rows, cols=m.cols)
            # (c) the never-selected columns so far, at the last boundary
            host_idx = st["host_idx"]
            keep = m.dev_steps[host_idx] == 0
            cols = host_idx[keep]
            hs = st["host_step"]
            if hs > 0 and m.ema_b is not None and cols.numel():
                v_host = st["host_v"][:, keep].float() / (1 - b2 ** hs)
                v_step = m.ema_b[:, cols] / (1 - b2 ** boundary_step)
                q = (v_step / v_host.clamp_min(1e-30)).reshape(-1).numpy()
                if cfg.host_lr_scale == "adaptive":
                    c = mult.get(m.pz, math.nan)
                else:
                    c = SS.fixed_multiplier(cfg.host_lr_scale, n_win)
                e = (c / n_win) * np.sqrt(q)
                sa = opt_a.state.get(m.pa)
                if sa:
                    va = adamw_vhat(sa, b2, m)[:, cols]
                    r_a = (v_step / va.clamp_min(1e-30)).reshape(-1).numpy()
                    agg["v_step_over_adamw"].append(r_a)
                    row["v_step_over_adamw_pct"] = pct(r_a)
                sums_s = SS.sample_sums(st["host_master"], st["host_m"], st["host_v"])
                cap = SS.cap_of_sums(sums_s, lr_at.get(boundary_step, out["lr"]))
                rho = SS.fraction_of_sums(sums_s, hs, b1, b2)
                row.update(c=c, cap=cap, rho_next=rho, host_step=hs,
                           never_selected_cols=int(cols.numel()), q_pct=pct(q), e_pct=pct(e))
                agg["q"].append(q)
                agg["e"].append(e)
            # the columns that changed owner: a migrated column keeps its v (rescaled to the
            # destination's count), a per-step one on the host or a window-mean one on the
            # device; against the per-step EMA as of now
            moved = host_idx[m.dev_steps[host_idx] > 0]
            if hs > 0 and moved.numel():
                v_host = st["host_v"][:, m.dev_steps[host_idx] > 0].float() / (1 - b2 ** hs)
                qm = (m.ema_b[:, moved] / (1 - b2 ** boundary_step)
                      / v_host.clamp_min(1e-30)).reshape(-1).numpy()
                agg["q_host_moved"].append(qm)
                row["q_host_moved_pct"] = pct(qm)
            dev_idx = st["device_idx"].cpu()
            ds = st["device_step"]
            if ds > 0 and dev_idx.numel():
                v_dev = st["device_v"].cpu().float() / (1 - b2 ** ds)
                qd = m.ema[:, dev_idx] / (1 - b2 ** step) / v_dev.clamp_min(1e-30)
                was_host = m.dev_steps[dev_idx] < step
                for key, sel in (("q_dev_moved", was_host), ("q_dev_always", ~was_host)):
                    if sel.any():
                        x = qd[:, sel].reshape(-1).numpy()
                        agg[key].append(x)
                        row[key + "_pct"] = pct(x)
            out["matrices"].append(row)
        for k, parts in agg.items():
            out[f"{k}_pct"] = pct(np.concatenate(parts)) if parts else [math.nan] * 3
        cs = [r["c"] for r in out["matrices"] if "c" in r]
        caps = [r["cap"] for r in out["matrices"] if "cap" in r]
        out["c_mean"] = float(np.mean(cs)) if cs else math.nan
        out["c_range"] = [float(min(cs)), float(max(cs))] if cs else None
        out["capped"] = int(sum(1 for c, k in zip(cs, caps) if c >= k - 1e-9)) if cs else 0
        return out

    def adamw_vhat(sa: dict, beta2: float, m: Matrix) -> torch.Tensor:
        step = float(sa["step"])
        return m.view(sa["exp_avg_sq"]) / (1 - beta2 ** step)

    t0 = time.perf_counter()
    last = min(steps, args.stop_at or steps)
    for step in range(1, last + 1):
        batch = next(job.batches)
        rng = torch.get_rng_state()
        loss_a = job.loss_fn(model_a, batch)
        opt_a.zero_grad(set_to_none=True)
        loss_a.backward()
        torch.nn.utils.clip_grad_norm_(params_a, 1.0)
        opt_a.step()
        sched_a.step()
        torch.set_rng_state(rng)  # the same dropout masks for the ZenFlow copy
        loss_z = job.loss_fn(model_z, batch)
        opt_z.zero_grad(set_to_none=True)
        loss_z.backward()
        torch.nn.utils.clip_grad_norm_(params_z, 1.0)
        if step == 1:  # a param that gets no gradient (the unused pooler) is never split
            mats = [m for m in mats if m.pz.grad is not None]
        for m in mats:
            g = m.view(m.pz.grad).float()
            m.ema.mul_(b2).addcmul_(g, g, value=1 - b2)
        lr_now = opt_z.param_groups[0]["lr"]
        plan = plan_step(step, cfg)
        host_steps = {id(m): opt_z.state[m.pz]["host_step"] if m.pz in opt_z.state else 0
                      for m in mats}
        opt_z.step()
        sched_z.step()
        for m in mats:
            st = opt_z.state[m.pz]
            m.dev_steps[st["device_idx"].cpu()] += 1
            if st["host_step"] > host_steps[id(m)]:
                m.launches.append((step, n_win if plan.boundary and not plan.warmup else 1,
                                   plan.apply_now))
            probe(m, st, step, 0)
        if plan.boundary:
            lr_at[step] = lr_now
            for m in mats:
                m.ema_b = m.ema.clone()
            b_step = step
        if step % drain_every == 0 or step == last:
            opt_z.eval()  # as the study's evaluations: pending host results applied
            opt_z.train()
            for m in mats:
                probe(m, opt_z.state[m.pz], step, 1)
        if step % args.every == 0 or step == last:
            cp = checkpoint(step, b_step)
            checkpoints.append(cp)
            print(f"  step {step}/{steps} loss adamw {loss_a.item():.4f} zenflow "
                  f"{loss_z.item():.4f} c {cp['c_mean']:.2f} e50 {cp['e_pct'][1]:.2f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if loss_z.item() != loss_z.item():
            break
    final = {}
    if not args.no_heldout:
        opt_z.eval()
        final = {"adamw": job.evaluate(model_a), "zenflow": job.evaluate(model_z)}
    stats = opt_z.stats()
    opt_z.close()

    # ---- classify the columns over the whole run, aggregate the travel
    classes = {}
    for m in mats:
        dev = m.dev_steps.numpy()
        classes[m.name] = dict(host=dev == 0, device=dev == last, mixed=(dev > 0) & (dev < last))
    travel = []
    for i, cp in enumerate(checkpoints):
        row = dict(step=cp["step"])
        for cls in ("host", "device", "mixed"):
            zz = aa = za = 0.0
            elems = 0
            for m in mats:
                mask = classes[m.name][cls]
                t = m.travel[i]
                zz += t["zz"][mask].sum()
                aa += t["aa"][mask].sum()
                za += t["za"][mask].sum()
                elems += int(mask.sum()) * m.rows
            row[cls] = dict(elements=elems,
                            rms_zenflow=math.sqrt(zz / elems) if elems else math.nan,
                            rms_adamw=math.sqrt(aa / elems) if elems else math.nan,
                            ratio=math.sqrt(zz / aa) if aa else math.nan,
                            projection=za / aa if aa else math.nan,
                            cosine=za / math.sqrt(zz * aa) if zz and aa else math.nan)
        travel.append(row)
    per_matrix_travel = []
    for m in mats:
        t = m.travel[-1]
        entry = dict(name=m.name)
        for cls in ("host", "device"):
            mask = classes[m.name][cls]
            zz, aa, za = t["zz"][mask].sum(), t["aa"][mask].sum(), t["za"][mask].sum()
            entry[cls] = dict(columns=int(mask.sum()),
                              ratio=math.sqrt(zz / aa) if aa else math.nan,
                              projection=za / aa if aa else math.nan)
        per_matrix_travel.append(entry)

    # ---- staleness: each host gradient's steps to the step that applies its window
    lags: list[int] = []
    early = 0
    for m in mats:
        got, e = staleness_lags(m.launches, m.applies, delay)
        lags += got
        early += e
    lag = np.array(lags) if lags else np.zeros(0)
    staleness = dict(config=dict(update_interval=n_win, apply_delay=delay,
                                 nominal_range=[delay, delay + n_win - 1],
                                 nominal_mean=delay + (n_win - 1) / 2),
                     measured=dict(gradients=int(lag.size),
                                   mean=float(lag.mean()) if lag.size else math.nan,
                                   min=int(lag.min()) if lag.size else None,
                                   max=int(lag.max()) if lag.size else None,
                                   windows_applied_early=int(early)),
                     note="steps from a gradient's step to the step whose update applies "
                          "it (AdamW: 0); early: a reselection or a drain (opt.eval) "
                          "applied the window before its nominal step")

    result = dict(workload=args.workload, seed=args.seed, setting=args.setting,
                  config=setting, steps=steps, stopped_at=last, lr=lr, schedule=schedule,
                  drain_every=drain_every, command=" ".join(sys.argv),
                  seconds=time.perf_counter() - t_start, final=final,
                  selections=stats.get("selection_refreshes"),
                  host_updates=stats.get("host_updates"),
                  split_matrices=len(mats),
                  never_selected_share=float(sum(c["host"].sum() for c in classes.values())
                                             / sum(c["host"].size for c in classes.values())),
                  always_device_share=float(sum(c["device"].sum() for c in classes.values())
                                            / sum(c["device"].size for c in classes.values())),
                  staleness=staleness, travel=travel, per_matrix_travel=per_matrix_travel,
                  normalisation=checkpoints)
    print(report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\njson: {args.json}")
    return 0


def staleness_lags(launches, applies, delay: int) -> tuple[list[int], int]:
    """Each gradient's steps to the step applying its window, and how many windows were
    applied before their nominal step; ``launches``: (step, gradients, applied at once);
    ``applies``: (step, 0 in the step / 1 at a drain after it)."""
    applies = sorted(applies)
    lags, early, j = [], 0, 0
    for b, count, now in launches:
        # an apply in the launching step is this window's only when it applies at once
        # (overlap=False, warm-up); with overlap it is the window before's
        while j < len(applies) and (applies[j] < (b, 0) or (applies[j] == (b, 0) and not now)):
            j += 1
        if j == len(applies):
            continue
        a = applies[j][0]
        early += a < b + (0 if now else delay)
        lags.extend(a - s for s in range(b - count + 1, b + 1))
    return lags, early


def report(r: dict) -> str:
    f = r["final"]
    lines = [f"{r['workload']} seed {r['seed']}, setting {r['setting']} ({r['config']}), "
             f"{r['steps']} steps, lr {r['lr']} {r['schedule']}; {r['split_matrices']} split "
             f"matrices, {100 * r['never_selected_share']:.1f}% of their columns never "
             f"selected, {100 * r['always_device_share']:.1f}% device-owned every step; "
             f"{r['selections']} selections, {r['host_updates']} host jobs"]
    if f:
        lines.append("final held-out: " + ", ".join(
            f"{k} loss {v['loss']:.4f}" + (f" acc {100 * v['accuracy']:.1f}%"
                                            if "accuracy" in v else "") for k, v in f.items()))
    s = r["staleness"]
    lines.append(f"staleness (steps from a gradient to the step applying it; AdamW 0): config "
                 f"{s['config']['nominal_range'][0]}..{s['config']['nominal_range'][1]} "
                 f"(mean {s['config']['nominal_mean']:.1f}); measured mean "
                 f"{s['measured']['mean']:.2f}, range {s['measured']['min']}.."
                 f"{s['measured']['max']} over {s['measured']['gradients']} (param, gradient) "
                 f"pairs, {s['measured']['windows_applied_early']} windows applied early")
    lines += ["", "| step | q_host_moved p10/p50/p90 | q_dev_moved p10/p50/p90 | "
              "q_dev_always p10/p50/p90 |", "| --- | --- | --- | --- |"]
    for cp in r["normalisation"]:
        lines.append(f"| {cp['step']} | " + " | ".join(
            "/".join(f"{v:.2f}" for v in cp[k + "_pct"])
            for k in ("q_host_moved", "q_dev_moved", "q_dev_always")) + " |")
    lines += ["", "| step | host cols: RMS travel ZenFlow/AdamW | projection | cosine | "
              "device cols: ratio | projection | mixed: ratio | c mean (min-max) | capped | "
              "q = v_step/v_host p10/p50/p90 | e = (c/n)sqrt(q) p10/p50/p90 | "
              "v_step/v_adamw p50 |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t, cp in zip(r["travel"], r["normalisation"]):
        h, d, x = t["host"], t["device"], t["mixed"]
        cr = cp["c_range"]
        c_text = f"{cp['c_mean']:.2f} ({cr[0]:.2f}-{cr[1]:.2f}) | {cp['capped']}" if cr else "- | -"
        lines.append(
            f"| {t['step']} | {h['ratio']:.3f} ({h['rms_zenflow']:.2e}/{h['rms_adamw']:.2e}) "
            f"| {h['projection']:.3f} | {h['cosine']:.3f} | {d['ratio']:.3f} "
            f"| {d['projection']:.3f} | {x['ratio']:.3f} | {c_text} "
            f"| {'/'.join(f'{v:.2f}' for v in cp['q_pct'])} "
            f"| {'/'.join(f'{v:.2f}' for v in cp['e_pct'])} "
            f"| {cp['v_step_over_adamw_pct'][1]:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
