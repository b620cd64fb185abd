"""Splitting one model's computation over ranks: tensor, context and pipeline parallelism.

``tensor_parallel``, ``context_parallel`` (with ``ring_attention``), ``pipeline`` (with ``tied``:
parameters the first and the last stage share) and ``parallelize_3d``, which composes them with
activation checkpointing, compile and data parallelism on one model.
"""
