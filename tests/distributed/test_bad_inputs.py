"""Bad input to ``hdet-train`` and ``hdet-dryrun``: each case exits with its documented
code (2: bad input, 3: a stale DeepSpeed op lock) within seconds, with one message naming
the offending key or file and no traceback, and leaves no process behind.

Each case runs the CLI's own ``main`` with the case's arguments: the cases in
``SUBPROCESS`` (one or more of each kind, every case with an environment, every FIFO and
every case whose refusal comes from started ranks) as a real CLI subprocess, the others
in this process, captured (``main`` returns the exit code; a Python exception escaping it
is the traceback a user would see, and fails the case). In this process they cost no
torch import each (a subprocess spends 1.5-4 s importing torch): 164 subprocesses took
172 s of a 24-minute suite. None starts DeepSpeed: the trainer's launcher
validates config, data, run_dir, checkpoint and the op locks before it starts any rank
(the launcher-side half of the standard; ``test_train.py`` checks the same on every rank
under a launcher). Checkpoints here are written with ``torch.save`` in the layout the
backends write (``replica_<r>/<tag>/...``, ``hdet_layout.json``, ``latest``): the checks
read file structure only, so a real engine's files are no different to them (a real
DeepSpeed checkpoint cut short: ``test_signals.py``).

"No process left behind": ``cli_processes.left_behind`` (a marker in each launch's
environment, which its children inherit).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from cli_processes import hostfile_standins, left_behind, run_cli, with_marker

pytestmark = pytest.mark.timeout(600)


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


_FP16 = _fp16_supported()

EXIT_S = 30  # the standard: every bad input ends the run within 30 s (measured: 1.5-6 s each)
TRAIN = [sys.executable, "-m", "hdet_scale.train.cli"]
DRYRUN = [sys.executable, "-m", "hdet_scale.dryrun"]
LAYOUT = {"world_size": 4, "replicas": 2, "shard_size": 2, "step": 10, "total_steps": 300, "backend": "deepspeed",
          "checkpoints": {"global_step5": 5, "global_step10": 10}}


# ---- files the cases point at ------------------------------------------------------------

def save_pt(path, obj=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj if obj is not None else {"w": torch.zeros(64)}, path)


def checkpoint(run_dir, layout: dict | None = None, latest: str | None = "global_step10", replicas: int = 2,
               shards: int = 2, tag: str = "global_step10", record: list[str] | None = None) -> str:
    """A checkpoint folder in the backends' layout (DeepSpeed's file names), every file a
    complete torch.save archive; returns the checkpoint folder. With ``record`` (overrides
    of the default run config), the settings record a trainer save writes for ``tag``
    (``train/resume_config.py``), made by the trainer's own function."""
    ckpt = run_dir / "checkpoint"
    if record is not None:
        from hdet_scale.train.config import load_run_config
        from hdet_scale.train.resume_config import save_record

        save_record(str(ckpt), tag, load_run_config(None, [f"run_dir={run_dir}", *record]))
    else:  # a record without an entry for the tag: resumes without the comparison
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "hdet_run_config.json").write_text('{"runs": {}}')
    for r in range(replicas):
        for s in range(shards):
            folder = ckpt / f"replica_{r}" / tag
            save_pt(folder / f"hdet_shard_{s}.pt")
            save_pt(folder / f"zero_pp_rank_{s}_mp_rank_00_model_states.pt")
            save_pt(folder / f"zero_pp_rank_{s}_mp_rank_00_optim_states.pt")
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "hdet_layout.json").write_text(json.dumps(LAYOUT if layout is None else layout))
    if latest is not None:
        (ckpt / "latest").write_text(latest)
    (run_dir / "metrics.jsonl").write_text('{"step": 10}\n')
    return str(ckpt)


def cut(path, keep: int) -> str:
    """Cut the file ``path`` to its first ``keep`` bytes (a write that stopped there)."""
    with open(path, "r+b") as f:
        f.truncate(keep)
    return str(path)


def setup_cases(d) -> None:
    """The input files, once per module, in folder ``d``."""
    (d / "empty.json").write_text("")
    (d / "cut.json").write_text('{"train_micro_batch_size_per_gpu": 2, "hdet": {"repl')
    (d / "list.json").write_text("[1, 2]")
    (d / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2, "hdet": {"replicas": 2}}')
    (d / "binary.json").write_bytes(b"\xff\xfe\x00\x01")
    (d / "list.yaml").write_text("- train.steps: 10\n- run_dir: x\n")
    (d / "scalar.yaml").write_text("42\n")
    (d / "broken.yaml").write_text("train: {steps: 10\n")
    (d / "a_file").write_text("not a folder\n")
    (d / "folder.json").mkdir()
    (d / "tiny.txt").write_text("print('hi')\n" * 3)
    (d / "empty_axes.yaml").write_text("deepspeed:\n  hdet:\n    axes: {}\n")
    (d / "empty.txt").write_text("")
    (d / "hdet_null.json").write_text('{"train_micro_batch_size_per_gpu": 2, "hdet": null}')
    (d / "lr_nan.json").write_text('{"optimizer": {"type": "AdamW", "params": {"lr": NaN}}}')
    # repeated keys, sections given as a value, DeepSpeed JSONs for hdet-dryrun
    (d / "twice.yaml").write_text("train:\n  steps: 10\n  steps: 20\n")
    (d / "section_list.yaml").write_text("train:\n  - 1\n  - 2\n")
    zero3 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
             "hdet": {"replicas": 2, "sync_interval": 10, "schedule": {"total_steps": 100}}}
    for name, edit in {"lr_negative": {"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "bf16_true": {"bf16": True},
                       "total_steps_fraction": {"hdet": {**zero3["hdet"], "schedule": {"total_steps": 10.5}}}}.items():
        (d / f"{name}.json").write_text(json.dumps({**zero3, **edit}))
    # a batch key < 1, a key twice in the hdet block, no total_steps and other errors
    (d / "gas_negative.json").write_text(json.dumps({**zero3, "gradient_accumulation_steps": -1}))
    (d / "hdet_twice.json").write_text(json.dumps(zero3).replace('"replicas": 2', '"replicas": 2, "replicas": 4'))
    (d / "no_total_scheduler.json").write_text(json.dumps(
        {**zero3, "scheduler": {"type": "WarmupLR", "params": {}}, "zero_optimization": {"stage": 2},
         "hdet": {"replicas": 2, "sync_interval": 10}}))
    # an optimizer the ddp engine cannot build (hdet-train refuses it)
    (d / "lamb.json").write_text(json.dumps({**zero3, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}))
    # no optimizer block (Megatron-DeepSpeed style): unchecked, a KeyError in every rank
    (d / "no_optimizer.json").write_text(json.dumps({k: v for k, v in zero3.items() if k != "optimizer"}))
    # no hdet block: unchecked, plain data parallelism without a word
    (d / "no_hdet.json").write_text(json.dumps({k: v for k, v in zero3.items() if k != "hdet"}))
    (d / "hdett.json").write_text(json.dumps({**{k: v for k, v in zero3.items() if k != "hdet"}, "hdett": zero3["hdet"]}))
    # a config path naming a FIFO must not block in open() forever, printing nothing
    os.mkfifo(d / "fifo.json")
    # hdet-dryrun's cost model on Hugging Face configs it cannot build
    (d / "valid.json").write_text(json.dumps(zero3))
    (d / "hf_negative.json").write_text('{"model_type": "llama", "hidden_size": -64, "num_hidden_layers": 2}')
    (d / "hf_heads.json").write_text('{"model_type": "llama", "hidden_size": 65, "num_attention_heads": 4}')
    (d / "hf_deep.json").write_text('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 100000}')
    (d / "hf_twice.json").write_text('{"model_type": "llama", "hidden_size": 64, "hidden_size": 128}')
    (d / "yaml11.yaml").write_text("wandb:\n  name: on\n  project: no\n")
    (d / "hf_unknown.json").write_text('{"model_type": "nonexistent_model", "hidden_size": 64}')
    # a --total-steps that differs from the file must not hide the file's other errors
    (d / "nan_inf.json").write_text(json.dumps(zero3).replace('"sync_interval": 10', '"sync_interval": 10, "axes": '
                                                              '{"lr": {"spread_ratio": NaN}}'))


# ---- the cases: (id, argv, environment, exit code, text the message must contain) --------
# "{d}": the inputs folder; "{run}": this case's own run_dir (not created unless the setup does).

def _ckpt(layout=None, latest="global_step10", damage=None, record=None):
    def make(run):
        ckpt = checkpoint(run, layout=layout, latest=latest, record=record)
        return damage(run / "checkpoint") if damage else ckpt
    return make


def _copy_tag(ckpt, tag: str, to: str) -> None:
    """Every replica's folder of ``tag`` copied as ``to`` (an older complete checkpoint)."""
    import shutil

    for r in range(2):
        shutil.copytree(ckpt / f"replica_{r}" / tag, ckpt / f"replica_{r}" / to)


def _ddp_ckpt_with_foreign_file(run) -> None:
    """A DDP checkpoint whose every file is a complete archive (the CRC check passes), but
    whose ``model_optim.pt`` holds an empty dict: another program's file in its place."""
    # 2 ranks (2 replicas x 1), not 4: the refusal comes from the ranks' load, after their
    # start-up, which 4 ranks beside the other cases took to 22-32 s of the 30 s limit
    checkpoint(run, layout={**LAYOUT, "backend": "ddp", "world_size": 2, "shard_size": 1}, shards=1)
    for r in range(2):
        torch.save({}, run / "checkpoint" / f"replica_{r}" / "global_step10" / "model_optim.pt")


def plant_stale_lock(run) -> None:
    """An empty op folder with a lock an hour old that no process holds: what a DeepSpeed
    start killed while it loaded its ops leaves (a private TORCH_EXTENSIONS_DIR, so the
    real cache is never touched)."""
    lock = run.parent / f"{run.name}_ext" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))


def plant_stale_lock_folder(run) -> None:
    """A folder where torch's loader makes its lock file: it blocks the loader just the
    same, and ``rm`` would refuse it."""
    lock = run.parent / f"{run.name}_ext" / "fused_adam" / "lock"
    lock.mkdir(parents=True)
    old = time.time() - 3600
    os.utime(lock, (old, old))


CASES = [
    # how the command line and config files are read
    ("no_equals", ["train.steps", "10"], {}, 2, ["train.steps=10"], None),
    ("second_bare_arg", ["{d}/list.yaml", "train.steps"], {}, 2, ["list.yaml"], None),
    ("yaml_missing", ["{d}/nope.yaml"], {}, 2, ["nope.yaml", "does not exist"], None),
    ("yaml_list", ["{d}/list.yaml"], {}, 2, ["list.yaml", "mapping"], None),
    ("yaml_scalar", ["{d}/scalar.yaml"], {}, 2, ["scalar.yaml", "mapping"], None),
    ("ds_json_as_run_config", ["{d}/ds.json"], {}, 2, ["ds.json", "deepspeed_config={d}/ds.json"], None),
    ("yaml_syntax", ["{d}/broken.yaml"], {}, 2, ["broken.yaml", "not valid YAML"], None),
    ("yaml_key_twice", ["{d}/twice.yaml"], {}, 2, ["twice.yaml", "train.steps twice (lines 2 and 3)"], None),
    ("yaml_section_list", ["{d}/section_list.yaml"], {}, 2, ["section_list.yaml", "train: must be a mapping"], None),
    ("section_list", ["train=[1,2]"], {}, 2, ["train: must be a mapping", "train.steps="], None),
    ("section_scalar", ["model=5"], {}, 2, ["model: must be a mapping", "model.hidden_size="], None),
    ("ds_json_empty", ["deepspeed_config={d}/empty.json"], {}, 2, ["empty.json", "empty"], None),
    ("ds_json_cut", ["deepspeed_config={d}/cut.json"], {}, 2, ["cut.json", "not valid JSON"], None),
    ("ds_json_list", ["deepspeed_config={d}/list.json"], {}, 2, ["list.json", "JSON object"], None),
    ("ds_json_binary", ["deepspeed_config={d}/binary.json"], {}, 2, ["binary.json", "UTF-8"], None),
    ("ds_json_missing", ["deepspeed_config={d}/nope.json"], {}, 2, ["nope.json", "does not exist"], None),
    ("ds_json_folder", ["deepspeed_config={d}/folder.json"], {}, 2, ["folder.json", "folder"], None),
    ("ds_section_scalar", ["deepspeed=5"], {}, 2, ["deepspeed:", "mapping"], None),
    ("ds_json_fifo", ["deepspeed_config={d}/fifo.json"], {}, 2, ["fifo.json' is not a regular file but a FIFO"], None),
    ("yaml_fifo", ["{d}/fifo.json"], {}, 2, ["config file", "fifo.json' is not a regular file but a FIFO"], None),
    # each override alone (not YAML, a section then its key, a key twice), interpolations at load
    ("override_not_yaml", ["train.steps=[1,"], {}, 2, ["override 'train.steps=[1,'", "not a valid YAML value"], None),
    ("section_then_its_key", ["train=[1,2]", "train.progress=false"], {}, 2, ["train: must be a mapping"], None),
    ("override_twice", ["train.steps=5", "train.steps=7"], {}, 2,
     ["multiple values for train.steps: 'train.steps=5' and 'train.steps=7'"], None),
    ("interpolation_env_unset", ["run_dir=${{oc.env:HDET_TEST_NOPE_NOT_SET}}"], {}, 2,
     ["run_dir: the interpolation '${{oc.env:HDET_TEST_NOPE_NOT_SET}}'", "Environment variable"], None),
    # unchecked, DeepSpeed would assert in every rank after 29 s
    ("ds_json_gas_negative", ["deepspeed_config={d}/gas_negative.json"], {}, 2,
     ["deepspeed.gradient_accumulation_steps: must be an integer >= 1", "got -1"], None),
    # a DeepSpeed block given as a value: unchecked, DeepSpeed's TypeError inside every rank names no key
    ("ds_bf16_value", ["deepspeed.bf16=true"], {}, 2, ['deepspeed.bf16: must be a JSON object, e.g. {{"enabled": true}}'],
     None),
    ("ds_zero_value", ["deepspeed.zero_optimization=5"], {}, 2,
     ['deepspeed.zero_optimization: must be a JSON object, e.g. {{"stage": 3}}'], None),
    # the hdet block's logging.jsonl has no trainer counterpart: warned at the launcher (here before a data error)
    ("hdet_logging_jsonl_warned", ["deepspeed.hdet.logging.jsonl=m.jsonl", "data.path=/nonexistent/corpus"], {}, 2,
     ["deepspeed.hdet.logging.jsonl='m.jsonl' is not used by hdet-train", "data.path"], None),
    # values DeepSpeed would fail on inside every rank, or train on without a word
    ("ds_hdet_null", ["deepspeed_config={d}/hdet_null.json"], {}, 2, ["deepspeed.hdet", "object"], None),
    ("lr_nan", ["deepspeed_config={d}/lr_nan.json"], {}, 2, ["deepspeed.optimizer.params.lr", "> 0"], None),
    ("lr_negative", ["deepspeed.optimizer.params.lr=-1"], {}, 2, ["deepspeed.optimizer.params.lr"], None),
    ("lr_text", ["deepspeed.optimizer.params.lr=abc"], {}, 2, ["deepspeed.optimizer.params.lr"], None),
    ("lr_bool", ["deepspeed.optimizer.params.lr=true"], {}, 2, ["deepspeed.optimizer.params.lr"], None),
    ("betas_one", ["deepspeed.optimizer.params.betas=[0.9]"], {}, 2, ["deepspeed.optimizer.params.betas"], None),
    ("clip_text", ["deepspeed.gradient_clipping=abc"], {}, 2, ["deepspeed.gradient_clipping"], None),
    ("optimizer_scalar", ["deepspeed.optimizer=5"], {}, 2, ["deepspeed.optimizer:", "object"], None),
    ("optimizer_params_scalar", ["deepspeed.optimizer.params=5"], {}, 2, ["deepspeed.optimizer.params:"], None),
    ("wrong_type", ["train.steps=ten"], {}, 2, ["train.steps"], None),
    ("unknown_key", ["train.stepz=10"], {}, 2, ["stepz"], None),
    ("nproc_zero", ["nproc=0"], {}, 2, ["nproc"], None),
    # unchecked, 100000 local ranks would start until the out-of-memory killer takes the machine down
    ("nproc_beyond_memory", ["nproc=100000"], {}, 2, ["nproc=100000", "GiB available", "ranks fit"], None),
    ("bad_backend", ["backend=fsdp"], {}, 2, ["backend"], None),
    # data
    ("data_missing", ["data.path=/nonexistent/corpus"], {}, 2, ["data.path"], None),
    ("data_too_small", ["data.path={d}/tiny.txt"], {}, 2, ["data.seq_len"], None),
    ("data_empty", ["data.path={d}/empty.txt"], {}, 2, ["data.path"], None),
    # an empty value (an unset $DATA) is not null: it would train on the built-in corpus without a word
    ("data_path_empty", ["data.path="], {}, 2, ["data.path: empty value", "data.path=null", "built-in corpus"], None),
    ("run_dir_empty", ["run_dir="], {}, 2, ["run_dir: empty value", "runs/default"], None),
    # an empty project: the run would go to the W&B project "hdet" without a word
    ("wandb_project_empty", ["wandb.project="], {}, 2, ["wandb.project: empty value", "a W&B project name",
                                                       "hdet-scale"], None),
    # named with the valid values, not "Incompatible value 'None'"
    ("backend_empty", ["backend="], {}, 2,
     ["backend: empty or null value", "one of deepspeed, fsdp2, ddp, fairscale"], None),
    # DeepSpeed-only memory and precision keys, which the other engines would ignore silently
    # (a run that needs CPU offload to fit would fail hours in)
    ("offload_under_fairscale", ["backend=fairscale", "deepspeed.zero_optimization.offload_optimizer.device=cpu"],
     {}, 2, ["deepspeed.zero_optimization.offload_optimizer: DeepSpeed's offload to 'cpu'", "fairscale backend"],
     None),
    ("zeropp_under_fsdp2", ["backend=fsdp2", "deepspeed.zero_optimization.zero_quantized_gradients=true"], {}, 2,
     ["deepspeed.zero_optimization.zero_quantized_gradients", "fsdp2 backend communicates at full precision"], None),
    ("data_path_blank", ["data.path=  "], {}, 2, ["data.path: empty value", "data.path=null"], None),
    ("data_path_quoted_empty", ['data.path=""'], {}, 2, ["data.path='' names no path", "built-in corpus"], None),
    ("data_val_fraction", ["data.val_fraction=1.5"], {}, 2, ["data.val_fraction"], None),
    ("data_max_bytes", ["data.max_bytes=0"], {}, 2, ["data.max_bytes"], None),
    # a file that is not text, or not a regular file (a FIFO must not block the start)
    ("data_torch_file", ["data.path={run}.pt"], {}, 2, ["data.path: file", "{run}.pt", "not UTF-8 text", "NUL byte"],
     lambda run: torch.save({"w": torch.zeros(64)}, f"{run}.pt")),
    ("data_program", ["data.path=/bin/ls"], {}, 2, ["'/bin/ls' is not UTF-8 text"], None),
    ("data_dev_null", ["data.path=/dev/null"], {}, 2, ["'/dev/null' is not a regular file but a character device"],
     None),
    ("data_fifo", ["data.path={run}.fifo"], {}, 2, ["{run}.fifo' is not a regular file but a FIFO"],
     lambda run: os.mkfifo(f"{run}.fifo")),
    # procfs: unchecked, a run would train on the live system's files without a word
    ("data_procfs", ["data.path=/proc/self"], {}, 2, ["'/proc/self' is in /proc, a kernel pseudo-filesystem"], None),
    # layout (world = nproc; replicas must divide it)
    ("replicas_not_dividing", ["deepspeed.hdet.replicas=3"], {}, 2,
     ["deepspeed.hdet.replicas: nproc=4 (the default) gives a world of 4 ranks", "multiple of 3"], None),
    ("world_not_divisible", ["nproc=3"], {}, 2, ["nproc=3 gives a world of 3 ranks", "multiple of 2"], None),
    # nproc=1 is not asked whether a script was started with plain python
    ("world_of_nproc_1", ["nproc=1"], {}, 2,
     ["deepspeed.hdet.replicas: nproc=1 gives a world of 1 rank, and deepspeed.hdet.replicas=2 needs nproc to be a "
      "multiple of 2"], None),
    ("spread_out_of_range", ["deepspeed.hdet.axes.lr.spread_ratio=1.5"], {}, 2, ["hdet.axes.lr.spread_ratio"], None),
    ("sync_interval_zero", ["deepspeed.hdet.sync_interval=0"], {}, 2, ["hdet.sync_interval"], None),
    # hdet block and engine settings (moved from test_train.py)
    ("warmup_not_before_end", ["train.steps=50", "deepspeed.hdet.auto.warmup_steps=50"], {}, 2,
     ["hdet.auto.warmup_steps"], None),
    ("decay_out_of_range", ["deepspeed.hdet.auto.decay=1.5"], {}, 2, ["hdet.auto.decay"], None),
    # the paper controller's derived gamma < 0 (the log controller derives none)
    ("paper_gamma_negative", ["deepspeed.hdet.auto.controller=paper", "deepspeed.hdet.auto.fitness=train_loss",
                              "deepspeed.hdet.schedule.name=onecycle", "deepspeed.hdet.schedule.final_div_factor=0.01"],
     {}, 2, ["hdet.auto.decay"], None),
    ("hdet_key_misspelled", ["deepspeed.hdet.sync_intervall=10"], {}, 2, ["hdet.sync_intervall"], None),
    ("ds_scheduler", ["deepspeed.scheduler.type=WarmupLR"], {}, 2, ["scheduler"], None),
    ("ds_optimizer_unknown", ["deepspeed.optimizer.type=AdamX"], {}, 2, ["deepspeed.optimizer.type"], None),
    ("ddp_bf16", ["backend=ddp", "deepspeed.bf16.enabled=true"], {}, 2, ["deepspeed.bf16.enabled"], None),
    ("fsdp2_optimizer", ["backend=fsdp2", "deepspeed.optimizer.type=Lamb"], {}, 2, ["deepspeed.optimizer.type"], None),
    ("fairscale_optimizer_param", ["backend=fairscale", "deepspeed.optimizer.params.amsgrad_typo=true"], {}, 2,
     ["deepspeed.optimizer.params"], None),
    ("ddp_replicas_not_dividing", ["backend=ddp", "deepspeed.hdet.replicas=3"], {}, 2, ["hdet.replicas"], None),
    # W&B would fail on rank 0 after the start (online without a key: a UsageError
    # traceback), or silently write elsewhere (an unwritable wandb.dir)
    ("wandb_online_without_key", ["wandb.mode=online"], {"WANDB_API_KEY": "", "NETRC": "{run}.netrc"}, 2,
     ["wandb.mode=online, but no W&B API key is configured", "wandb.mode=offline"], None),
    # under a file: unwritable even for root (/proc is refused below)
    ("wandb_dir_unwritable", ["wandb.mode=offline", "wandb.dir={d}/list.yaml/wandb"], {}, 2,
     ["wandb.dir: cannot write to {d}/list.yaml/wandb"], None),
    # run_dir
    ("run_dir_under_a_file", ["run_dir={d}/a_file/run"], {}, 2, ["run_dir", "a_file"], None),
    ("run_dir_unwritable", ["run_dir=/proc/hdet_run"], {}, 2, ["run_dir", "/proc/hdet_run"], None),
    # the filesystem root: a run would train and write checkpoint/, plots/... among the system's folders
    ("run_dir_root", ["run_dir=/"], {}, 2, ["run_dir: / is the filesystem root", "run_dir=runs/my_run"], None),
    # found before the start, not by rank 0 at the trim of a resume, with 4 tracebacks
    ("run_dir_metrics_a_folder", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["{run}/metrics.jsonl is not a file"], _ckpt(damage=lambda c: (os.remove(c.parent / "metrics.jsonl"),
                                                                 (c.parent / "metrics.jsonl").mkdir()))),
    # a link to nothing: named as such, not "File exists"
    ("run_dir_broken_link", ["run_dir={run}"], {}, 2, ["run_dir: {run} is a symbolic link to", "does not exist"],
     lambda run: (run.parent.mkdir(parents=True, exist_ok=True), run.symlink_to(run.parent / "nowhere"))),
    ("run_dir_holds_a_run", ["run_dir={run}"], {}, 2, ["already holds a run", "train.overwrite=true"],
     lambda run: (run.mkdir(parents=True), (run / "metrics.jsonl").write_text('{"step": 1}\n'))),
    # resume
    ("resume_no_checkpoint", ["run_dir={run}", "train.resume=true"], {}, 2, ["no checkpoint to resume"],
     lambda run: (run.mkdir(parents=True), (run / "metrics.jsonl").write_text('{"step": 1}\n'))),
    ("resume_no_latest", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["checkpoint has no latest", "echo global_step10 >", "train.overwrite=true"], _ckpt(latest=None)),
    ("resume_empty_latest", ["run_dir={run}", "train.resume=true"], {}, 2, ["checkpoint/latest", "empty"],
     _ckpt(latest="")),
    ("resume_latest_names_nothing", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["checkpoint/latest names 'global_step99', which hdet_layout.json does not list", "global_step10 (step 10)"],
     _ckpt(latest="global_step99")),
    # a path in latest: refused by the start-up check, not failing inside every rank
    ("resume_latest_a_path", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["names '../../other/checkpoint/replica_0/global_step10', which hdet_layout.json does not list"],
     _ckpt(latest="../../other/checkpoint/replica_0/global_step10")),
    # an archive of other content in place of a checkpoint file: named (a KeyError would name no file)
    ("resume_model_file_replaced", ["run_dir={run}", "train.resume=true", "backend=ddp", "nproc=2"], {}, 2,
     ["/global_step10/model_optim.pt is not what this backend wrote there: no ['model', 'optimizer'] entry",
      "it holds []"], lambda run: _ddp_ckpt_with_foreign_file(run)),
    ("wandb_mode_env_unknown", ["wandb.enabled=true"], {"WANDB_MODE": "bogus"}, 2,
     ["WANDB_MODE='bogus' is not a W&B mode"], None),
    # refused before the start, not by rank 0's wandb.init after the ranks start with advice to check the network
    ("wandb_project_slash", ["wandb.enabled=true", "wandb.mode=offline", "wandb.project=a/b"], {}, 2,
     ["wandb.project: Invalid project name 'a/b': cannot contain characters"], None),
    ("wandb_dir_procfs", ["wandb.enabled=true", "wandb.dir=/proc/hdet_wandb"], {"WANDB_MODE": "offline"}, 2,
     ["wandb.dir: /proc/hdet_wandb is in /proc, a kernel filesystem"], None),
    ("model_rope_theta_inf", ["model.rope_theta=1e400"], {}, 2, ["model.rope_theta must be a finite number > 0"],
     None),
    # a yes/no key given 2 would replace the run (OmegaConf reads 2 as true)
    ("bool_key_given_an_integer", ["train.overwrite=2"], {}, 2, ["train.overwrite: must be true or false, got 2"],
     None),
    # a multiplicative weight-decay spread of a decay of 0 would explore nothing
    ("multiplicative_axis_on_zero", ["backend=ddp", "deepspeed.hdet.axes.weight_decay={{spread_ratio: 0.5}}",
                                     "deepspeed.optimizer.params.weight_decay=0"], {}, 2,
     ["deepspeed.hdet.axes.weight_decay: a multiplicative spread of a weight_decay of 0", "nothing is explored"],
     None),
    # 100000 eval batches would allocate gigabytes, then a traceback after 60 s
    ("eval_batches_beyond_the_split", ["train.eval_batches=100000", "data.max_bytes=200000"], {}, 2,
     ["train.eval_batches=100000 asks for", "validation split (20000 bytes", "at most"], None),
    # a deleted settings record must not let a changed model shape reach the ranks' load
    ("resume_run_config_lost", ["run_dir={run}", "train.resume=true", "model.hidden_size=64"], {}, 2,
     ["checkpoint/hdet_run_config.json is missing", 'write {{"runs": {{}}}} into it'],
     _ckpt(record=[], damage=lambda c: os.remove(c / "hdet_run_config.json"))),
    # a head size transformers' RoPE refuses would fail in every rank, after W&B
    # starts (and after train.overwrite removes the earlier run)
    ("model_odd_head_size", ["model.hidden_size=30", "model.num_heads=2"], {}, 2,
     ["model.hidden_size=30 / model.num_heads=2 gives heads of 15 dimensions", "even head size"], None),
    # an additive weight-decay spread below 0 would train one replica at -0.5
    ("additive_decay_below_zero", ["backend=ddp", "deepspeed.hdet.axes.weight_decay={{spread_ratio: 0.5, kind: additive}}",
                                   "deepspeed.optimizer.params.weight_decay=0.0"], {}, 2,
     ["deepspeed.hdet.axes.weight_decay.spread_ratio: an additive spread of 0.5", "to -0.5 for one replica"], None),
    ("resume_layout_cut", ["run_dir={run}", "train.resume=true"], {}, 2, ["hdet_layout.json", "damaged"],
     _ckpt(damage=lambda c: cut(c / "hdet_layout.json", 30))),
    ("resume_layout_list", ["run_dir={run}", "train.resume=true"], {}, 2, ["hdet_layout.json", "damaged"],
     _ckpt(damage=lambda c: (c / "hdet_layout.json").write_text("[4, 2, 2]"))),
    # the older checkpoint the layout lists is offered as the way on only where its folders are
    # (two incomplete tags are not offered as the way on from each other)
    ("resume_model_states_cut", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["replica_1/global_step10/zero_pp_rank_0_mp_rank_00_model_states.pt", "truncated", "global_step5 (step 5)"],
     _ckpt(damage=lambda c: (_copy_tag(c, "global_step10", "global_step5"),
                             cut(c / "replica_1/global_step10/zero_pp_rank_0_mp_rank_00_model_states.pt", 300)))),
    ("resume_model_states_cut_older_gone", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["replica_1/global_step10/zero_pp_rank_0_mp_rank_00_model_states.pt", "truncated",
      "restore them from a copy, or start a new run_dir"],
     _ckpt(damage=lambda c: cut(c / "replica_1/global_step10/zero_pp_rank_0_mp_rank_00_model_states.pt", 300))),
    ("resume_optim_states_empty", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["replica_0/global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt", "empty"],
     _ckpt(damage=lambda c: cut(c / "replica_0/global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt", 0))),
    ("resume_hdet_state_cut", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["replica_0/global_step10/hdet_shard_1.pt", "truncated"],
     _ckpt(damage=lambda c: cut(c / "replica_0/global_step10/hdet_shard_1.pt", 50))),
    # a read-only checkpoint folder would fail at the first save, 51 s in, with a
    # traceback; a read-only metrics.jsonl would be replaced by a writable copy without a word
    ("resume_checkpoint_read_only", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["train.resume: {run}/checkpoint is read-only", "chmod -R u+w {run}"], _ckpt(damage=lambda c: os.chmod(c, 0o555))),
    ("resume_metrics_read_only", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["train.resume: {run}/metrics.jsonl is read-only", "appends to metrics.jsonl"],
     _ckpt(damage=lambda c: os.chmod(c.parent / "metrics.jsonl", 0o444))),
    ("resume_replica_folder_lost", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["no folder for replica(s) [1]"], _ckpt(damage=lambda c: shutil.rmtree(c / "replica_1"))),
    ("resume_rank_state_lost", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["incomplete: missing replica_0/global_step10/hdet_shard_1.pt"],
     _ckpt(damage=lambda c: os.remove(c / "replica_0/global_step10/hdet_shard_1.pt"))),
    ("resume_other_layout", ["run_dir={run}", "train.resume=true"], {}, 2, ["2 replicas x 1 shards"],
     _ckpt(layout={**LAYOUT, "world_size": 2, "shard_size": 1})),
    # the parenthesis gives the checkpoint's values (to resume it), not this run's
    ("resume_other_backend", ["run_dir={run}", "train.resume=true"], {}, 2,
     ["fsdp2 backend", "(to resume it: backend=fsdp2, a world of 4 ranks from nproc or the launcher, "
                       "deepspeed.hdet.replicas=2; or use another run_dir)"],
     _ckpt(layout={**LAYOUT, "backend": "fsdp2"})),
    ("resume_other_steps", ["run_dir={run}", "train.resume=true", "train.steps=30",
                            "deepspeed.hdet.auto.warmup_steps=5"], {}, 2, ["total_steps=300"],
     _ckpt()),
    ("resume_nothing_left", ["run_dir={run}", "train.resume=true", "train.steps=10",
                             "deepspeed.hdet.schedule.total_steps=300", "deepspeed.hdet.auto.warmup_steps=5"], {}, 2,
     ["nothing is left"], _ckpt()),
    # settings changed since the checkpoint that its state cannot take (recorded at its save)
    ("resume_model_shape_changed", ["run_dir={run}", "train.resume=true", "model.hidden_size=64", "model.num_layers=2"],
     {}, 2, ["model.hidden_size: 128 -> 64", "model.num_layers: 4 -> 2", "(global_step10, step 10)"],
     _ckpt(record=[])),
    ("resume_state_settings_changed", ["run_dir={run}", "train.resume=true", "deepspeed.hdet.sync_interval=5",
                                       "deepspeed.optimizer.type=Adam"], {}, 2,
     ["deepspeed.hdet.sync_interval: 25 -> 5", 'deepspeed.optimizer.type: "AdamWScheduleFree" -> "Adam"'],
     _ckpt(record=[])),
    # environment: the fault-injection hook, a stale DeepSpeed op lock in a private extensions folder
    ("fault_hook_malformed", [], {"HDET_FAULT_KILL": "three"}, 2, ["HDET_FAULT_KILL"], None),
    ("fault_hook_rank_out_of_range", [], {"HDET_FAULT_KILL": "4:5"}, 2,
     ["HDET_FAULT_KILL='4:5' would never fire", "rank in [0, 3] (world size 4)"], None),
    ("fault_hook_step_out_of_range", [], {"HDET_FAULT_KILL": "0:301"}, 2,
     ["HDET_FAULT_KILL='0:301'", "step in [1, 300] (train.steps)"], None),
    # stray launcher variables without torchrun: a traceback from DeepSpeed's MPI discovery in every rank
    ("env_rank_without_master", [], {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}, 2,
     ["RANK=0 WORLD_SIZE=4 LOCAL_RANK=0 set, but MASTER_ADDR, MASTER_PORT not", "env -u RANK -u WORLD_SIZE -u LOCAL_RANK",
      "torchrun"], None),
    ("env_world_size_alone", [], {"WORLD_SIZE": "2"}, 2, ["WORLD_SIZE=2 set, but RANK, MASTER_ADDR, MASTER_PORT not"],
     None),
    ("env_rank_out_of_range", [], {"RANK": "4", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
     2, ["RANK not in [0, WORLD_SIZE)", "env -u RANK"], None),
    # a leftover RANK other than 0 speaks (the note and the refusal), not silent and waiting 30 min
    ("env_leftover_rank_1", ["train.stpes=3"], {"RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                                "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29999"}, 2,
     ["no launcher (torchrun, deepspeed, srun, mpirun) started this process: it joins that world as rank 1",
      "env -u RANK -u WORLD_SIZE", "train.stpes"], None),
    # an extensions folder torch's loader cannot use (unchecked, a raw traceback in the launcher or each rank)
    ("extensions_dir_is_a_file", [], {"TORCH_EXTENSIONS_DIR": "{d}/a_file"}, 2,
     ["TORCH_EXTENSIONS_DIR='{d}/a_file' is a file"], None),
    ("extensions_dir_not_creatable", [], {"TORCH_EXTENSIONS_DIR": "/proc/hdetx"}, 2,
     ["TORCH_EXTENSIONS_DIR='/proc/hdetx' cannot be created in /proc"], None),
    ("stale_op_lock", ["run_dir={run}"], {"TORCH_EXTENSIONS_DIR": "{run}_ext"}, 3,
     ["{run}_ext/fused_adam/lock", "rm {run}_ext/fused_adam/lock", "prebuilt"], plant_stale_lock),
    # unchecked: raw tracebacks on every rank after start-up, silent acceptances, misleading messages
    ("probe_batches_beyond_split", ["train.probe_batches=100000", "data.max_bytes=200000"], {}, 2,
     ["train.probe_batches=100000 asks for", "the training split has", "at most"], None),
    ("seed_beyond_torch_range", ["seed=36893488147419103232"], {}, 2,
     ["seed: must be an integer in [-2**63, 2**64)", "36893488147419103232"], None),
    ("hdet_seed_beyond_torch_range", ["deepspeed.hdet.seed=36893488147419103232"], {}, 2,
     ["deepspeed.hdet.seed: must be an integer in [-2**63, 2**64)"], None),
    ("rank_start_unknown", [], {"HDET_RANK_START": "fork"}, 2,
     ["HDET_RANK_START: expected one of forkserver, spawn, got 'fork'"], None),
    ("steps_per_print_zero", ["deepspeed.steps_per_print=0"], {}, 2,
     ["deepspeed.steps_per_print: must be an integer >= 1"], None),
    # refused exactly where DeepSpeed's own accelerator says no (a CPU without AVX512-FP16
    # or AMX-FP16); on one with it the checks pass and ranks would start
    ("fp16_on_cpu_deepspeed", ["deepspeed.fp16.enabled=true"], {}, 2 if not _FP16 else 99,
     ["deepspeed.fp16.enabled: this machine's DeepSpeed accelerator (cpu) has no fp16"] if not _FP16
     else ["the checks passed and ranks would start"], None),
    ("lamb_on_cpu_deepspeed", ["deepspeed.optimizer.type=Lamb"], {}, 2,
     ["deepspeed.optimizer.type: 'Lamb' needs DeepSpeed's FusedLamb op", "(cpu)"], None),
    ("deepspeed_json_without_hdet", ["deepspeed_config={d}/no_hdet.json", "backend=ddp"], {}, 2,
     ["deepspeed.hdet: {d}/no_hdet.json has no hdet block, so the run would be plain data parallelism"], None),
    # the look-alike block is named, not advice to "add" the block the user believes they have
    ("deepspeed_json_hdett_block", ["deepspeed_config={d}/hdett.json", "backend=ddp"], {}, 2,
     ["deepspeed.hdet: {d}/hdett.json has no hdet block ('hdett' is not read: did you mean 'hdet'?)"], None),
    ("deepspeed_json_without_optimizer", ["deepspeed_config={d}/no_optimizer.json", "train.steps=50"], {}, 2,
     ["deepspeed.optimizer: hdet-train builds the optimizer from this block, and {d}/no_optimizer.json has none"],
     None),
    # nvme_path is checked (unchecked: a traceback from every rank after a minute, no async_io op)
    ("nvme_path_missing", ["deepspeed.zero_optimization.offload_param.device=nvme",
                           "deepspeed.zero_optimization.offload_param.nvme_path={d}/no_such_folder"], {}, 2,
     ["deepspeed.zero_optimization.offload_param.nvme_path: '{d}/no_such_folder' is not an existing folder"], None),
    ("cosine_warmup_past_the_end", ["backend=ddp", "deepspeed.hdet.schedule.name=cosine",
                                    "deepspeed.hdet.schedule.warmup_steps=1000"], {}, 2,
     ["deepspeed.hdet.schedule.warmup_steps: must be shorter than the run (total_steps=300), got 1000"], None),
    ("steps_beyond_2_53", ["train.steps=99999999999999999999"], {}, 2, ["train.steps: must be in [1, 2**53]"], None),
    ("checkpoint_every_without_checkpoint", ["train.checkpoint=false", "train.checkpoint_every=2"], {}, 2,
     ["train.checkpoint_every=2 with train.checkpoint=false"], None),
    ("override_empty_key_part", ["train..steps=5"], {}, 2, ["override 'train..steps=5'", "empty part"], None),
    ("override_empty_key", ["=5"], {}, 2, ["override '=5'"], None),
    ("help_after_overrides", ["train.steps=3", "--help"], {}, 2, ["--help goes first"], None),
    # YAML 1.1 booleans would replace a run (train.overwrite=yes); an empty data.path item be read silently
    ("bool_yaml11_spelling", ["train.overwrite=yes"], {}, 2,
     ["override 'train.overwrite=yes': write true or false"], None),
    ("data_path_empty_item", ["data.path={d}/tiny.txt,,{d}/tiny.txt"], {}, 2,
     ["has an empty item between its commas"], None),
    # unchecked: FusedAdam's AMSGrad refusal in every rank; torch flags taking any truthy value;
    # YAML 1.1 octal and booleans (train.steps=010 would train 8 steps; project: no name it "False")
    ("amsgrad_on_deepspeed_adam", ["deepspeed.optimizer.type=AdamW", "deepspeed.optimizer.params.amsgrad=true"], {}, 2,
     ["deepspeed.optimizer.params.amsgrad: DeepSpeed's Adam (FusedAdam, CPU Adam) has no AMSGrad"], None),
    ("torch_flag_not_a_boolean", ["backend=ddp", "deepspeed.optimizer.type=AdamW", "deepspeed.optimizer.params.maximize=1"],
     {}, 2,
     ["deepspeed.optimizer.params.maximize: must be true or false, got 1"], None),
    ("octal_override", ["train.steps=010"], {}, 2, ["override 'train.steps=010': an octal number in YAML 1.1 (010 = 8)"],
     None),
    ("yaml11_boolean_in_the_run_yaml", ["{d}/yaml11.yaml"], {}, 2,
     ["yaml11.yaml' line 3: wandb.project: no is YAML 1.1's spelling of a boolean"], None),
    ("stale_op_lock_folder", ["run_dir={run}"], {"TORCH_EXTENSIONS_DIR": "{run}_ext"}, 3,
     ["{run}_ext/fused_adam/lock", "a folder", "(rmdir {run}_ext/fused_adam/lock)"], plant_stale_lock_folder),
    # model.max_seq_len is named, not data.seq_len; groups the trainer's one-group optimizer lacks are refused
    # before the start (in every rank after W&B starts: 18-39 s); a wrong type draws no verdict on its default
    # (the single line: test_misconfig.py)
    ("model_max_seq_len_zero", ["model.max_seq_len=0"], {}, 2, ["model.max_seq_len must be an integer >= 1; got 0"],
     None),
    ("lr_groups_beyond_the_optimizer", ["deepspeed.hdet.axes.lr.groups=[5]"], {}, 2,
     ["deepspeed.hdet.axes.lr.groups: group 5 does not exist (the optimizer has 1 parameter groups)"], None),
    ("max_lr_list_beyond_the_optimizer", ["deepspeed.hdet.schedule.max_lr=[1e-3,1e-3,1e-3]"], {}, 2,
     ["deepspeed.hdet.schedule.max_lr: 3 values for 1 parameter groups"], None),
    ("sync_interval_float", ["deepspeed.hdet.sync_interval=5.0"], {}, 2,
     ["deepspeed.hdet.sync_interval: expected int, got 5.0"], None),
    # a string value is refused by type, not as "two base values" that look equal; {} would keep
    # the packaged spread without a word; the bounds message names model.dropout, not the axis' value
    ("dropout_value_a_string", ["model.dropout=0.1",
                                'deepspeed.hdet.axes={{dropout: {{spread_ratio: 0.05, kind: additive, value: "0.1"}}}}'],
     {}, 2, ["deepspeed.hdet.axes.dropout.value: expected float | None, got '0.1'"], None),
    ("empty_object_over_the_packaged_axes", ["deepspeed.hdet.axes={{}}"], {}, 2,
     ["override 'deepspeed.hdet.axes={{}}': overrides merge into", "changes nothing there (it keeps lr)"], None),
    # unchecked: DeepSpeed's assertions in every rank (an untested ZeRO optimizer, a predivide
    # factor, ZeRO++ quantization on CPU); hpZ would train with a wrong loss; {} in the run YAML
    ("zero_untested_optimizer", ["deepspeed.optimizer.type=SGD"], {}, 2,
     ["deepspeed.optimizer.type: DeepSpeed's ZeRO refuses 'SGD'", "unless zero_allow_untested_optimizer is true"],
     None),
    ("zero3_predivide_factor", ["deepspeed.gradient_predivide_factor=2.0"], {}, 2,
     ["deepspeed.gradient_predivide_factor: DeepSpeed's ZeRO-3 supports only 1.0"], None),
    ("zero_hpz_partition_size", ["deepspeed.zero_optimization.zero_hpz_partition_size=2"], {}, 2,
     ["deepspeed.zero_optimization.zero_hpz_partition_size: ZeRO++'s hierarchical partitioning (2) is not supported"],
     None),
    ("zero_quantized_weights_on_cpu", ["deepspeed.zero_optimization.zero_quantized_weights=true"], {}, 2,
     ["deepspeed.zero_optimization.zero_quantized_weights: ZeRO++'s quantization needs DeepSpeed's quantizer op",
      "(cpu)"], None),
    ("yaml_empty_object_over_the_packaged_axes", ["{d}/empty_axes.yaml"], {}, 2,
     ["deepspeed.hdet.axes: {{}} in the run config merges into", "(it keeps lr)"], None),
    ("dropout_bounds_name_model_dropout", ["model.dropout=0.05",
                                           "deepspeed.hdet.axes={{dropout: {{spread_ratio: 0.1, kind: additive}}}}"], {}, 2,
     ["model.dropout (the base of deepspeed.hdet.axes.dropout in hdet-train): 0.05 with spread_ratio 0.1"], None),
]


# The subprocess cases run WORKERS at a time (a process spends most of its 1.5-4 s
# importing torch), the others meanwhile in this process; each test then checks its own
# outcome.
WORKERS = 3

# Real CLI subprocesses besides every case with an environment: a FIFO (a regression
# would block in open() forever: a subprocess is killed by its timeout, this process
# would not be), refusals that come from started ranks, and one or more of each kind.
SUBPROCESS = {
    "no_equals", "yaml_syntax", "ds_json_cut", "ds_json_fifo", "yaml_fifo", "data_fifo", "override_twice",
    "lr_nan", "unknown_key", "data_missing", "replicas_not_dividing", "hdet_key_misspelled", "ds_scheduler",
    "fsdp2_optimizer", "run_dir_unwritable", "run_dir_holds_a_run", "resume_no_latest", "resume_model_states_cut",
    "resume_model_file_replaced", "model_odd_head_size", "bool_yaml11_spelling", "lr_groups_beyond_the_optimizer",
    "dropout_value_a_string", "empty_object_over_the_packaged_axes",
    "dryrun_empty", "dryrun_cut", "dryrun_fifo", "dryrun_hf_config_fifo", "dryrun_lamb_ddp",
    "dryrun_hf_config_unknown_type", "dryrun_option_twice", "dryrun_total_steps_mismatch_and_more",
}


def _in_process(main, argv: list[str]):
    """``main(argv)`` here, as :func:`cli_processes.run_cli` runs a command: ``(exit
    code, stderr, seconds, processes left behind)``. An exception escaping ``main`` is
    returned as its traceback (exit code -1), what the user would have seen."""
    err = io.StringIO()
    _, tag = with_marker({})
    os.environ["HDET_TEST_MARKER"] = tag  # inherited by any process main() would start
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's usage errors
                rc = e.code if isinstance(e.code, int) else 2
            except Exception:  # noqa: BLE001 - the user's traceback, reported by the test
                rc = -1
                err.write(traceback.format_exc())
    finally:
        del os.environ["HDET_TEST_MARKER"]
    return rc, err.getvalue(), time.monotonic() - t0, left_behind(tag)


def _train_argv(case, inputs, run):
    _, argv, env, _, needles, setup = case
    if setup is not None:
        setup(run)
    fill = {"d": inputs, "run": run}
    argv = [a.format(**fill) for a in argv]
    if not any(a.startswith("run_dir=") for a in argv):
        argv.append(f"run_dir={run}")
    env = {k: v.format(**fill) for k, v in env.items()}
    quiet = [] if any(a.startswith("wandb.") for a in argv) else ["wandb.enabled=false"]  # W&B cases set their own
    return [*argv, *quiet], env, [n.format(**fill) for n in needles]


# The cases whose refusal comes from the ranks' own checkpoint load (see outcomes).
STARTS_RANKS = {"resume_model_file_replaced"}


def _run_train_case(case, inputs, run):
    argv, env, needles = _train_argv(case, inputs, run)
    return run_cli([*TRAIN, *argv], env), needles


def _run_dryrun_case(case, inputs):
    _, argv, needles = case
    return run_cli([*DRYRUN, *[a.format(d=inputs) for a in argv], "--world-size", "4"]), needles


def _not_launched(run):
    """In place of ``launch_local`` for the in-process cases: a bad input that passed every
    check must not start ranks inside pytest; its case then fails on the exit code."""
    print("hdet-train: (test) the checks passed and ranks would start", file=sys.stderr)
    return 99


DRYRUN_CASES = [
    ("dryrun_empty", ["{d}/empty.json"], ["empty.json"]),
    ("dryrun_cut", ["{d}/cut.json"], ["cut.json"]),
    ("dryrun_binary", ["{d}/binary.json"], ["binary.json"]),
    ("dryrun_missing", ["{d}/nope.json"], ["nope.json"]),
    ("dryrun_folder", ["{d}/folder.json"], ["folder.json"]),
    ("dryrun_list", ["{d}/list.json"], ["JSON object"]),
    # the values hdet-train refuses (ds_values.check_deepspeed_values), blocks given as a value
    ("dryrun_lr_negative", ["{d}/lr_negative.json"], ["optimizer.params.lr: must be a finite number > 0", "got -1"]),
    ("dryrun_bf16_value", ["{d}/bf16_true.json"], ['bf16: must be a JSON object, e.g. {"enabled": true}; got true']),
    ("dryrun_total_steps_fraction", ["{d}/total_steps_fraction.json"],
     ["hdet.schedule.total_steps: expected int | None, got 10.5"]),  # the only line: test_dryrun.py
    # errors (exit 2), not accepted; the third does not hide the other errors behind the missing total_steps
    ("dryrun_gas_negative", ["{d}/gas_negative.json"], ["gradient_accumulation_steps: must be an integer >= 1", "got -1"]),
    ("dryrun_key_twice", ["{d}/hdet_twice.json"], ["hdet_twice.json", "has the key 'replicas' twice in one object"]),
    ("dryrun_no_total_steps_and_more", ["{d}/no_total_scheduler.json"],
     ["pass --total-steps", "  scheduler:", "  zero_optimization.stage"]),
    # refused (exit 2) in the words of hdet-train's engines.check_engine_config
    ("dryrun_lamb_ddp", ["{d}/lamb.json", "--backend", "ddp", "--total-steps", "10"],
     ["optimizer.type: the ddp backend builds a torch optimizer", "got 'Lamb'"]),
    ("dryrun_fifo", ["{d}/fifo.json", "--total-steps", "10"], ["fifo.json' is not a regular file but a FIFO"]),
    # the cost model's inputs (unchecked: a hang, tracebacks, silent nonsense)
    ("dryrun_hf_config_fifo", ["{d}/valid.json", "--hf-config", "{d}/fifo.json"],
     ["--hf-config:", "fifo.json' is not a regular file but a FIFO"]),
    ("dryrun_hf_config_negative", ["{d}/valid.json", "--hf-config", "{d}/hf_negative.json"],
     ["--hf-config:", "hf_negative.json' does not build a causal LM", "negative dimension"]),
    ("dryrun_hf_config_heads", ["{d}/valid.json", "--hf-config", "{d}/hf_heads.json"],
     ["hf_heads.json' does not build a causal LM", "not a multiple of the number of attention heads"]),
    # refused, not built for 149 s without a line of output, then exit 0
    ("dryrun_hf_config_too_deep", ["{d}/valid.json", "--hf-config", "{d}/hf_deep.json"],
     ["hf_deep.json' has num_hidden_layers=100000", "at most 2000", "--params N"]),
    ("dryrun_hf_config_key_twice", ["{d}/valid.json", "--hf-config", "{d}/hf_twice.json"],
     ["hf_twice.json' has the key 'hidden_size' twice"]),
    ("dryrun_params_absurd", ["{d}/valid.json", "--params", "1e40"], ["--params: expected a whole number"]),
    ("dryrun_bandwidth_absurd", ["{d}/valid.json", "--params", "1B", "--bandwidth-gbps", "1e-300"],
     ["--bandwidth-gbps: expected a number in"]),
    # no second line judging warmup_steps against the refused run length
    ("dryrun_total_steps_negative", ["{d}/valid.json", "--total-steps", "-5"],
     ["--total-steps: must be an integer >= 1", "got -5"]),
    # the NaN spread is reported with the --total-steps mismatch, not hidden behind it
    ("dryrun_total_steps_mismatch_and_more", ["{d}/nan_inf.json", "--total-steps", "500"],
     ["--total-steps 500 is longer than hdet.schedule.total_steps=100", "hdet.axes.lr.spread_ratio: must be finite"]),
    # the message gives the reason, not the tail of transformers' list of model types
    ("dryrun_hf_config_unknown_type", ["{d}/valid.json", "--hf-config", "{d}/hf_unknown.json"],
     ["hf_unknown.json' does not build a causal LM", "nonexistent_model"]),
    # an option given twice is refused (argparse would keep the last of two values)
    ("dryrun_option_twice", ["{d}/ds.json", "--total-steps", "100", "--total-steps", "10"],
     ["--total-steps given twice"]),
]


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """``{case id: ((exit code, stderr, seconds, left behind), needles)}`` of the cases
    this session selected, run WORKERS at a time."""
    selected = {item.callspec.id for item in request.session.items
                if item.path == request.path and hasattr(item, "callspec")}
    inputs = tmp_path_factory.mktemp("inputs")
    setup_cases(inputs)
    from hdet_scale import dryrun
    from hdet_scale.train import cli, launcher

    here = {}
    # A refusal that only started ranks can make is timed alone, before the pool: its
    # 30 s includes the ranks' start-up (torch, the model), which beside WORKERS other
    # cases and a second job on the 2 cores took 31 s in one CI run (14 s alone).
    alone = {c[0]: _run_train_case(c, inputs, tmp_path_factory.mktemp(c[0]) / "run")
             for c in CASES if c[0] in selected and c[0] in STARTS_RANKS}
    with ThreadPoolExecutor(WORKERS) as pool, pytest.MonkeyPatch.context() as mp:
        futures = {c[0]: pool.submit(_run_train_case, c, inputs, tmp_path_factory.mktemp(c[0]) / "run")
                   for c in CASES if c[0] in selected and (c[0] in SUBPROCESS or c[2]) and c[0] not in alone}
        futures.update({c[0]: pool.submit(_run_dryrun_case, c, inputs) for c in DRYRUN_CASES
                        if c[0] in selected and c[0] in SUBPROCESS})
        mp.setattr(launcher, "launch_local", _not_launched)
        for c in CASES:
            if c[0] in selected and c[0] not in futures and c[0] not in alone:
                argv, _, needles = _train_argv(c, inputs, tmp_path_factory.mktemp(c[0]) / "run")
                here[c[0]] = (_in_process(cli.main, argv), needles)
        for c in DRYRUN_CASES:
            if c[0] in selected and c[0] not in futures:
                here[c[0]] = (_in_process(dryrun.main, [*[a.format(d=inputs) for a in c[1]], "--world-size", "4"]),
                              c[2])
        return {**alone, **here, **{k: f.result() for k, f in futures.items()}}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_to_hdet_train(outcomes, case):
    (rc, err, seconds, leftovers), needles = outcomes[case[0]]
    assert rc == case[3], (rc, err[-3000:])
    for needle in needles:
        assert needle in err, (needle, err)
    assert "Traceback" not in err, err
    assert seconds < EXIT_S, seconds
    assert not leftovers, leftovers


@pytest.mark.parametrize("case", DRYRUN_CASES, ids=[c[0] for c in DRYRUN_CASES])
def test_bad_file_to_hdet_dryrun(outcomes, case):
    (rc, err, seconds, leftovers), needles = outcomes[case[0]]
    assert rc == 2, (rc, err[-3000:])
    assert all(n in err for n in needles) and "Traceback" not in err, err
    assert seconds < EXIT_S and not leftovers, (seconds, leftovers)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A valid multi-node / SLURM job environment, one value of which each row below makes bad.
MULTI_NODE = {"NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GPUS": "1",
              "MAX_RESTARTS": "0"}
SLURM_JOB = {"SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1",
             "SLURM_JOB_ID": "1", "GPUS_PER_NODE": "1", "MASTER_PORT": "29500", "MAX_RESTARTS": "0"}


@pytest.mark.parametrize("script,env,needle", [
    ("torchrun_single_node.sh", {"GPUS": "abc"}, "torchrun_single_node.sh: GPUS=abc: expected an integer in [1, 4096]"),
    ("torchrun_single_node.sh", {"GPUS": "1", "MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: expected an integer in [0, "),
    # 10^20 is refused, not a silently growing torchrun (and 08 no bash "value too great for base")
    ("torchrun_single_node.sh", {"GPUS": "99999999999999999999"}, "GPUS=99999999999999999999: expected an integer "
                                                                  "in [1, 4096]"),
    ("torchrun_multi_node.sh", {**MULTI_NODE, "GPUS": "99999999999999999999"}, "GPUS=99999999999999999999: "
                                                                               "expected an integer in [1, 4096]"),
    ("torchrun_multi_node.sh", {"NNODES": "1", "NODE_RANK": "x", "MASTER_ADDR": "a"},
     "torchrun_multi_node.sh: NODE_RANK=x: expected an integer >= 0"),
    ("deepspeed_hostfile.sh", {"HOSTFILE": "{d}/hostfile_without_slots"},
     "GPUS=<empty>: expected an integer in [1, 4096] (set GPUS, or give the first host of {d}/hostfile_without_slots "
     "slots"),
    # the hostfile script's own check: 08 is 8, not bash's "value too great for base" and a refusal
    # (the ssh check that follows answers); 10^20 is refused, not wrapped around and passed
    ("deepspeed_hostfile.sh", {"HOSTFILE": "{d}/hostfile_no_ssh", "GPUS": "08"},
     "cannot be reached by passwordless ssh"),
    ("deepspeed_hostfile.sh", {"HOSTFILE": "{d}/hostfile_no_ssh", "GPUS": "99999999999999999999"},
     "deepspeed_hostfile.sh: GPUS=99999999999999999999: expected an integer in [1, 4096]"),
    ("deepspeed_hostfile.sh", {"HOSTFILE": "{d}/hostfile_no_ssh", "MAX_RESTARTS": "99999999999999999999"},
     "deepspeed_hostfile.sh: MAX_RESTARTS=99999999999999999999: expected an integer in [0, 1000000]"),
    # the same bound on MAX_RESTARTS in every launcher (torchrun_multi_node.sh included)
    ("torchrun_multi_node.sh", {**MULTI_NODE, "MAX_RESTARTS": "1000001"},
     "torchrun_multi_node.sh: MAX_RESTARTS=1000001: expected an integer in [0, 1000000]"),
    ("torchrun_single_node.sh", {"GPUS": "1", "MAX_RESTARTS": "1000001"},
     "torchrun_single_node.sh: MAX_RESTARTS=1000001: expected an integer in [0, 1000000]"),
    # named before the start, not DeepSpeed's "not reachable via ssh" traceback, retried MAX_RESTARTS times
    ("deepspeed_hostfile.sh", {"HOSTFILE": "{d}/hostfile_no_ssh"},
     "host 127.0.0.1 (first in {d}/hostfile_no_ssh) cannot be reached by passwordless ssh"),
    # named, not torchrun's ValueError traceback for the port; NODE_RANK >= NNODES is refused too
    *[("torchrun_multi_node.sh", {**MULTI_NODE, **e}, n) for e, n in [
        ({"MASTER_PORT": "abc"}, "torchrun_multi_node.sh: MASTER_PORT=abc: expected an integer in [1, 65535]"),
        ({"MASTER_PORT": "99999"}, "torchrun_multi_node.sh: MASTER_PORT=99999: expected an integer in [1, 65535]"),
        ({"NODE_RANK": "5"}, "torchrun_multi_node.sh: NODE_RANK=5: expected an integer < NNODES=1"),
    ]],
    # slurm.sbatch's values, checked before scontrol / srun run (unchecked: torchrun's tracebacks)
    # (the SLURM_* variables of a job are set, but no scontrol / srun exists here)
    *[("slurm.sbatch", {**SLURM_JOB, **e}, n) for e, n in [
        ({"GPUS_PER_NODE": "abc"}, "slurm.sbatch: GPUS_PER_NODE=abc: expected an integer >= 1"),
        ({"GPUS_PER_NODE": "0"}, "slurm.sbatch: GPUS_PER_NODE=0: expected an integer >= 1"),
        ({"MAX_RESTARTS": "-1"}, "slurm.sbatch: MAX_RESTARTS=-1: expected an integer >= 0"),
        ({"MASTER_PORT": "abc"}, "slurm.sbatch: MASTER_PORT=abc: expected an integer in [1, 65535]"),
    ]],
])
def test_launcher_scripts_name_a_bad_environment_value(script, env, needle, tmp_path):
    """The launchers check GPUS, MAX_RESTARTS, a hostfile line without slots=,
    MASTER_PORT, NODE_RANK >= NNODES and slurm.sbatch's values before passing them to
    torchrun / deepspeed, whose tracebacks would name no variable: each exits 2 before
    starting anything, naming the variable and what it expects."""
    (tmp_path / "hostfile_without_slots").write_text("localhost\n")
    (tmp_path / "hostfile_no_ssh").write_text("127.0.0.1 slots=1\n")  # no sshd answers here
    env = {k: v.format(d=tmp_path) for k, v in env.items()}
    rc, err, seconds, leftovers = run_cli(["bash", os.path.join(ROOT, "launchers", script), "train.steps=2"], env)
    assert rc == 2 and needle.format(d=tmp_path) in err and "Traceback" not in err, (rc, err)
    assert ": line " not in err, err  # no bash error (GPUS=08: "line 49: [[: 08: value too great for base")
    assert seconds < EXIT_S and not leftovers


def test_the_single_node_launcher_says_when_it_falls_back_to_one_rank(tmp_path):
    """With GPUS unset on a machine without GPUs the script starts one rank and says so
    first (the trainer's refusal of a world of 1 says nothing of GPUS). A PATH without
    torchrun (or nvidia-smi) stops it right after that line (exit 127, its own message),
    so no rank starts here."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "GPUS"}
    env["PATH"] = "/usr/bin:/bin"
    proc = subprocess.run(["bash", os.path.join(ROOT, "launchers", "torchrun_single_node.sh"), "train.steps=2"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 127, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert lines[0] == ("torchrun_single_node.sh: GPUS is unset and nvidia-smi lists no GPU: starting 1 rank (set "
                        "GPUS=N for N ranks, e.g. GPUS=4 for 4 CPU ranks)"), lines
    assert lines[1].startswith("torchrun_single_node.sh: torchrun is not on PATH"), lines


def test_a_refusal_under_the_torchrun_launcher_is_exit_2_once_without_a_restart(tmp_path):
    """``launchers/torchrun_single_node.sh`` with a misspelled key exits 2 with rank 0's
    message once: no restart (which cannot fix a bad input, and would print the message
    again), nothing of the agent's ("closing signal" / "failed (exitcode: 2)" lines,
    torchrun's ChildFailedError traceback, exit 1: torchrun's code for any failure), and
    no refusal marker left for restarts that do not come (train/refusals.py). A crash is
    still restarted: test_resume's torchrun test runs through the same launcher script."""
    # a private temporary folder: the job's refusal marker goes there (tempfile reads
    # TMPDIR), apart from other jobs' on this machine
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rc, err, seconds, leftovers = run_cli(
        ["bash", os.path.join(ROOT, "launchers", "torchrun_single_node.sh"), "backend=ddp", "train.steps=10",
         "deepspeed.hdet.replcas=2", f"run_dir={tmp_path / 'run'}", "wandb.enabled=false"],
        {"GPUS": "2", "MAX_RESTARTS": "3", "TMPDIR": str(tmp)})
    assert rc == 2, (rc, err[-3000:])
    assert err.count("deepspeed.hdet.replcas: unknown key") == 1, err[-3000:]
    for noise in ("Traceback", "restart", "closing signal", "exitcode", "ChildFailedError"):
        assert noise not in err, (noise, err[-3000:])
    assert seconds < EXIT_S and not leftovers, (seconds, leftovers)
    assert not (tmp_path / "run").exists()
    markers = tmp / f"hdet-train-refusals-{os.getuid()}"
    assert not markers.exists() or not list(markers.iterdir()), list(markers.iterdir())


@pytest.mark.parametrize("code,max_restarts,calls", [(3, "2", 1), (2, "2", 1), (1, "02", 3)])
def test_deepspeed_hostfile_script_does_not_retry_what_a_restart_cannot_fix(tmp_path, code, max_restarts, calls):
    """``launchers/deepspeed_hostfile.sh`` does not rerun hdet-train's exit 3 (a stale
    DeepSpeed op build lock, which stays until removed) with train.resume=true: 3 and 2 (bad
    input) end the script with that code after one launch; a crash (1) is still rerun
    MAX_RESTARTS times (02: read as 2). The deepspeed launcher is a stand-in exiting
    ``code``."""
    env = hostfile_standins(tmp_path)
    (tmp_path / "bin" / "deepspeed").write_text(f'#!/bin/sh\necho "$*" >> "$(dirname "$0")/calls"\nexit {code}\n')
    rc, err, seconds, leftovers = run_cli(["bash", os.path.join(ROOT, "launchers", "deepspeed_hostfile.sh"),
                                           "train.steps=2"], {**env, "MAX_RESTARTS": max_restarts})
    launched = (tmp_path / "bin" / "calls").read_text().splitlines()
    assert rc == code and len(launched) == calls, (rc, launched, err)
    assert err.count("restart ") == calls - 1 and ": line " not in err, err
    assert seconds < EXIT_S and not leftovers
