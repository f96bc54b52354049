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

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hdet_scale.errors import HDETConfigError

__all__ = ["VOCAB_SIZE", "ModelConfig", "build_model", "init_model_weights", "apply_activation_checkpointing",
           "param_count", "loss_fn"]

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
        activation_checkpointing: recompute each decoder layer's activations in the
            backward pass instead of keeping them (:func:`apply_activation_checkpointing`):
            activation memory of one layer instead of all, for about one more forward
            pass of compute. Gradients are unchanged (the recompute replays the same
            operations with the same RNG state, so dropout too).
        sharded_init: build the model sharded, so that no rank ever holds all of it:
            under ``deepspeed.zero.Init`` on the shard group (backend ``deepspeed``) or
            with its parameters on the meta device, filled after ``fully_shard``
            (``fsdp2``). The weights equal the whole build's bit for bit. ``ddp`` and
            ``fairscale`` keep the whole model on every rank and ignore it.
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
    activation_checkpointing: bool = False
    sharded_init: bool = True

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
        if (self.hidden_size // self.num_heads) % 2:
            raise HDETConfigError(
                f"model.hidden_size={self.hidden_size} / model.num_heads={self.num_heads} gives heads of "
                f"{self.hidden_size // self.num_heads} dimensions; rotary position embeddings (RoPE) need an even "
                "head size: change either")
        if self.num_heads % self.num_kv_heads:
            raise HDETConfigError(
                f"model.num_heads={self.num_heads} must be divisible by "
                f"model.num_kv_heads={self.num_kv_heads}"
            )
        if not (isinstance(self.rope_theta, (int, float)) and 0 < self.rope_theta < float("inf")):
            # inf (1e400 reads as inf) trained on NaN rotations without a word
            raise HDETConfigError(f"model.rope_theta must be a finite number > 0; got {self.rope_theta!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise HDETConfigError(f"model.dropout must be in [0, 1); got {self.dropout!r}")
        if not isinstance(self.sharded_init, bool):
            raise HDETConfigError(f"model.sharded_init must be true or false; got {self.sharded_init!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise HDETConfigError("model.activation_checkpointing must be true or false; got "
                                  f"{self.activation_checkpointing!r}")


def check_buildable(cfg: ModelConfig) -> None:
    """Build the model on the meta device (no memory, no init: well under a second
    for 1B parameters) so that a shape Hugging Face refuses is found before any rank
    starts, and before ``train.overwrite`` removes an earlier run.

    Raises:
        HDETConfigError: naming the ``model`` section and transformers' reason.
    """
    from transformers import LlamaForCausalLM

    try:
        with torch.device("meta"):
            LlamaForCausalLM(_llama_config(cfg))
    except (ValueError, TypeError, RuntimeError, AssertionError) as e:
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise HDETConfigError(f"model: transformers cannot build a Llama of these model.* settings: {reason}") from None


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


def build_model(cfg: ModelConfig, params_on_meta: bool = False) -> torch.nn.Module:
    """Build a randomly initialised ``LlamaForCausalLM`` with a 256-byte vocabulary.

    The init is a function of ``cfg`` only (:func:`init_model_weights`: every
    parameter from its own stream seeded by ``cfg.init_seed``), and the same whether the
    model is built whole or partitioned: built under
    :func:`hdet_scale.backends.deepspeed.zero_init`, each rank writes only its ZeRO-3
    partitions, with the values of the unpartitioned build. The caller's global RNG
    state is unchanged afterwards (construction runs inside
    :func:`torch.random.fork_rng`).

    Args:
        cfg: the model shape.
        params_on_meta: build the parameters on the meta device (no memory, no init;
            buffers such as the RoPE tables are real) for FSDP2 to shard first; then
            call :func:`init_model_weights` on the sharded model.

    Returns:
        The model in ``float32``, train mode, ``config.use_cache=False``.

    Raises:
        HDETConfigError: an invalid ``model.*`` value.
    """
    cfg.validate()
    from transformers import LlamaForCausalLM

    from hdet_scale.train.init import params_on_meta as meta_params

    hf_cfg = _llama_config(cfg)
    devices: list[int] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = [torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(int(cfg.init_seed))
        if devices:
            torch.cuda.manual_seed(int(cfg.init_seed))
        with meta_params() if params_on_meta else contextlib.nullcontext():
            model = LlamaForCausalLM(hf_cfg)
    if not params_on_meta:
        init_model_weights(model, cfg)
    model.train()
    return model


def init_model_weights(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """(Re-)initialise ``model``'s parameters from ``cfg.init_seed``, whole, FSDP2-sharded
    or ZeRO-3-partitioned alike (:func:`hdet_scale.train.init.init_weights`), with
    Llama's ``initializer_range`` (0.02) as the standard deviation."""
    from hdet_scale.train.init import init_weights

    init_weights(model, int(cfg.init_seed), _llama_config(cfg).initializer_range)


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


def apply_activation_checkpointing(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """Turn on Hugging Face activation checkpointing of every decoder layer when
    ``cfg.activation_checkpointing`` (otherwise leave ``model`` as it is); returns ``model``.

    Non-reentrant ``torch.utils.checkpoint`` (``use_reentrant=False``): it works with
    ZeRO-3's and FSDP2's parameter gathering and with inputs that need no gradient. Call
    it on the built model before the backend wraps it (it only sets flags on the layers
    and hooks the input embedding, so a meta-device or ZeRO-3-partitioned model is fine).
    transformers >= 5 renamed ``gradient_checkpointing_enable`` (now a deprecated alias)
    to ``activation_checkpointing_enable``; the new name is used where it exists.
    """
    if cfg.activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model
