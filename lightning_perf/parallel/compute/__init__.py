"""How each transformer block's computation runs: activation checkpointing and ``torch.compile``.

Both act per block and keep parameter names, so sharding and checkpoints do not see them.
"""
