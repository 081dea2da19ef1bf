"""A pure-Python, single-threaded reference of ZenFlow's schedule (docs/design.md, "The step").

Written independently of the library's code paths: full-width fp32 state per matrix param,
an ownership mask per column, one Adam step count per side, every host update computed at
its launching step and written into the param at its apply step. No threads, no compact
buffers, no transfer layer: if the library's async pipeline computed anything different from
this, the trajectories would differ.
"""

from __future__ import annotations

import math

import torch


def _adamw(w, g, m, v, lr, b1, b2, eps, wd, step, decay=None):
    """One AdamW step; ``decay``: the moments' decay factors when they are not the betas
    (a host window under host_betas="window": beta ** n), the bias corrections still
    ``1 - beta ** step``."""
    bc1 = 1.0 - b1 ** step
    bc2s = math.sqrt(1.0 - b2 ** step)
    if decay is not None:
        b1, b2 = decay
    w.mul_(1.0 - lr * wd)
    m.lerp_(g, 1.0 - b1)
    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    w.addcdiv_(m, (v.sqrt() / bc2s).add_(eps), value=-(lr / bc1))


def _adaptive(w, m, v, n, j, b1, b2, lr):
    """The "adaptive" multiplier from the host master and moments after j host steps, over
    every host element (the library samples at most 2^16 of them: test params are smaller),
    capped where c * lr would exceed 1% of the master's RMS, never below 1."""
    assert m.numel() <= 1 << 16
    if n <= 1:
        return 1.0
    cap = max(1.0, 0.01 * w.double().pow(2).mean().sqrt().item() / lr) if lr > 0 else math.inf
    rho = 0.0
    den = v.double().sum().item() / (1 - b2 ** j) if j >= 2 else 0.0
    if den > 0:
        r = (m.double() ** 2).sum().item() / (1 - b1 ** j) ** 2 / den
        f = (1 - b1) * (1 + b1 ** j) / ((1 + b1) * (1 - b1 ** j))
        rho = min(1.0, max(0.0, (r - f) / (1 - f)))
    return min(n / math.sqrt(rho + n * (1 - rho)), cap)


class ReferenceZenFlow:
    def __init__(self, param_groups, *, topk_ratio, update_interval, select_interval,
                 overlap, apply_delay=None, warmup_steps=0, min_offload_numel=1,
                 host_lr_scale="adaptive",
                 accumulate_on="device", accumulator_dtype="float32",
                 host_state_dtype="float32", host_betas="step", fresh_if_spread=True):
        self.groups = param_groups
        self.ratio = topk_ratio
        self.ui = update_interval
        self.si = select_interval
        self.overlap = overlap
        # with overlap, a window's result is applied at the end of the step this many steps
        # after the window's last (update_interval: at the next boundary)
        self.delay = update_interval if apply_delay is None else apply_delay
        self.warmup = warmup_steps
        self.min_numel = min_offload_numel
        # a number, "auto" (the window's gradient count n), "sqrt" (sqrt(n), at most 2) or
        # "adaptive" (between sqrt(n) and n by the host moments' signal fraction)
        self.host_scale = host_lr_scale
        # A window mean made on the device crosses to the host in the param's dtype.
        self.mean_crosses = accumulate_on == "device"
        # A bf16 accumulator rounds each step's sum (fp32 add, round to nearest even); a
        # one-step window (warm-up, update_interval=1) hands its gradient over as it is.
        self.acc_dtype = getattr(torch, accumulator_dtype)
        if host_state_dtype != "float32":
            raise NotImplementedError("the reference models fp32 host moments only")
        # "step": a host window decays the moments once by the betas, and "sh" counts the
        # windows; "window": by beta ** n for n gradients, and "sh" counts the gradients
        self.window_betas = host_betas == "window"
        # fresh_if_spread: at the first selection, a gradient with under half its squared
        # norm in the top 10% of each matrix's columns (element-weighted mean over the
        # ranked matrices) switches the stale default to the window's betas and delay 1 (a far
        # window travel only warns)
        self.may_freshen = (fresh_if_spread and host_betas == "step" and apply_delay is None
                            and overlap and update_interval > 1)
        self.spread_share = None
        self._shares = []
        self.t = 0
        self.st = {}
        # Smallest relative gap between the last selected and the first unselected column
        # score at any selection: a comparison with the library rests on the same selection,
        # so it needs this far above fp32 rounding of a column sum.
        self.min_selection_gap = math.inf

    def _is_matrix(self, p):
        return p.dim() >= 2 and p.numel() >= self.min_numel

    def _init(self, p):
        rows = p.shape[0]
        cols = p.numel() // rows
        if not self._is_matrix(p):
            return {"w": p.detach().double().float().clone(), "m": torch.zeros(p.shape),
                    "v": torch.zeros(p.shape), "step": 0}
        return {"w": p.detach().reshape(rows, cols).float().clone(),
                "m": torch.zeros(rows, cols), "v": torch.zeros(rows, cols),
                "dev": torch.zeros(cols, dtype=torch.bool), "sd": 0, "sh": 0,
                "acc": torch.zeros(rows, cols), "n": 0, "pending": False, "selected": False}

    def masters(self, params):
        """Each param's fp32 weights as the reference holds them."""
        return [self.st[id(p)]["w"].view(p.shape).clone() if id(p) in self.st
                else p.detach().float().clone() for p in params]

    def _apply_pending(self):
        for group in self.groups:
            for p in group["params"]:
                s = self.st.get(id(p))
                if s and "dev" in s and s["pending"]:
                    p2 = p.detach().view(s["w"].shape)
                    host = ~s["dev"]
                    p2[:, host] = s["w"][:, host].to(p.dtype)
                    s["pending"] = False

    def _select(self, p, g, group):
        s = self.st[id(p)]
        g2 = g.reshape(s["w"].shape).float()
        cols = g2.shape[1]
        k = 0 if self.ratio <= 0 else min(cols, max(1, round(self.ratio * cols)))
        scores = (g2 * g2).sum(0)
        chosen = sorted(range(cols), key=lambda j: (-scores[j].item(), j))[:k]
        if 0 < k < cols:
            ranked = sorted(scores.tolist(), reverse=True)
            if self.spread_share is None and sum(ranked) > 0:
                k10 = min(cols, max(1, round(0.1 * cols)))
                self._shares.append((p.numel(), sum(ranked[:k10]) / sum(ranked)))
            self.min_selection_gap = min(self.min_selection_gap,
                                         (ranked[k - 1] - ranked[k]) / ranked[k - 1])
        new = torch.zeros(cols, dtype=torch.bool)
        new[chosen] = True
        old = s["dev"]
        b1, b2 = group["betas"]
        sd, sh = s["sd"], s["sh"]
        if not old.any():
            sd = sh
        elif old.all():
            sh = sd
        elif sh == 0:
            sh = sd
        elif sd == 0:
            sd = sh
        for cols_moving, src, dst in ((old & ~new, sd, sh), (new & ~old, sh, sd)):
            if src in (0, dst):
                continue
            s["m"][:, cols_moving] *= (1 - b1 ** dst) / (1 - b1 ** src)
            s["v"][:, cols_moving] *= (1 - b2 ** dst) / (1 - b2 ** src)
        s["sd"], s["sh"], s["dev"], s["selected"] = sd, sh, new, True

    def step(self):
        self.t += 1
        u = self.t - self.warmup
        warm = u <= 0
        live = [(grp, p, p.grad) for grp in self.groups for p in grp["params"]
                if p.grad is not None]
        for _, p, _ in live:
            self.st.setdefault(id(p), self._init(p))
        if not warm and (u - 1) % self.si == 0:
            self._apply_pending()
            for grp, p, g in live:
                if "dev" in self.st[id(p)]:
                    self._select(p, g, grp)
        elif not warm:
            for grp, p, g in live:
                s = self.st[id(p)]
                if "dev" in s and not s["selected"] and s["n"] == 0 and not s["pending"]:
                    self._select(p, g, grp)
        if self._shares:
            n = sum(w for w, _ in self._shares)
            self.spread_share = sum(w * x for w, x in self._shares) / n
            self._shares = []
            if self.may_freshen and self.spread_share < 0.5:
                self.window_betas, self.delay = True, 1
        for grp, p, g in live:
            s = self.st[id(p)]
            b1, b2 = grp["betas"]
            hp = dict(lr=grp["lr"], b1=b1, b2=b2, eps=grp["eps"], wd=grp["weight_decay"])
            if "dev" not in s:
                s["step"] += 1
                _adamw(s["w"], g.float(), s["m"], s["v"], step=s["step"], **hp)
                p.detach().copy_(s["w"])
                continue
            g2 = g.reshape(s["w"].shape).float()
            d = s["dev"]
            if d.any():
                s["sd"] += 1
                w, m, v = s["w"][:, d], s["m"][:, d], s["v"][:, d]
                _adamw(w, g2[:, d], m, v, step=s["sd"], **hp)
                s["w"][:, d], s["m"][:, d], s["v"][:, d] = w, m, v
                p.detach().view(s["w"].shape)[:, d] = w.to(p.dtype)
            if (~d).any():
                s["acc"][:, ~d] += g2[:, ~d]
                if self.acc_dtype != torch.float32 and not (warm or self.ui == 1):
                    s["acc"][:, ~d] = s["acc"][:, ~d].to(self.acc_dtype).float()
                s["n"] += 1
                s["lr_sum"] = s.get("lr_sum", 0.0) + grp["lr"]
        if warm or u % self.ui == 0:
            if self.overlap and not warm:
                self._apply_pending()
            for grp in self.groups:
                b1, b2 = grp["betas"]
                for p in grp["params"]:
                    s = self.st.get(id(p))
                    if not s or "dev" not in s or s["n"] == 0:
                        continue
                    h = ~s["dev"]
                    n = s["n"]
                    lr = s.pop("lr_sum") / n  # the mean of the window's steps' lrs
                    before = s["sh"]
                    s["sh"] += n if self.window_betas else 1
                    w, m, v = s["w"][:, h], s["m"][:, h], s["v"][:, h]
                    mean = s["acc"][:, h] / s["n"] if s["n"] != 1 else s["acc"][:, h]
                    if self.mean_crosses:  # rounded once to the param's dtype
                        mean = mean.to(p.dtype).float()
                    # Warm-up is plain AdamW; "auto" scales by the window's gradient count.
                    scale = (1.0 if warm else float(s["n"]) if self.host_scale == "auto"
                             else min(math.sqrt(s["n"]), 2.0) if self.host_scale == "sqrt"
                             else (_adaptive(w, m, v, n, before / n, b1 ** n, b2 ** n,
                                             lr) if self.window_betas else
                                   _adaptive(w, m, v, n, before, b1, b2, lr))
                             if self.host_scale == "adaptive"
                             else float(self.host_scale))
                    decay = (b1 ** n, b2 ** n) if self.window_betas else None
                    _adamw(w, mean, m, v, lr=lr * scale, b1=b1, b2=b2,
                           eps=grp["eps"], wd=grp["weight_decay"], step=s["sh"], decay=decay)
                    s["w"][:, h], s["m"][:, h], s["v"][:, h] = w, m, v
                    s["acc"].zero_()
                    s["n"] = 0
                    s["pending"] = True
            if not self.overlap or warm:
                self._apply_pending()
        elif self.overlap and not warm and u % self.ui == self.delay:
            self._apply_pending()


def run_reference(model, data, loss_fn, groups, lr_factor, *, min_offload_numel=64,
                  sync_after=(), clip=None, **cfg) -> ReferenceZenFlow:
    """Train ``model`` on ``data`` under the reference schedule; the lr of step i is the
    group's initial lr times ``lr_factor(i)``; gradients are clipped to global norm ``clip``
    when given; pending host results are applied after the steps in ``sync_after`` (as
    ``synchronize()`` does) and at the end. Returns the reference (``min_selection_gap``)."""
    for g in groups:
        g.setdefault("betas", (0.9, 0.999))
        g.setdefault("eps", 1e-8)
    ref = ReferenceZenFlow(groups, min_offload_numel=min_offload_numel, **cfg)
    base = [g["lr"] for g in groups]
    for i, x in enumerate(data):
        for g, lr0 in zip(groups, base):
            g["lr"] = lr0 * lr_factor(i)
        model.zero_grad()
        loss_fn(model, x).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        ref.step()
        if i in sync_after:
            ref._apply_pending()
    ref._apply_pending()
    return ref
