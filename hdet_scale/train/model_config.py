"""The shape of the reference trainer's byte-level Llama (config keys ``model.*``), apart
from the model itself so that the trainer's config checks run without importing torch
(``hdet-train`` refuses a mistyped key in ~0.3 s instead of ~1.4 s).
"""

from __future__ import annotations

from dataclasses import dataclass

from hdet_scale.errors import HDETConfigError

#: Bytes.
VOCAB_SIZE = 256


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
