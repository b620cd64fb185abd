"""How parameters, gradients and optimizer state are split over the data-parallel ranks and stepped.

``ddp`` (ZeRO-1), ``fsdp`` (FSDP2, ZeRO-2/3), ``accumulation`` (what gradient accumulation gathers
and reduces per micro-batch), ``fp8_all_gather`` (FP8 weights in FSDP2's gather),
``deepspeed_engine`` (DeepSpeed as a ZeRO backend), ``init`` (materialising a meta model after
sharding), ``gradients`` (reduction and clipping without FSDP2), ``optim`` (optimizers stepping
local shards) and ``loss_scaler`` (fp16 loss scaling whose overflow check agrees on every rank).
"""
