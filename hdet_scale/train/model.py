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

import torch
import torch.nn.functional as F

from hdet_scale.errors import HDETConfigError
from hdet_scale.train.model_config import VOCAB_SIZE, ModelConfig

__all__ = ["VOCAB_SIZE", "ModelConfig", "build_model", "init_model_weights", "apply_activation_checkpointing",
           "param_count", "loss_fn"]

_ATTN_IMPLEMENTATION = "sdpa"


def check_buildable(cfg: ModelConfig) -> torch.nn.Module:
    """Build the model on the meta device (no memory, no init: well under a second
    for 1B parameters) so that a shape Hugging Face refuses is found before any rank
    starts, and before ``train.overwrite`` removes an earlier run. Returns that model
    (for checks that read its module tree).

    Raises:
        HDETConfigError: naming the ``model`` section and transformers' reason.
    """
    from transformers import LlamaForCausalLM

    try:
        with torch.device("meta"):
            return LlamaForCausalLM(_llama_config(cfg))
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


def loss_fn(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
            label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean next-byte cross-entropy, in nats (with ``label_smoothing`` in [0, 1): the
    ``hdet.axes.label_smoothing`` value of this rank's replica in training; validation
    and the probe use 0, the plain cross-entropy).

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
        logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).to(torch.int64),
        label_smoothing=float(label_smoothing),
    )


def sequence_losses(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of each sequence, in nats: shape ``(B,)``, float32
    (the arguments as :func:`loss_fn`'s, no label smoothing). Their mean is
    :func:`loss_fn`'s value up to float32 summation order."""
    logits = model(input_ids=inputs, use_cache=False).logits
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).to(torch.int64),
                                reduction="none")
    return per_token.view(targets.shape).mean(dim=1)


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
