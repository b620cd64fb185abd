"""GPTLightningModule: the GPT with its optimizer, schedule, metrics and generation."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric
from typing_extensions import override

from lightning_perf.data.hf_tokenizer import tokenizer_hash
from lightning_perf.kernels.torchao_fp8 import check_fp8_device, require_fp8
from lightning_perf.models.gpt import hf
from lightning_perf.models.gpt.config import GPTConfig
from lightning_perf.models.gpt.generate import generate
from lightning_perf.models.gpt.model import GPT
from lightning_perf.parallel.compute.activation_checkpointing import AC_MODES, apply_activation_checkpointing
from lightning_perf.parallel.compute.compile import COMPILE_MODES, COMPILE_SCOPES, apply_compile
from lightning_perf.perf.collection import DEFAULT_EVERY_N_STEPS, Priority, ScheduledCollection, check_every_n_steps
from lightning_perf.perf.documents import document_work, packed_batch_flops
from lightning_perf.perf.run_settings import PerfSettings
from lightning_perf.runtime.planning import TrainingPlan, resolve_auto_settings
from lightning_perf.runtime.preemption import PreemptionCheckpoint

__all__ = ["GPTLightningModule", "cosine_with_warmup"]


def cosine_with_warmup(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine decay to ``min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class _ModelCollection(L.Callback):
    """The module's garbage-collection schedule, at the model's priority: a strategy's schedule or an
    attached ``GarbageCollection`` takes precedence (``lightning_perf.perf.collection``)."""

    def __init__(self, every_n_steps: Optional[int]) -> None:
        self.schedule = ScheduledCollection(every_n_steps, priority=Priority.MODEL)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.schedule.start()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.schedule.after_step(trainer.global_step)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.schedule.stop()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.schedule.stop()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.schedule.stop()


class GPTLightningModule(L.LightningModule):
    """Train, validate and sample a :class:`GPT`.

    Args:
        config: a preset name (``"tiny"``, the default, ``"gpt2-124m"``, ``"llama-8b"``, ...) or a :class:`GPTConfig`.
        init_from_hf: a Hugging Face checkpoint folder (Llama, Mistral, Qwen2 or GPT-2) to fine-tune: the
            config comes from its ``config.json`` (``config`` must then be left out) and the weights replace
            the random initialisation, also when a strategy builds the model on ``meta`` and shards it first.
        learning_rate: peak AdamW learning rate.
        min_lr_ratio: the cosine schedule ends at ``learning_rate * min_lr_ratio``.
        warmup_steps: linear warmup length in optimizer steps.
        lr_decay_steps: length of the cosine schedule; ``None`` uses the Trainer's total optimizer
            steps. Fix it when a run will be resumed with a different ``max_steps``.
        weight_decay: applied to matrices (linear and embedding weights) only, never to biases or norms.
        betas, eps: AdamW.
        fused_adam: fused AdamW kernel; ``None`` uses it when the parameters are on CUDA, or in host
            memory under a GPU strategy's CPU offload (torch's fused CPU kernel).
        compile: ``torch.compile`` each block: ``None`` (off), ``"default"``, ``"reduce-overhead"``
            (CUDA graphs, for small models), ``"max-autotune"``.
        compile_scope: ``"block"`` (one graph per block, composes with sharding per block) or
            ``"model"`` (one graph for the whole GPT: fewer launches, for one GPU).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"`` per block; ``"auto"``: the memory
            planner's choice for the GPU the run is on (``lightning_perf.runtime.planning``): the fastest that
            fits with the micro-batch, logged once at the start of the fit.
        vocab_size, block_size: override the preset's (e.g. to match a tokenizer or a data module).
        config_overrides: other :class:`GPTConfig` fields to change on the preset, e.g.
            ``{"kernels": "triton", "attention": "auto", "fp8": True}`` (a recipe's way to set them).
        gc_every_n_steps: Python's garbage collector runs every this many global steps with its
            automatic collections off during ``fit`` (``None``: automatic, as the program has it). A
            strategy of the pack (its own ``gc_every_n_steps``) or an attached ``GarbageCollection``
            callback decides instead.
    """

    def __init__(
        self,
        config: Union[str, GPTConfig, None] = None,
        *,
        init_from_hf: Optional[str] = None,
        learning_rate: float = 6e-4,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 100,
        lr_decay_steps: Optional[int] = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        fused_adam: Optional[bool] = None,
        compile: Optional[str] = None,
        compile_scope: str = "block",
        activation_checkpointing: str = "none",
        vocab_size: Optional[int] = None,
        block_size: Optional[int] = None,
        config_overrides: Optional[dict[str, Any]] = None,
        gc_every_n_steps: Optional[int] = DEFAULT_EVERY_N_STEPS,
    ) -> None:
        super().__init__()
        check_every_n_steps(gc_every_n_steps, allow_none=True, name="gc_every_n_steps")
        if init_from_hf is not None and config is None:
            config = hf.config_from_hf(hf.read_hf_config(init_from_hf))
        elif init_from_hf is not None and isinstance(config, str):
            raise ValueError(
                f"give either config={config!r} or init_from_hf={init_from_hf!r}: a Hugging Face checkpoint "
                "brings its own config (change fields with config_overrides)"
            )
        if config is None:
            config = "tiny"
        if isinstance(config, str):
            cfg = GPTConfig.from_name(config)
        elif isinstance(config, dict):  # from a checkpoint's hyperparameters
            cfg = GPTConfig(**config)
        elif isinstance(config, GPTConfig):
            cfg = config
        else:
            raise TypeError(f"config must be a preset name or a GPTConfig, got {type(config).__name__}")
        overrides = dict(config_overrides or {})
        known = {f.name for f in dataclasses.fields(GPTConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"config_overrides has fields GPTConfig does not: {unknown}; known: {sorted(known)}")
        overrides.update({k: v for k, v in (("vocab_size", vocab_size), ("block_size", block_size)) if v is not None})
        if overrides:
            cfg = cfg.replace(**overrides)
        if init_from_hf is not None and not isinstance(config, dict):  # a dict: hyper-parameters of a saved run
            # headers only: a vocabulary or shape mismatch fails here, before any process or process group
            with torch.device("meta"):
                hf.check_hf_weights(GPT(cfg), init_from_hf)
        if cfg.fp8:
            require_fp8(cfg.fp8)  # a missing extra fails here, before any process or process group
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile={compile!r} is not one of {COMPILE_MODES}")
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope={compile_scope!r} is not one of {COMPILE_SCOPES}")
        if activation_checkpointing not in (*AC_MODES, "auto"):
            raise ValueError(f"activation_checkpointing={activation_checkpointing!r} is not one of "
                             f"{(*AC_MODES, 'auto')}")
        if learning_rate <= 0 or not 0.0 <= min_lr_ratio <= 1.0 or warmup_steps < 0:
            raise ValueError(
                f"need learning_rate > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0; got "
                f"{learning_rate}, {min_lr_ratio}, {warmup_steps}"
            )
        self.config = cfg
        self.save_hyperparameters(ignore=["config", "vocab_size", "block_size", "config_overrides"])
        # plain types only, so the checkpoint loads with weights_only=True
        self.hparams["config"] = dataclasses.asdict(cfg)
        self.model: Optional[GPT] = None
        self.val_loss = MeanMetric()
        self._batch_shape: Optional[tuple[int, int]] = None
        self._batch_doc_ids: Optional[torch.Tensor] = None  # the last training batch's, if packed
        self._loss_copies: list[tuple[torch.Tensor, Any]] = []  # (pinned host copy, CUDA event) in flight
        self._collection = _ModelCollection(gc_every_n_steps)
        #: the memory planner's choice for this fit (``lightning_perf.runtime.planning``), once setup has run
        self.memory_plan: Optional[TrainingPlan] = None

    # ---- model ---------------------------------------------------------------------------

    @override
    def configure_model(self) -> None:
        """Build the GPT (on the device or meta context the strategy provides), then AC and compile."""
        if self.model is not None:
            return
        self.model = GPT(self.config, init_from_hf=self.hparams.get("init_from_hf"))
        blocks = list(self.model.blocks.values())
        apply_activation_checkpointing(blocks, self.hparams.activation_checkpointing)
        scope = self.hparams.get("compile_scope", "block")
        apply_compile(blocks if scope == "block" else [self.model], self.hparams.compile)

    @override
    def setup(self, stage: str) -> None:
        if self.config.fp8 and self._trainer is not None:
            check_fp8_device(self.trainer.strategy.root_device)
        if self._trainer is not None and stage == "fit":
            # "auto" micro-batch, checkpointing and accumulation become values before the model is built
            self.memory_plan = resolve_auto_settings(self.trainer, self, self.trainer.datamodule)

    @classmethod
    def from_hf(cls, path: Union[str, Path], **module_kwargs: Any) -> "GPTLightningModule":
        """A module that fine-tunes the Hugging Face checkpoint at ``path`` (see ``init_from_hf``); other
        arguments as for the constructor (``learning_rate=1e-5``, ``config_overrides={...}``, ...)."""
        return cls(init_from_hf=str(path), **module_kwargs)

    @property
    def tokenizer_hash(self) -> Optional[str]:
        """Hash of the ``tokenizer.json`` beside the Hugging Face weights this module starts from (None when
        there is none): ``TokenDataModule`` refuses token files another tokenizer made."""
        folder = self.hparams.get("init_from_hf")
        if folder is None or not (Path(folder) / "tokenizer.json").is_file():
            return None
        return tokenizer_hash(folder)

    def save_hf(self, path: Union[str, Path], *, dtype: Optional[torch.dtype] = None) -> Path:
        """The GPT as a Hugging Face checkpoint folder: see :meth:`GPT.save_hf`."""
        return self._gpt().save_hf(path, dtype=dtype)

    def _gpt(self) -> GPT:
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return self.model

    @override
    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if doc_ids is None:  # the plain call: a pipeline schedule's forward takes (inputs, targets)
            return self._gpt()(idx, targets)
        return self._gpt()(idx, targets, doc_ids=doc_ids)

    def init_weights(self) -> None:
        """Initialise the GPT's parameters in place (after a strategy materialised them from meta)."""
        self._gpt().init_weights()

    # ---- FLOPs ---------------------------------------------------------------------------

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Model FLOPs per trained token, causal attention counted once (see GPTConfig)."""
        return self.config.flops_per_token(seq_len)

    def hardware_flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """FLOPs per token including activation-checkpointing recomputation (HFU); see GPTConfig."""
        return self.config.hardware_flops_per_token(seq_len, self.hparams.activation_checkpointing)

    def attention_flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """The attention part of :meth:`flops_per_token`: what ``MFUMonitor`` counts per document
        when batches carry ``doc_ids`` (see GPTConfig)."""
        return self.config.attention_flops_per_token(seq_len)

    def hardware_attention_flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """The attention part of :meth:`hardware_flops_per_token` (recomputation included)."""
        return self.config.attention_flops_per_token(seq_len, self.hparams.activation_checkpointing)

    def flops_per_token_full_attention(self, seq_len: Optional[int] = None) -> int:
        """Model FLOPs per token with attention counted over the full square, for comparison (see GPTConfig)."""
        return self.config.flops_per_token_full_attention(seq_len)

    @property
    def flops_per_batch(self) -> Optional[int]:
        """Model FLOPs of the last training batch (fwd + bwd), for Lightning's ThroughputMonitor.

        A packed batch (one with ``doc_ids``) counts attention per document, as ``MFUMonitor`` does:
        the sum of its documents' squared lengths, computed when this is read. That reads the
        device, so read it after the step (ThroughputMonitor synchronises before it does)."""
        if self._batch_shape is None:
            return None
        B, T = self._batch_shape
        if self._batch_doc_ids is None:
            return self.flops_per_token(T) * B * T
        square_sum = int(document_work(self._batch_doc_ids)[0])
        return round(packed_batch_flops(tokens=B * T, seq_len=T, flops_per_token=self.flops_per_token(T),
                                        attention_flops_per_token=self.attention_flops_per_token(T),
                                        square_sum=square_sum))

    # ---- steps ---------------------------------------------------------------------------

    def _check_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(inputs, targets, doc_ids or None)`` of a batch ``(inputs, targets)``, ``(inputs, targets,
        doc_ids)`` (packed documents) or a dict with those keys (``doc_ids`` optional)."""
        if isinstance(batch, dict) and "inputs" in batch and "targets" in batch:
            x, y, doc_ids = batch["inputs"], batch["targets"], batch.get("doc_ids")
        elif isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
            x, y, doc_ids = batch[0], batch[1], batch[2] if len(batch) == 3 else None
        else:
            raise ValueError("GPTLightningModule expects batches of (inputs, targets) or (inputs, targets, doc_ids)"
                             " token tensors, or a dict with keys 'inputs', 'targets' and optionally 'doc_ids'")
        T = x.shape[-1]
        if T > self.config.block_size:
            raise ValueError(
                f"batch sequence length {T} exceeds the model's block_size {self.config.block_size}: "
                f"lower the data module's seq_len or raise block_size"
            )
        return x, y, doc_ids

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, doc_ids = self._check_batch(batch)
        self._batch_shape = (x.shape[0], x.shape[1])
        self._batch_doc_ids = doc_ids
        loss = self(x, y, doc_ids)
        self._log_train_loss(loss)
        return loss

    def _log_train_loss(self, loss: torch.Tensor) -> None:
        """Log the training loss without a host-device sync.

        Lightning turns progress-bar metrics into Python floats (``.item()``) on every step, which
        on a GPU waits for the step to finish and starves the launch queue. On CUDA the loss is
        copied to pinned host memory asynchronously and logged once that copy has landed (usually
        one step later, ``train/loss`` then shows the previous step's value); the copy is checked
        with ``Event.query()``, never waited on.
        """
        if loss.device.type != "cuda":
            self.log("train/loss", loss.detach(), prog_bar=True)
            return
        ready = None
        while self._loss_copies and self._loss_copies[0][1].query():
            ready = self._loss_copies.pop(0)[0]
        if ready is not None:
            self.log("train/loss", ready, prog_bar=True)
        if len(self._loss_copies) < 4:  # bounded: at most a few steps in flight
            host = torch.empty((), dtype=loss.dtype, pin_memory=True)
            host.copy_(loss.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._loss_copies.append((host, event))

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, doc_ids = self._check_batch(batch)
        loss = self(x, y, doc_ids)
        self.val_loss.update(loss, weight=(y != GPT.batch_padding_target).sum())
        return loss

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # torchmetrics reduces across ranks
        self.log("val/loss", loss, prog_bar=True, sync_dist=False)
        self.log("val/ppl", torch.exp(loss), sync_dist=False)
        self.val_loss.reset()

    @override
    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, doc_ids = self._check_batch(batch)
        loss = self(x, y, doc_ids)
        self.log("test/loss", loss, sync_dist=True)
        return loss

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if isinstance(batch, dict):
            return self(batch["inputs"], None, batch.get("doc_ids")).argmax(dim=-1)
        if isinstance(batch, (tuple, list)):
            return self(batch[0], None, batch[2] if len(batch) == 3 else None).argmax(dim=-1)
        return self(batch).argmax(dim=-1)

    # ---- optimisation --------------------------------------------------------------------

    def parameter_groups(self) -> list[dict[str, Any]]:
        """AdamW groups: weight decay on matrices (dim >= 2), none on biases and norm weights."""
        decay, no_decay = [], []
        for p in self.parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    def _zeroes_after_step(self) -> bool:
        """Whether gradients are freed right after the optimizer step: not where the strategy handles
        gradient accumulation itself (Lightning's ``Strategy.handles_gradient_accumulation``: a DeepSpeed
        engine, which owns the gradients between its steps and zeroes them itself)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return not (strategy is not None and strategy.handles_gradient_accumulation)

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        # Lightning zeroes gradients inside the next step's closure, after its forward: freed here,
        # a parameter-sized set of fp32 gradients does not sit beside that forward's activations
        if self._zeroes_after_step():
            optimizer.zero_grad(set_to_none=True)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if not self._zeroes_after_step():  # otherwise already done after the previous step
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def configure_optimizers(self) -> Any:
        params = list(self.parameters())
        if not params:
            raise ValueError("GPTLightningModule has no parameters: configure_model() was not called")
        fused = self.hparams.fused_adam
        if fused is None:
            fused = self._fused_adam_default(params)
        optimizer = torch.optim.AdamW(
            self.parameter_groups(),
            lr=self.hparams.learning_rate,
            betas=tuple(self.hparams.betas),
            eps=self.hparams.eps,
            fused=bool(fused),
        )
        total = self._total_steps()
        schedule = {
            "scheduler": torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda step: cosine_with_warmup(
                    step,
                    warmup_steps=self.hparams.warmup_steps,
                    total_steps=total,
                    min_lr_ratio=self.hparams.min_lr_ratio,
                ),
            ),
            "interval": "step",
        }
        return {"optimizer": optimizer, "lr_scheduler": schedule}

    def _fused_adam_default(self, params: list[torch.Tensor]) -> bool:
        """The fused AdamW kernel for CUDA parameters, and for parameters a strategy keeps in host memory
        beside a GPU (CPU offload: the optimizer step then runs on the host, where torch's fused CPU
        kernel makes one pass over each group instead of a loop of small per-tensor ops, and the GPU
        waits for that step); the per-tensor loop for plain CPU training."""
        devices = {p.device.type for p in params}
        if devices == {"cuda"}:
            return True
        trainer = self._trainer
        return devices == {"cpu"} and trainer is not None and trainer.strategy.root_device.type == "cuda"

    def _total_steps(self) -> int:
        if self.hparams.lr_decay_steps is not None:
            return int(self.hparams.lr_decay_steps)
        trainer = self._trainer
        if trainer is None:
            return 10**9
        try:
            total = int(trainer.estimated_stepping_batches)
        except Exception:  # no dataloader length known yet
            total = trainer.max_steps
        if total is None or total < 0 or total == float("inf"):
            total = 10**9
        return total

    # ---- sampling ------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: Optional[int] = None,
        eos_id: Optional[int] = None, seed: Optional[int] = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` after the prompt ``idx`` (B, T); returns (B, T + new)."""
        return generate(
            self._gpt(), idx, max_new_tokens, temperature=temperature, top_k=top_k, eos_id=eos_id, seed=seed
        )

    def perf_settings(self) -> PerfSettings:
        """What this module tells the performance callbacks about itself (``lightning_perf.perf.run_settings``):
        the pack's GPT with its kernels, attention and FP8 recipe, and the compile and activation checkpointing
        it applies to its blocks in ``configure_model``."""
        mode = self.hparams.get("compile")
        return PerfSettings(
            gpt=True,
            kernels=self.config.kernels,
            attention=self.config.attention,
            fp8=self.config.fp8 or "none",
            compile_mode=mode,
            compile_scope=self.hparams.get("compile_scope", "block") if mode is not None else None,
            activation_checkpointing=self.hparams.get("activation_checkpointing", "none"),
        )

    @override
    def configure_callbacks(self) -> list[L.Callback]:
        """The module's garbage-collection schedule (``gc_every_n_steps``; a strategy's or an attached
        ``GarbageCollection`` decides over it) and a :class:`~lightning_perf.callbacks.PreemptionCheckpoint`
        unless the Trainer has one: SIGTERM, SIGUSR1 and SIGINT stop the fit at a step boundary with a
        final checkpoint (``signals=()`` on the Trainer's own turns it off)."""
        trainer = self._trainer
        if trainer is not None and any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
            return [self._collection]
        return [self._collection, PreemptionCheckpoint()]

    @override
    def on_fit_start(self) -> None:
        gpt = self._gpt()
        # the FLOPs at the length the data module trains at, which may be below the model's block_size
        seq_len = getattr(self.trainer.datamodule, "seq_len", None)
        if isinstance(seq_len, int) and not isinstance(seq_len, bool) and 0 < seq_len <= self.config.block_size:
            at = f"T={seq_len}"
        else:
            seq_len, at = self.config.block_size, f"T={self.config.block_size} (block_size)"
        rank_zero_info(
            f"GPT {self.config.name}: {gpt.num_params() / 1e6:.2f}M parameters, "
            f"{self.flops_per_token(seq_len) / 1e6:.1f} MFLOP/token at {at}"
        )
