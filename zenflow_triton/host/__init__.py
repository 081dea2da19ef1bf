"""The host half: AdamW over host-owned columns, run by a background worker."""

from .adamw import HostAdamW, HostHyper, PieceIO
from .worker import HostJob, HostWorker, HostWorkerError

__all__ = ["HostAdamW", "HostHyper", "PieceIO", "HostJob", "HostWorker", "HostWorkerError"]
