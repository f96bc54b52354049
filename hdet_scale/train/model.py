"""Byte-level Llama-style causal LM for the reference trainer.

The model is built from a config only (``transformers.LlamaConfig`` +
``LlamaForCausalLM``): nothing is downloaded. The vocabulary is the 256 byte values
(see :mod:`hdet_scale.train.data`).

transformers 5 notes: ``rope_theta`` is no longer a ``LlamaConfig`` argument; it goes
in ``rope_parameters={"rope_type": "default", "rope_theta": ...}``. The attention
backend is passed as ``attn_implementation=`` to the config; ``"sdpa"`` works on CPU
and GPU (and is ~3x faster than ``"eager"`` on CPU for the default size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hdet_scale.errors import HDETConfigError

__all__ = ["VOCAB_SIZE", "ModelConfig", "build_model", "param_count", "loss_fn"]

#: Bytes.
VOCAB_SIZE = 256

_ATTN_IMPLEMENTATION = "sdpa"


@dataclass
class ModelConfig:
    """Shape of the byte-level Llama model (config keys ``model.*``).

    Attributes:
        hidden_size: residual width; divisible by ``num_heads``.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention); divides ``num_heads``.
        intermediate_size: SwiGLU MLP width.
        max_seq_len: maximum positions (``max_position_embeddings``); must be >=
            ``data.seq_len``.
        rope_theta: RoPE base period.
        tie_embeddings: share the input embedding and the LM head.
        dropout: attention-probability dropout (Llama has no other dropout).
        init_seed: seed of the weight init; the same seed gives identical weights.
    """

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 352
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    init_seed: int = 0

    def validate(self) -> None:
        """Raise :class:`HDETConfigError` naming the ``model.*`` key of a bad value."""
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise HDETConfigError(f"model.{name} must be an integer >= 1; got {value!r}")
        if self.hidden_size % self.num_heads:
            raise HDETConfigError(
                f"model.hidden_size={self.hidden_size} must be divisible by "
                f"model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise HDETConfigError(
                f"model.num_heads={self.num_heads} must be divisible by "
                f"model.num_kv_heads={self.num_kv_heads}"
            )
        if not self.rope_theta > 0:
            raise HDETConfigError(f"model.rope_theta must be > 0; got {self.rope_theta!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise HDETConfigError(f"model.dropout must be in [0, 1); got {self.dropout!r}")


def _llama_config(cfg: ModelConfig):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        tie_word_embeddings=cfg.tie_embeddings,
        attention_dropout=float(cfg.dropout),
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=_ATTN_IMPLEMENTATION,
    )


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """Build a randomly initialised ``LlamaForCausalLM`` with a 256-byte vocabulary.

    The init is a function of ``cfg`` only: the CPU RNG (and, if CUDA is already
    initialised, the current CUDA device's RNG) is seeded with ``cfg.init_seed`` inside
    :func:`torch.random.fork_rng`, so the caller's global RNG state is unchanged
    afterwards. Weights are created on the default device (CPU unless the caller
    changed it); CPU and CUDA inits of the same seed differ.

    Returns:
        The model in ``float32``, train mode, ``config.use_cache=False``.

    Raises:
        HDETConfigError: an invalid ``model.*`` value.
    """
    cfg.validate()
    from transformers import LlamaForCausalLM

    hf_cfg = _llama_config(cfg)
    devices: list[int] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(int(cfg.init_seed))
        if devices:
            torch.cuda.manual_seed(int(cfg.init_seed))
        model = LlamaForCausalLM(hf_cfg)
    model.train()
    return model


def param_count(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once).

    Under DeepSpeed ZeRO-3 a partitioned parameter's local ``numel()`` is 0; its full
    size ``ds_numel`` is used instead.
    """
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def loss_fn(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy, in nats.

    Args:
        model: the causal LM (or a DeepSpeed engine wrapping it).
        inputs: ``torch.int64`` byte ids, shape ``(B, T)``.
        targets: ``torch.int64`` byte ids, shape ``(B, T)``, already shifted (the byte
            following each input position), as produced by ``ByteBatches``.

    Returns:
        Scalar ``float32`` tensor: ``cross_entropy`` over all ``B * T`` positions, with
        logits cast to ``float32`` first (safe under bf16/fp16 models).
    """
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).to(torch.int64)
    )
