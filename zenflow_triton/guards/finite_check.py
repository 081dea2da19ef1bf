"""When the NaN/inf check of the gradients is read: every step, or only where the host waits
for the device anyway (``ZenFlowConfig.check_finite_at``).

Read every step, the check costs a host sync per step: the host can never run ahead of the
accelerator. Read at boundaries, a steady step computes its flags on the device and ORs
"any gradient bad" into a sticky int32 flag per device that the device-half kernels read:
from a bad step on, they write nothing (as fused AdamW does with ``found_inf``). The next
step that waits anyway reads every flag since the last read in one copy per device, before
it changes anything. If one is set, the host-side counters of the masked steps are rolled
back (each deferred step left an undo of them, taken before it changed anything), the flag
is cleared, and :class:`NonFiniteGradientError` names the params and the step: the state is
as after the step before the bad one, and the steps since were dropped.

Deferred flags are exact (fp64 norms, ``kernels.finite``): the gradient may be gone by the
time they are read. A check read at once is confirmed exactly from the gradient instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .inputs import NonFiniteGradientError, Work
from ..kernels import confirm_nonfinite, nonfinite_flags


@dataclass
class _Deferred:
    step: int
    params: dict            # device -> params in flag order
    flags: dict             # device -> bool flags on the device
    undo: Callable[[], None]


def _by_device(work: Work) -> dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]]:
    out: dict[torch.device, list] = {}
    for _, p, g in work:
        if g.numel():  # an empty gradient is finite
            out.setdefault(g.device, []).append((p, g))
    return out


def reads_at_boundary(config, backend: str, fsdp: bool, params: list[torch.Tensor]) -> bool:
    """Whether the NaN/inf check is read at boundaries only (``check_finite_at``): "auto"
    does where the Triton kernels read a CUDA device flag and nothing needs the check at
    once; an explicit "boundary" that cannot work raises."""
    if config.check_finite_at == "boundary" and backend != "triton":
        raise ValueError('check_finite_at="boundary" needs the Triton backend (its kernels '
                         f'read the device flag), but this optimizer runs backend "{backend}"')
    if config.check_finite_at == "boundary" and fsdp:
        raise ValueError('check_finite_at="boundary" is not supported under FSDP2 yet (a '
                         "rank's device flag would mask only its own rows); use \"step\"")
    if config.check_finite_at == "auto":
        return (backend == "triton" and config.accumulate_on == "device" and not fsdp
                and any(p.device.type == "cuda" for p in params))
    return config.check_finite_at == "boundary"


def undo_of(states: list[dict], set_step: Callable[[], None]) -> Callable[[], None]:
    """An undo of the host-side counters a steady step changes (each param's Adam step and
    window count, as they are in ``states`` now; ``set_step`` puts the optimizer's step count
    back): a deferred NaN/inf check undoes the steps it masked."""
    saved = [(st, {k: st[k] for k in ("step", "device_step", "acc_count", "acc_lr") if k in st})
             for st in states]

    def undo() -> None:
        set_step()
        for st, counts in saved:
            st.update(counts)
    return undo


class FiniteWatch:
    def __init__(self, at_boundary: bool, name_of: Callable[[torch.Tensor], str],
                 vote: Callable[[list[bool]], list[bool]] | None = None) -> None:
        """``vote``: where each rank checks only its rows of the gradients (FSDP2), every
        rank's flags per param of a step (in the step's order) ORed, so all raise alike."""
        self.at_boundary = at_boundary
        self._name_of = name_of
        self._vote = vote
        self._pending: list[_Deferred] = []
        self._skip: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def for_optimizer(cls, config, backend: str, shard, params: list[torch.Tensor],
                      name_of: Callable[[torch.Tensor], str]) -> "FiniteWatch":
        """The check of an optimizer: read when ``config`` says (:func:`reads_at_boundary`);
        under FSDP2 (``shard`` does not split rows itself) every rank votes on the flags."""
        fsdp = not shard.split_rows
        vote = (lambda flags: shard.any_rank(flags, "a vote on the gradients' NaN/inf flags")
                ) if fsdp else None
        return cls(reads_at_boundary(config, backend, fsdp, params), name_of, vote=vote)

    @property
    def pending(self) -> int:
        """Steps whose check has not been read yet."""
        return len(self._pending)

    def skip_of(self, device: torch.device) -> torch.Tensor | None:
        """The sticky int32 [1] flag the device-half kernels on ``device`` read (nonzero: write
        nothing); None when checks are read every step (nothing is ever masked)."""
        if not self.at_boundary:
            return None
        flag = self._skip.get(device)
        if flag is None:
            flag = self._skip[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return flag

    def defer(self, work: Work, step: int, undo: Callable[[], None]) -> None:
        """Step ``step`` reads nothing: its flags stay on the device, and a bad one masks this
        step's device half and every one after it until :meth:`check` reads them. ``undo``
        puts the host-side counters back as before this step."""
        params, flags = {}, {}
        for device, items in _by_device(work).items():
            f = nonfinite_flags([g for _, g in items], exact=True)
            skip = self.skip_of(device)
            skip.bitwise_or_(f.any().to(torch.int32))
            params[device], flags[device] = [p for p, _ in items], f
        self._pending.append(_Deferred(step, params, flags, undo))

    def check(self, work: Work, step: int | None) -> None:
        """Read the flags of every deferred step and of ``work`` (the gradients of step
        ``step``, None for none), one host read per device, before anything of this step
        changes; NonFiniteGradientError when any is set (rolled back, see the module)."""
        current = _by_device(work)
        self._judge(current, work, step,
                    {d: f.tolist() for d, f in self._flags(current).items()})

    def flags(self, work: Work) -> dict[torch.device, torch.Tensor]:
        """Per device, the flags :meth:`check` reads, still on the device (bool, every
        deferred step's then ``work``'s): a caller that copies to the host anyway may bring
        them in the same copy and hand the values to :meth:`judge`."""
        return self._flags(_by_device(work))

    def judge(self, work: Work, step: int | None, reads: dict[torch.device, list]) -> None:
        """:meth:`check` once the values of :meth:`flags` (of the same ``work``, nothing
        deferred in between) are on the host: ``reads``, per device, any sequence of
        truth values in their order."""
        self._judge(_by_device(work), work, step, reads)

    def _flags(self, current: dict) -> dict[torch.device, torch.Tensor]:
        out = {}
        for device in set(current) | {d for rec in self._pending for d in rec.flags}:
            parts = [rec.flags[device] for rec in self._pending if device in rec.flags]
            if device in current:
                parts.append(nonfinite_flags([g for _, g in current[device]]))
            out[device] = torch.cat(parts)
        return out

    def _judge(self, current: dict, work: Work, step: int | None, reads: dict) -> None:
        offsets = dict.fromkeys(reads, 0)
        for i, rec in enumerate(self._pending):
            bad = []
            for device, ps in rec.params.items():
                at = offsets[device]
                bad += [p for p, flag in zip(ps, reads[device][at:at + len(ps)]) if flag]
                offsets[device] = at + len(ps)
            if bad:
                self._roll_back(i)
                raise NonFiniteGradientError(
                    f"non-finite gradient (NaN or inf) in {self._names(bad)} at step "
                    f"{rec.step}, found "
                    + (f"at step {step}" if step is not None else "before saving or "
                       "synchronizing")
                    + " (check_finite_at='boundary' reads the check where the host waits "
                    f"anyway): the updates since step {rec.step} were masked on the device "
                    f"and are undone, so the optimizer state is as after step {rec.step - 1}"
                    + (" and this step changed nothing" if step is not None else "")
                    + "; skip those batches and go on, or construct with "
                    "check_finite_at='step' to raise at the bad step itself")
        self._pending.clear()
        bad = []
        for device, items in current.items():
            flags = reads[device][offsets[device]:]
            bad += [p for (p, g), flag in zip(items, flags) if flag and confirm_nonfinite(g)]
        if self._vote is not None and work:
            mine = {id(p) for p in bad}
            voted = self._vote([id(p) in mine for _, p, _ in work])
            bad = [p for (_, p, _), flag in zip(work, voted) if flag]
        if bad:
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN or inf) in {self._names(bad)}; no optimizer state "
                "was changed by this step (skip it, e.g. with torch.amp.GradScaler, or "
                "construct with check_finite=False to let it propagate as AdamW does)")

    def settle(self) -> None:
        """Read what deferred steps left unread (before a save or a synchronize)."""
        if self._pending:
            self.check([], None)

    def discard(self) -> None:
        """Forget unread checks (a state dict loaded over this state, or closing)."""
        self._pending.clear()
        for flag in self._skip.values():
            flag.zero_()

    def _roll_back(self, first_bad: int) -> None:
        """Undo every masked step from the first bad one, the latest first: each step's undo
        puts back the counters of the params in its own work, so a param that got no
        gradient at the bad step but one after it is restored too."""
        for rec in reversed(self._pending[first_bad:]):
            rec.undo()
        self.discard()

    def _names(self, params: list[torch.Tensor]) -> str:
        seen, out = set(), []
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                out.append(self._name_of(p))
        return ", ".join(out)
