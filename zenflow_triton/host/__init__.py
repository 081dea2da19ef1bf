"""The host half: AdamW over host-owned columns, run by a background worker."""

from .adamw import HostAdamW, HostHyper, PieceIO
from .outbox import Outboxes
from .pipeline import HostPipeline, Window
from .worker import HostJob, HostWorker, HostWorkerError

__all__ = ["HostAdamW", "HostHyper", "HostPipeline", "Outboxes", "PieceIO", "Window", "HostJob", "HostWorker", "HostWorkerError"]
