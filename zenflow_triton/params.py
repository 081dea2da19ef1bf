"""Which param is which: each param's group, its index in the group, its name (for errors
and the dense set) and its kind (split by columns, or whole on the device)."""

from __future__ import annotations

from typing import Callable

import torch

from .config import ZenFlowConfig
from .state import classify


class ParamIndex:
    """Looks params up in the optimizer's groups (``groups()``: its ``param_groups``, which
    grow and change). ``owner(t)``: the param whose local tensor ``t`` is (FSDP2), else
    ``t``."""

    def __init__(self, groups: Callable[[], list[dict]], config: ZenFlowConfig,
                 owner: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._groups = groups
        self._config = config
        self._owner = owner

    def params(self) -> list[torch.Tensor]:
        """Every param, in state-dict index order."""
        return [p for g in self._groups() for p in g["params"]]

    def where(self, p: torch.Tensor) -> tuple[int, int, str | None] | None:
        """(group index, index in the group, the param's name or None), or None for a
        param this optimizer does not hold (a DTensor param's local tensor: its param's)."""
        p = self._owner(p)
        for gi, group in enumerate(self._groups()):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    return gi, pi, names[pi] if names else None
        return None

    def kind(self, p: torch.Tensor) -> str:
        """MATRIX (split by columns) or SMALL (whole on the device): by the whole param's
        shape (a DTensor's global one, so every rank classifies alike), and by name for the
        dense set (``ZenFlowConfig.dense_params``)."""
        where = self.where(p)
        return classify(self._owner(p), self._config, where[2] if where else None)

    def name(self, p: torch.Tensor) -> str:
        """The param as error messages name it."""
        where = self.where(p)
        if where is None:
            return f"param of shape {tuple(p.shape)}"
        gi, pi, name = where
        label = f"'{name}'" if name else f"param {pi} of group {gi}"
        return f"{label} (shape {tuple(self._groups()[gi]['params'][pi].shape)}, {p.dtype})"
