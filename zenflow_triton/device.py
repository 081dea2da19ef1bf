"""The device half of a step: AdamW on every param's device-owned columns and on the small
params, and the gradient of the host-owned columns into the window accumulators, in one
multi-tensor op per param group for each (launches grow with groups and dtypes, not
params). Also the device copies of the host-owned column indices, made once per selection.
"""

from __future__ import annotations

from typing import Callable

import torch

from .config import ZenFlowConfig
from .kernels import KernelOps
from .state import SMALL, new_accumulator
from .columns.layout import view2d
from .host.window import OnHost


class DeviceHalf:
    def __init__(self, ops: KernelOps, link, shard, config: ZenFlowConfig) -> None:
        self.ops = ops
        self.link = link
        self.shard = shard
        self.config = config
        self.index_cache: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        """param -> (its host_idx, that index on the param's device), made once per selection
        (:meth:`remember`) or after a load (:meth:`host_idx`)."""
        self._empty: dict[tuple, tuple] = {}

    def run(self, work, state: dict, single_step_window: bool,
            skip_of: Callable[[torch.device], torch.Tensor | None] = lambda device: None,
            streamed: dict | None = None):
        """One step's device half for ``work`` ((group, param, grad) triples). Returns
        ``(direct, to_host)``: the host columns of params whose window is this one step
        (``single_step_window``; handed to the host as they are, no accumulator), and the
        ``(host accumulator, columns)`` pairs to add on the host (accumulate_on="host").
        ``skip_of(device)``: the device flag that, when set, makes the ops on that device
        write nothing (a deferred NaN/inf check), or None. ``streamed``: param -> its
        gradient as gradient streaming split it (``stream.Split``: the device-owned columns
        on the device, the host-owned ones already in host memory); ``work`` then holds
        its device part."""
        direct: dict[torch.Tensor, torch.Tensor] = {}
        to_host: list[tuple[torch.Tensor, torch.Tensor]] = []
        by_group: dict[tuple, tuple[dict, list, list]] = {}
        for group, p, g in work:  # one op per group and device (each device has its flag)
            small, matrices = by_group.setdefault((id(group), p.device), (group, [], []))[1:]
            st = state[p]
            if st["kind"] == SMALL:
                st["step"] += 1
                small.append((p, g, st))
            elif streamed and p in streamed:
                matrices += self._streamed(p, streamed[p], st, single_step_window, direct,
                                           to_host)
            else:
                matrices += self._entries(p, g, st, single_step_window, direct, to_host)
            if st["kind"] != SMALL and st["acc_count"] and "acc_lr" in st:
                st["acc_lr"] += group["lr"]  # the window's mean lr: host.window.window_base_lr
        for (_, device), (group, small, matrices) in by_group.items():
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                         weight_decay=group["weight_decay"])
            skip = skip_of(device)
            if skip is not None:
                hyper["skip"] = skip
            if small:
                self.ops.adamw([p.detach() for p, _, _ in small], [g for _, g, _ in small],
                               [st["exp_avg"] for _, _, st in small],
                               [st["exp_avg_sq"] for _, _, st in small],
                               [st.get("master") for _, _, st in small],
                               [st["step"] for _, _, st in small], **hyper)
            if matrices:
                self.ops.selective_adamw_accumulate(*map(list, zip(*matrices)), **hyper)
        return direct, to_host

    def _entries(self, p, g, st: dict, single_step_window: bool, direct: dict,
                 to_host: list) -> list[tuple]:
        """A matrix param's entries of the multi-tensor op (its device columns' AdamW and
        its accumulation), counting the step; its one-step window's columns go to
        ``direct``, a host accumulation's columns to ``to_host``."""
        has_dev = st["device_idx"].numel() > 0
        if has_dev:
            st["device_step"] += 1
        p2d, g2d = view2d(p.detach()), view2d(g, like=p)
        acc = host_idx = None
        if st["host_idx"].numel():
            host_idx = self.host_idx(p, st)
            if single_step_window and st["acc_count"] == 0:
                direct[p] = self.host_columns(g2d, host_idx)
            else:
                if st["acc"] is None:  # the first window that accumulates makes it
                    # (this rank's rows only, under data parallelism)
                    st["acc"] = new_accumulator(st["host_master"].shape[0], host_idx.numel(),
                                                p.device, self.config.accumulate_on,
                                                self.config.accumulator_torch_dtype)
                if self.config.accumulate_on == "device":
                    acc = st["acc"]
                else:  # this rank's rows cross the link every step, in the grad's dtype
                    r0, r1 = self.shard.rows(g2d.shape[0])
                    to_host.append((st["acc"], self.host_columns(g2d[r0:r1], host_idx)))
            st["acc_count"] += 1
        entries = []
        sliced = acc is not None and acc.shape[0] != p2d.shape[0]  # this rank's rows
        if has_dev or (acc is not None and not sliced):
            entries.append((p2d, g2d, st["device_idx"], st["device_m"], st["device_v"],
                            st.get("device_master"), st["device_step"],
                            None if sliced else acc, None if sliced else host_idx))
        if sliced:  # the accumulation of this rank's rows: an entry with no device columns
            r0, r1 = self.shard.rows(p2d.shape[0])
            entries.append((p2d[r0:r1], g2d[r0:r1], *self._no_columns(p, r1 - r0), 1, acc,
                            host_idx))
        return entries

    def _streamed(self, p, split, st: dict, single_step_window: bool, direct: dict,
                  to_host: list) -> list[tuple]:
        """A streamed matrix param's entry (AdamW of its device columns from their compact
        gradient); its host columns, in host memory already, go to ``direct`` (a one-step
        window) or to ``to_host`` (added into the host accumulator by the host worker)."""
        if st["host_idx"].numel():
            if single_step_window and st["acc_count"] == 0:
                direct[p] = OnHost(split.host.tensor)
            else:
                if st["acc"] is None:
                    st["acc"] = new_accumulator(st["host_master"].shape[0],
                                                st["host_idx"].numel(), p.device, "host",
                                                self.config.accumulator_torch_dtype)
                to_host.append((st["acc"], split.host))
            st["acc_count"] += 1
        if not st["device_idx"].numel():
            return []
        st["device_step"] += 1
        return [(view2d(p.detach()), split.dev, st["device_idx"], st["device_m"],
                 st["device_v"], st.get("device_master"), st["device_step"], None, None)]

    def _no_columns(self, p: torch.Tensor, rows: int) -> tuple:
        """(index, m, v, master) of no device-owned columns for ``rows`` rows of ``p``: the
        device half of an accumulation-only entry of the multi-tensor op (made once)."""
        key = (p.device, p.dtype, rows)
        made = self._empty.get(key)
        if made is None:
            m = torch.zeros(rows, 0, device=p.device)
            made = self._empty[key] = (
                torch.zeros(0, dtype=torch.long, device=p.device), m, m,
                m if p.dtype != torch.float32 else None)
        return made

    def host_idx(self, p: torch.Tensor, st: dict) -> torch.Tensor:
        """``st["host_idx"]`` (kept in host memory) on ``p``'s device, copied once per
        selection (with its migration) instead of every step; here only after a load, by a
        non-blocking copy."""
        cached = self.index_cache.get(p)
        if cached is None or cached[0] is not st["host_idx"]:
            on_device = self.link.indices_to_device(st["host_idx"].numpy(), p.device)
            cached = self.index_cache[p] = (st["host_idx"], on_device)
        return cached[1]

    def remember(self, indices: dict) -> None:
        """Take the host-owned indices a migration uploaded (``columns.migration``):
        ``{p: (host_idx, on p's device)}``."""
        self.index_cache.update(indices)

    def forget(self, p: torch.Tensor | None = None) -> None:
        """Drop the device copy of ``p``'s host-owned indices (every param's with None): its
        state was replaced."""
        if p is None:
            self.index_cache.clear()
        else:
            self.index_cache.pop(p, None)

    def index_tensors(self) -> list[torch.Tensor]:
        """The device copies of host-owned indices held now (for ``stats()``)."""
        return [on_device for _, on_device in self.index_cache.values()]

    def host_columns(self, g2d: torch.Tensor, host_idx: torch.Tensor) -> torch.Tensor:
        """g2d[:, host_idx], without a gather when every column is host-owned."""
        if host_idx.numel() == g2d.shape[1]:
            return g2d
        return self.ops.gather_columns(g2d, host_idx)
