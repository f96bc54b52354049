"""A word when a model built under :func:`hdet_scale.hf.zero_init` skipped transformers'
ZeRO-3 weight init.

Under ZeRO-3, each parameter is partitioned as its module's constructor returns, so the
init pass that ``post_init`` runs afterwards (``_init_weights``: normal(0, 0.02) for
Llama) writes into empty tensors. transformers makes up for it in ``from_config`` and
``from_pretrained`` only (``initialize_weights_zero3``, or the loaded weights); a model
built by its class constructor (``LlamaForCausalLM(config)``) keeps torch's own module
defaults instead: embeddings N(0, 1), tied to the LM head, and a first loss near 30 nats
where ~ln(vocab) is meant (e.g. 29.9 against 4.17). The user's code is
otherwise valid, so this warns rather than refuses (weights may be loaded afterwards).

Source: transformers 5.24 ``PreTrainedModel._from_config`` / ``post_init``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

_BUILDERS = ("from_pretrained", "_from_config")


@contextlib.contextmanager
def watch_constructors() -> Iterator[None]:
    """Inside: note each ``PreTrainedModel`` whose ``post_init`` runs outside
    ``from_config`` / ``from_pretrained``; on a normal exit, one ``UserWarning`` naming
    the outermost such class. Patches those three attributes of ``PreTrainedModel`` for
    the duration only; a transformers without them is left alone (no warning)."""
    try:
        from transformers import PreTrainedModel
        real_post = PreTrainedModel.__dict__["post_init"]
        real_builders = {name: PreTrainedModel.__dict__[name] for name in _BUILDERS}
        if not all(isinstance(b, classmethod) for b in real_builders.values()):
            raise TypeError
    except (ImportError, KeyError, TypeError):
        yield
        return
    depth = [0]
    direct: list[str] = []

    @functools.wraps(real_post)
    def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
        if depth[0] == 0:
            direct.append(type(self).__name__)  # inner models first: the last is the outermost
        return real_post(self, *args, **kwargs)

    def counted(builder: classmethod) -> classmethod:
        @functools.wraps(builder.__func__)
        def build(cls: Any, *args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            try:
                return builder.__func__(cls, *args, **kwargs)
            finally:
                depth[0] -= 1
        return classmethod(build)

    PreTrainedModel.post_init = post_init
    for name, builder in real_builders.items():
        setattr(PreTrainedModel, name, counted(builder))
    try:
        yield
    finally:
        PreTrainedModel.post_init = real_post
        for name, builder in real_builders.items():
            setattr(PreTrainedModel, name, builder)
    if direct:
        name = direct[-1]
        warnings.warn(
            f"hdet_scale.hf.zero_init: {name}(config) was built by its class constructor. Under ZeRO-3, transformers "
            f"initialises the weights only in from_config and from_pretrained: this model keeps torch's module "
            f"defaults (embeddings N(0, 1), a first loss far above ln(vocab)), not {name}._init_weights. Build it "
            f"with AutoModelForCausalLM.from_config(config) (or {name}.from_pretrained), or load its weights before "
            f"training.", UserWarning, stacklevel=3)
