"""Sharded, atomic, reshardable model / optimizer checkpoints on disk (DCP), and their safe loading.

``checkpoint`` (save, load, consolidate), ``checkpoint_io`` (what a load trusts, how a save reaches
the disk) and ``async_checkpoint`` (saves written in the background). Activation checkpointing
(recomputation in backward) is ``compute.activation_checkpointing``.
"""
