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
  process, transformers' reference to the last DeepSpeed config (which builds later models
  under ``zero.Init``) and ``HDETTrainer``'s cached layouts;
- hdet-train's per-process step, outcome and start-time records (``train/stopping.py``).

What it does not undo: warning filters, logger levels, RNG states and signal handlers a
job set (a job's own business; a harness that reuses processes restores them itself).

Modules that were never imported are left alone (teardown imports no engine). The run
lock ``hdet-train`` takes on its ``run_dir`` is kept: it is released when the process ends,
as a lock must be for a job that may still own files there.
"""

from __future__ import annotations

import importlib
import sys
import time

__all__ = ["teardown"]


def teardown() -> None:
    """Destroy this process' process groups and reset the caches that refer to them.

    Call it on every rank after a job's last collective (after the last checkpoint save
    and the final converge); a later job in the same process then starts its world and
    engine as it would in a fresh process (``torch.distributed.init_process_group`` or
    ``deepspeed.init_distributed``, then the engine). Safe to call when no process group
    was started, and twice.

    Raises:
        Nothing of its own; ``torch.distributed.destroy_process_group``'s errors pass
        through.
    """
    import torch.distributed as dist

    comm = sys.modules.get("deepspeed.comm.comm")
    if dist.is_available() and dist.is_initialized():
        if comm is not None and comm.cdb is not None:
            comm.destroy_process_group()  # DeepSpeed's own: the world and its references to it
        else:
            dist.destroy_process_group()
    if comm is not None:
        comm.cdb = None  # its next init_distributed builds a backend on the new world
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is not None:
        release = getattr(groups, "_release_process_group_references", None)
        if release is not None:
            release(None)  # also the sequence-parallel groups, where they were imported
        else:
            # Older DeepSpeed: its caches are module globals read through the module
            # (groups._X), so executing the module again in its namespace resets them.
            importlib.reload(groups)
    accelerate = sys.modules.get("accelerate.state")
    if accelerate is not None:
        # Accelerate's states are process-wide singletons holding the world they were made
        # in (the HF Trainer builds them): clear them as Accelerate's own tests do.
        accelerate.AcceleratorState._reset_state(reset_partial_state=True)
        accelerate.GradientState._reset_state()
    hf_deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    if hf_deepspeed is not None:
        # While the last TrainingArguments lives, transformers would build every later
        # model under zero.Init (is_deepspeed_zero3_enabled reads this reference).
        hf_deepspeed.unset_hf_deepspeed_config()
    hf = sys.modules.get("hdet_scale.hf")
    if hf is not None:
        hf._TOPOLOGIES.clear()  # HDETTrainer's layouts hold the destroyed world's groups
    stopping = sys.modules.get("hdet_scale.train.stopping")
    if stopping is not None:
        stopping._step = stopping._shared = stopping._outcome = None
        stopping._STARTED = time.time()  # checkpoints older than this are an earlier job's
