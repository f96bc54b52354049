"""End this process' distributed state so that another job can start in the same process:
a notebook that runs two trainings one after the other, or a test harness that reuses its
rank processes.

What one job leaves behind, and ``teardown`` undoes:

- the default process group and every group made from it (HDET's replica and shard
  groups, the engines' own), which also invalidates the DeviceMeshes built on them;
- DeepSpeed's handles on them: ``deepspeed.comm``'s backend object and the group caches of
  ``deepspeed.utils.groups`` (a later ``deepspeed.initialize`` would otherwise use groups
  of the destroyed world and fail with "Group ... is not registered");
- Accelerate's process-wide states (``PartialState``, ``AcceleratorState``,
  ``GradientState``), which the Hugging Face Trainer (and ``HDETTrainer``) builds once per
  process;
- hdet-train's per-process step and outcome records (``train/stopping.py``).

Modules that were never imported are left alone (teardown imports no engine). The run
lock ``hdet-train`` takes on its ``run_dir`` is kept: it is released when the process ends,
as a lock must be for a job that may still own files there.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["teardown"]


def teardown() -> None:
    """Destroy this process' process groups and reset the caches that refer to them.

    Call it on every rank after a job's last collective (after the last checkpoint save
    and the final converge); a later job in the same process then starts as in a fresh
    one (``torch.distributed.init_process_group`` or ``deepspeed.init_distributed``, then
    the engine). Safe to call when no process group was started, and twice.

    Raises:
        Nothing of its own; ``torch.distributed.destroy_process_group``'s errors pass
        through.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None  # its next init_distributed builds a backend on the new world
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        # Its caches are module globals read through the module (groups._X), so executing
        # the module again in the same namespace resets every one of them.
        importlib.reload(groups)
    accelerate = sys.modules.get("accelerate.state")
    if accelerate is not None:
        # Accelerate's states are process-wide singletons holding the world they were made
        # in (the HF Trainer builds them): clear them as Accelerate's own tests do.
        accelerate.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate.GradientState._reset_state()
    stopping = sys.modules.get("hdet_scale.train.stopping")
    if stopping is not None:
        stopping._step = stopping._shared = stopping._outcome = None
