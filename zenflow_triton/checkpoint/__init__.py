"""Checkpoints: the state dict's format, its checks and ``torch.optim.AdamW``'s both ways
(``state_dict``), and sharded checkpoints through ``torch.distributed.checkpoint``
(``sharded``)."""
