"""Make DeepSpeed's CPU Adam kernels compute Adam's bias correction from the step alone.

DeepSpeed's C++ Adam on CPU (``FusedAdam``'s CPU op, which ZeRO-3 uses on the CPU
accelerator, and ``DeepSpeedCPUAdam``) keeps ``beta1**t`` and ``beta2**t`` in a C++
object per process, outside every state dict (``Adam_Optimizer::IncrementStep`` in
``csrc/includes/cpu_adam.h``, deepspeed 0.19): while the betas stay the same it advances
them by one float32 multiplication per step; when the betas differ from the last call's,
or the step is not the last one plus 1, it takes ``std::pow(beta, t)`` instead. A fresh
process (a resume) thus starts with ``pow`` where the uninterrupted run has a chain of
products, and the two differ in the last bit at some steps (float32, betas 0.9 / 0.95:
``beta2**6``, ``beta2**7``, ``beta1**9``, ...): the resumed run's updates then differ by
~1e-7 relative from the first step after the resume, and whether a given resume step is
hit is a matter of luck. Checkpoints cannot carry the C++ value.

:func:`stateless_bias_correction` removes that history: before every step it calls the
kernel once on empty tensors with NaN betas, so the real call sees "other betas" and
takes ``pow(beta, t)``, a function of the saved step and betas only; uninterrupted and
resumed runs then compute the same bits (also with ``schedule.cycle_momentum``, whose
per-step betas the history could not replay). Cost: one kernel call on empty tensors
per optimizer step (sub-group, in ZeRO-3).
"""

from __future__ import annotations

from typing import Any

import torch

_NAN = float("nan")


def _reset_call(base: Any) -> Any:
    """A callable that makes the next C++ Adam call take ``pow(beta, t)``; ``None``
    where ``base`` keeps no such state (torch optimizers, GPU ``FusedAdam``)."""
    from deepspeed.accelerator import get_accelerator

    empty = [[torch.empty(0)] for _ in range(4)]  # grads, params, exp_avg, exp_avg_sq: nothing to update
    name = type(base).__name__
    if name == "DeepSpeedCPUAdam" and hasattr(base, "ds_opt_adam"):
        # adam_update(opt_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, p, g, m, v)
        return lambda: base.ds_opt_adam.adam_update(base.opt_id, 0, 0.0, _NAN, _NAN, 0.0, 0.0, False,
                                                    *(e[0] for e in empty))
    if name == "FusedAdam" and hasattr(base, "multi_tensor_adam") and get_accelerator().device_name() == "cpu":
        # multi_tensor_adam(chunk, noop, lists, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay);
        # one C++ object per mode (AdamW or L2), so the reset uses this optimizer's mode.
        return lambda: base.multi_tensor_adam(1, base._dummy_overflow_buf, empty, 0.0, _NAN, _NAN, 0.0, 0,
                                              base.adam_w_mode, 0, 0.0)
    return None


def stateless_bias_correction(base: Any) -> None:
    """Wrap ``base.step`` (the optimizer ZeRO steps per sub-group) so that each step's
    bias correction is ``1 - beta**t`` from ``t`` and the betas alone (see the module
    docstring). No-op for optimizers without C++ beta-power state."""
    reset = _reset_call(base)
    if reset is None:
        return
    original = base.step

    def step(*args: Any, **kwargs: Any) -> Any:
        reset()
        return original(*args, **kwargs)

    base.step = step
