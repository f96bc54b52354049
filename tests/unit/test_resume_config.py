"""What a resumed run may change (``hdet_scale/train/resume_config.py``): the settings
record a save leaves, the refusal of changes that cannot work, and the warning's claim of
which value the resumed run uses, held to a loaded ``HDETScheduler``.

File operations and one scheduler in this process; the real saves and a real DeepSpeed
resume with changed settings: tests/distributed/test_resume.py. The launcher's messages:
tests/distributed/test_bad_inputs.py (``resume_*_changed`` rows).
"""

from __future__ import annotations

import os

import json
import math

import pytest

from hdet_scale.autolr import build_schedule
from hdet_scale.backends.checkpoint_io import commit, prune, retire_tag
from hdet_scale.config import HDETConfig
from hdet_scale.ensemble import HDETScheduler
from hdet_scale.errors import HDETStateError
from hdet_scale.train import resume_config, rundir
from hdet_scale.train.config import load_run_config


# AdamW under OneCycle (the packaged job before schedule-free AdamW): what these tests change
ADAMW = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                     "deepspeed_cpu_2x2_adamw.json")


def run_config(run_dir, *overrides) -> dict:
    wandb = [] if any(o.startswith("wandb.enabled=") for o in overrides) else ["wandb.enabled=false"]
    return load_run_config(None, [f"deepspeed_config={ADAMW}", f"run_dir={run_dir}", *wandb, *overrides])


def save(ckpt, step: int, run: dict | None) -> None:
    """What a trainer save leaves, in its order: rank 0's record of ``run`` (when given),
    the tag's folders, then the commit of the layout and ``latest``."""
    tag = f"global_step{step}"
    if run is not None:
        resume_config.save_record(str(ckpt), tag, run)
    retire_tag(str(ckpt), 2, tag)
    for r in range(2):
        (ckpt / f"replica_{r}" / tag).mkdir(parents=True)
    commit(str(ckpt), {"world_size": 4, "replicas": 2, "shard_size": 2, "step": step, "total_steps": 300,
                       "backend": "deepspeed"}, tag)


def test_a_changed_model_shape_is_refused_naming_every_key(tmp_path):
    """One HDETStateError listing each shape key with checkpoint -> new value and the
    checkpoint's tag and step; a hyperparameter changed alongside is not an error."""
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 10, run_config(tmp_path))
    changed = run_config(tmp_path, "model.hidden_size=64", "model.num_layers=2", "deepspeed.optimizer.params.lr=0.001",
                         "deepspeed.optimizer.type=Adam", "deepspeed.hdet.sync_interval=5")
    with pytest.raises(HDETStateError) as err:
        resume_config.check(changed, str(ckpt))
    msg = str(err.value)
    for line in ("model.hidden_size: 128 -> 64", "model.num_layers: 4 -> 2", 'deepspeed.optimizer.type: "AdamW" -> "Adam"',
                 "deepspeed.hdet.sync_interval: 25 -> 5", "global_step10, step 10", "another run_dir"):
        assert line in msg, (line, msg)
    assert "optimizer.params.lr" not in msg
    # an axis added is one line, not one per field
    with pytest.raises(HDETStateError) as err:
        resume_config.check(run_config(tmp_path, "deepspeed.hdet.axes.weight_decay.spread_ratio=0.1"), str(ckpt))
    assert str(err.value).count("deepspeed.hdet.axes.weight_decay") == 1, str(err.value)


def test_a_changed_precision_is_refused_and_its_default_is_no_change(tmp_path):
    """bf16 switched on in the DeepSpeed JSON of a resumed run is refused before any rank
    starts, naming the key: accepted as a change, every rank would fail to find DeepSpeed's
    ``bf16_zero_pp_rank_*_optim_states.pt`` (a FileNotFoundError naming no setting).
    ``bf16.enabled=false`` against a checkpoint whose run left it unset (DeepSpeed's
    default) is no change at all."""
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 10, run_config(tmp_path))
    with pytest.raises(HDETStateError) as err:
        resume_config.check(run_config(tmp_path, "deepspeed.bf16.enabled=true"), str(ckpt))
    assert "deepspeed.bf16.enabled: (unset) -> true: the precision" in str(err.value), str(err.value)
    assert resume_config.check(run_config(tmp_path, "deepspeed.bf16.enabled=false"), str(ckpt)) == []
    with pytest.raises(HDETStateError, match="deepspeed.zero_optimization.stage: 3 -> 2"):
        resume_config.check(run_config(tmp_path, "deepspeed.zero_optimization.stage=2"), str(ckpt))


SHORT = ("deepspeed.hdet.sync_interval=5", "deepspeed.hdet.auto.warmup_steps=5")  # a 20-step run's HDET


def test_a_longer_run_is_refused_with_advice_that_works(tmp_path):
    """Lengthening a finished 20-step run is advised as a schedule set to the whole
    length from the start, which a resume may then run up to (followed here), not
    "train.steps sets it unless deepspeed.hdet.schedule.total_steps is given", whose
    total_steps=20 would then fail ("shorter than train.steps=30")."""
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 20, run_config(tmp_path, "train.steps=20", *SHORT))
    with pytest.raises(HDETStateError) as err:
        resume_config.check(run_config(tmp_path, "train.steps=30", *SHORT), str(ckpt))
    msg = str(err.value)
    assert "deepspeed.hdet.schedule.total_steps: 20 -> 30: the schedule's length" in msg, msg
    assert "resume with the same train.steps, or to stop earlier add deepspeed.hdet.schedule.total_steps=" in msg, msg
    assert "new run_dir with schedule.total_steps set to the whole length" in msg, msg
    other = tmp_path / "longer"
    save(other / "checkpoint", 20, run_config(other, "train.steps=20", "deepspeed.hdet.schedule.total_steps=30", *SHORT))
    resume_config.check(run_config(other, "train.steps=30", "deepspeed.hdet.schedule.total_steps=30", *SHORT),
                        str(other / "checkpoint"))  # no HDETStateError: the advice works


def test_the_warning_lists_each_change_and_the_value_used(tmp_path):
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 10, run_config(tmp_path))
    assert resume_config.notice(run_config(tmp_path), str(ckpt)) is None
    # where and how the run is kept: not compared
    same = run_config(tmp_path / "moved", "train.progress=false", "train.checkpoint_every=5", "wandb.mode=offline",
                      "deepspeed.hdet.logging.every=5", "nproc=4")
    assert resume_config.notice(same, str(ckpt)) is None
    changed = run_config(tmp_path, "deepspeed.optimizer.params.lr=0.001", "deepspeed.optimizer.params.betas=[0.8,0.99]",
                         "deepspeed.hdet.axes.lr.spread_ratio=0.2", "deepspeed.hdet.seed=3", "data.seq_len=64",
                         "deepspeed.hdet.warm_init.nu=0.5", "seed=4")
    note = resume_config.notice(changed, str(ckpt))
    lines = {line.split(":")[0].strip(): line for line in note.splitlines()[1:]}
    assert note.startswith(f"train.resume: continuing {ckpt} (global_step10, step 10)")
    expect = {
        "deepspeed.optimizer.params.lr": "0.003 -> 0.001: the resumed run uses 0.001: the schedule's peak LR",
        "deepspeed.optimizer.params.betas": "[0.9, 0.95] -> [0.8, 0.99]: the resumed run keeps the checkpoint's value "
                                            "[0.9, 0.95]",
        "deepspeed.hdet.axes.lr.spread_ratio": "0.111 -> 0.2: the resumed run uses 0.2",
        "deepspeed.hdet.seed": "0 -> 3: the resumed run keeps the checkpoint's value 0",
        "data.seq_len": "128 -> 64: the resumed run uses 64",
        "deepspeed.hdet.warm_init.nu": "0.01 -> 0.5: no effect on a resumed run",
        "seed": "0 -> 4: the resumed run uses 4",
    }
    assert set(lines) == set(expect), note
    for key, words in expect.items():
        assert words in lines[key], (key, lines[key])
    assert "auto-LR multiplier" not in lines["deepspeed.optimizer.params.lr"]  # step 10 < first meta-update (25)


def test_each_tag_is_compared_with_its_own_record(tmp_path):
    """A record per tag, for the tags the index lists: a save cut short after its record
    (latest still on the previous tag) compares with the previous tag's settings, and
    pruned tags' records go with the next save. A checkpoint without a record file is
    refused, naming it (unchecked, a changed model shape would fail in the ranks' load);
    one whose record lists no entry for the tag (``{"runs": {}}``, the way out the
    message names) resumes unchecked; a damaged record file is named."""
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 5, None)  # no record file
    with pytest.raises(HDETStateError, match=f"{resume_config.RECORD_FILE} is missing.*write {{\"runs\": {{}}}}"):
        resume_config.check(run_config(tmp_path, "model.hidden_size=64"), str(ckpt))
    (ckpt / resume_config.RECORD_FILE).write_text('{"runs": {}}')
    assert resume_config.check(run_config(tmp_path, "model.hidden_size=64"), str(ckpt)) == []
    save(ckpt, 10, run_config(tmp_path))
    lower = run_config(tmp_path, "deepspeed.optimizer.params.lr=0.001")
    resume_config.save_record(str(ckpt), "global_step15", lower)  # ...and the save of step 15 died here
    assert len(resume_config.check(lower, str(ckpt))) == 1  # latest: global_step10, saved with lr 0.003
    save(ckpt, 15, lower)
    assert resume_config.check(lower, str(ckpt)) == []
    prune(str(ckpt), 2, keep=1)
    save(ckpt, 20, lower)
    assert sorted(json.loads((ckpt / resume_config.RECORD_FILE).read_text())["runs"]) == ["global_step15",
                                                                                            "global_step20"]
    (ckpt / resume_config.RECORD_FILE).write_text('{"runs": [1')
    with pytest.raises(HDETStateError, match=f"{resume_config.RECORD_FILE} is damaged.*write {{\"runs\": {{}}}} into it"):
        resume_config.check(lower, str(ckpt))


def test_resume_notice_only_for_a_resume(tmp_path, monkeypatch):
    for var in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    save(tmp_path / "checkpoint", 10, run_config(tmp_path))
    changed = ["deepspeed.optimizer.params.lr=0.001", "train.overwrite=true"]
    assert rundir.resume_notice(run_config(tmp_path, *changed)) is None  # a replacing run: nothing to compare
    assert "0.003 -> 0.001" in rundir.resume_notice(run_config(tmp_path, *changed, "train.resume=true"))


def _scheduler(run: dict, lr: float) -> HDETScheduler:
    cfg = HDETConfig.from_dict(run["deepspeed"]["hdet"])
    return HDETScheduler(cfg, {0: [{"lr": lr, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": []}]})


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("controller", ["log", "paper"])
def test_the_lr_the_warning_names_is_the_lr_a_loaded_scheduler_sets(tmp_path, controller):
    """A checkpoint at step 30 (after the first auto-LR meta-update, at 25) with a learned
    multiplier ("log") or a meta-updated base ("paper"), resumed with the peak LR changed
    from 0.003 to 0.001 through the same load every backend runs last (load_state_dict).
    "log": the new peak applies, times the restored multiplier; "paper": the saved base
    continues, whatever the new peak. Exact: the same float operations."""
    old_run = run_config(tmp_path, f"deepspeed.hdet.auto.controller={controller}")
    new_run = run_config(tmp_path, f"deepspeed.hdet.auto.controller={controller}", "deepspeed.optimizer.params.lr=0.001")
    old = _scheduler(old_run, 0.003)
    old.step_count = 30
    key = ("lr", 0)
    if controller == "log":
        old.controller.log_m[key] = 0.4
    else:
        old.controller.base[key] = 0.0042
    old.controller.updates = 1
    new = _scheduler(new_run, 0.001)
    new.load_state_dict(old.state_dict())
    if controller == "log":
        want = build_schedule(new.config).value(30, 0.001) * math.exp(0.4)
        claim = "uses 0.001: the schedule's peak LR, times the auto-LR multiplier restored from the checkpoint"
    else:
        want = 0.0042
        claim = "keeps the checkpoint's base LR"
    assert new.base_value("lr", 0) == want
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 30, old_run)
    assert claim in resume_config.notice(new_run, str(ckpt))


def test_a_changed_model_axis_base_says_the_learned_shift_stays(tmp_path):
    """After auto-LR moved the dropout axis, a resume with a new model.dropout says that
    the shift learned up to the checkpoint is restored on top (the "log" controller:
    ``Controller.value`` = new base + saved shift), not only "the resumed run uses 0.2";
    "paper" keeps its saved meta-updated base and ignores the new one. Before the first
    meta-update nothing is learned: the plain line stays."""
    axis = ("deepspeed.hdet.axes={lr: {spread_ratio: 0.1}, dropout: {spread_ratio: 0.02, kind: additive, "
            "auto: true}}")
    common = ["deepspeed.hdet.sync_interval=5", "deepspeed.hdet.auto.warmup_steps=5", axis]
    for controller, step, expected in (
            ("log", 10, "the resumed run uses 0.2 as the dropout axis' base, moved by what auto-LR learned up to the "
                        "checkpoint (restored from it)"),
            ("paper", 10, "the resumed run keeps the dropout axis' meta-updated base saved in the checkpoint"),
            ("log", 3, "model.dropout: 0.1 -> 0.2: the resumed run uses 0.2\n")):
        ckpt = tmp_path / f"{controller}{step}" / "checkpoint"
        save(ckpt, step, run_config(ckpt.parent, "model.dropout=0.1", f"deepspeed.hdet.auto.controller={controller}",
                                    *common))
        changed = run_config(ckpt.parent, "model.dropout=0.2", f"deepspeed.hdet.auto.controller={controller}", *common)
        text = resume_config.notice(changed, str(ckpt)) + "\n"
        assert expected in text, text
        assert "axes.dropout.value" not in text, text  # filled from model.dropout: one line, that key's


def test_changed_betas_with_a_beta2_axis_says_the_new_beta2_is_used(tmp_path):
    """With ``beta2`` explored, a resume with new ``betas`` says the run uses the new
    beta2 (HDET writes beta2 into the parameter groups every step: the logged replica
    beta2 are the new 0.98 +- 1%), not that it "keeps the checkpoint's value"; only beta1
    is restored."""
    axes = "deepspeed.hdet.axes={lr: {spread_ratio: 0.1}, beta2: {spread_ratio: 0.01}}"
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 10, run_config(tmp_path, axes))
    for betas, expected in (
            ("[0.9,0.98]", "deepspeed.optimizer.params.betas: [0.9, 0.95] -> [0.9, 0.98]: the resumed run uses beta2 "
                           "0.98: HDET sets it every step (deepspeed.hdet.axes.beta2)\n"),
            ("[0.8,0.98]", "uses beta2 0.98: HDET sets it every step (deepspeed.hdet.axes.beta2); beta1 keeps the "
                           "checkpoint's")):
        text = resume_config.notice(run_config(tmp_path, axes, f"deepspeed.optimizer.params.betas={betas}"),
                                    str(ckpt)) + "\n"
        assert expected in text, text


def test_zero_stage_is_no_change_for_engines_that_do_not_read_it(tmp_path):
    """A ddp / fairscale resume with a new zero_optimization.stage (set to silence the
    note that these engines do not read it) is a change of no effect, not refused as
    "the ZeRO stage the saved partitions were written by"; the fsdp2 precision refusal
    names no DeepSpeed file names. DeepSpeed itself still refuses the stage change."""
    for backend in ("ddp", "fairscale"):
        ckpt = tmp_path / backend / "checkpoint"
        save(ckpt, 10, run_config(ckpt.parent, f"backend={backend}"))
        changed = run_config(ckpt.parent, f"backend={backend}", "deepspeed.zero_optimization.stage=0")
        assert resume_config.check(changed, str(ckpt))  # a change, not an error
        assert f"deepspeed.zero_optimization.stage: 3 -> 0: no effect: the {backend} backend does not read it" in \
            resume_config.notice(changed, str(ckpt))
    ckpt = tmp_path / "ds" / "checkpoint"
    save(ckpt, 10, run_config(ckpt.parent))
    with pytest.raises(HDETStateError, match="the ZeRO stage the saved partitions were written by"):
        resume_config.check(run_config(ckpt.parent, "deepspeed.zero_optimization.stage=2"), str(ckpt))
    ckpt = tmp_path / "fsdp2" / "checkpoint"
    save(ckpt, 10, run_config(ckpt.parent, "backend=fsdp2"))
    with pytest.raises(HDETStateError) as e:
        resume_config.check(run_config(ckpt.parent, "backend=fsdp2", "deepspeed.bf16.enabled=true"), str(ckpt))
    assert "the precision the saved weights" in str(e.value) and "DeepSpeed names" not in str(e.value)


def test_an_axis_auto_turned_off_says_the_learned_value_stays(tmp_path):
    """Resuming with ``lr.auto=false`` says that what auto-LR learned stays, not only
    "uses false": the LR then follows the schedule times the multiplier learned before
    (x1.2687, measured)."""
    common = ["deepspeed.hdet.sync_interval=5", "deepspeed.hdet.auto.warmup_steps=5"]
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 10, run_config(tmp_path, *common))
    text = resume_config.notice(run_config(tmp_path, *common, "deepspeed.hdet.axes.lr.auto=false"), str(ckpt))
    assert ("deepspeed.hdet.axes.lr.auto: null -> false: the resumed run uses false: what auto-LR learned for it up "
            "to the checkpoint (restored from it) stays, no longer moved") in text, text


def test_init_seed_and_eval_batches_changes_are_announced(tmp_path):
    """A changed ``model.init_seed`` or ``train.eval_batches`` on resume is compared and
    announced: the first has no effect (the checkpoint replaces the initial weights), the
    second changes what the validation loss measures from here on."""
    ckpt = tmp_path / "checkpoint"
    save(ckpt, 10, run_config(tmp_path))
    text = resume_config.notice(run_config(tmp_path, "model.init_seed=7", "train.eval_batches=3"), str(ckpt))
    assert ("model.init_seed: 0 -> 7: no effect on a resumed run: it seeds the initial weights, which the checkpoint "
            "replaces") in text, text
    assert "train.eval_batches: 16 -> 3: the resumed run uses 3: the validation loss from here on is measured on 3 " \
           "batches, the earlier records' on 16" in text, text
    assert resume_config.notice(run_config(tmp_path), str(ckpt)) is None


def test_changed_training_bytes_are_told_and_a_respelled_data_path_is_no_change(tmp_path, monkeypatch):
    """Files added to data.path (or lines appended) since the checkpoint are not trained
    on without a word, and the same folder given as ``data1/`` and as its absolute path
    is no change. The record holds the corpus' fingerprint (data.fingerprint, read from
    a real ``load_corpus``); a record without one (a checkpoint saved before it was
    recorded) tells nothing."""
    from hdet_scale.train.data import fingerprint, load_corpus

    folder = tmp_path / "data1"
    folder.mkdir()
    for i in range(4):
        (folder / f"f{i}.txt").write_text(f"text of file {i}\n" * 200)
    monkeypatch.chdir(tmp_path)

    def corpus(run):
        d = run["data"]
        return fingerprint(load_corpus(d["path"], d["val_fraction"], d["max_bytes"], run["seed"], run["run_dir"]))

    ckpt = tmp_path / "run" / "checkpoint"
    first = run_config(tmp_path / "run", "data.path=data1/")
    save(ckpt, 10, None)
    resume_config.save_record(str(ckpt), "global_step10", first, data=corpus(first))
    absolute = run_config(tmp_path / "run", f"data.path={folder}")
    assert resume_config.notice(absolute, str(ckpt), corpus(absolute)) is None  # same folder, same bytes
    with open(folder / "f1.txt", "a") as f:
        f.write("appended line\n")
    note = resume_config.notice(absolute, str(ckpt), corpus(absolute))
    assert note is not None and "data: the bytes data.path reads changed since the checkpoint" in note, note
    assert "data.path:" not in note  # the respelled path is still no change
    (folder / "f9.txt").write_text("a new file\n" * 300)
    assert " -> " in resume_config.notice(first, str(ckpt), corpus(first)).split("data: ")[1]
    # a changed seed draws another split: its own line says so, not a second one about the bytes
    reseeded = run_config(tmp_path / "run", "data.path=data1/", "seed=3")
    lines = resume_config.notice(reseeded, str(ckpt), corpus(reseeded)).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == ["seed"], lines
    # a record saved before the bytes were recorded: nothing to compare them with
    resume_config.save_record(str(ckpt), "global_step10", first)
    assert resume_config.notice(first, str(ckpt), corpus(first)) is None


def test_a_changed_wandb_project_is_told_when_the_checkpoint_recorded_a_wandb_run(tmp_path):
    """A resume with another wandb.project is told so (W&B would open a new run of that
    id in the new project, where the WANDB_RUN_ID note says it "continues the W&B run").
    Told when the checkpoint recorded a W&B run and W&B is on; the other wandb keys
    (name, mode, dir) are not compared."""
    ckpt = tmp_path / "checkpoint"
    first = run_config(tmp_path, "wandb.enabled=true", "wandb.project=first")
    save(ckpt, 10, None)
    resume_config.save_record(str(ckpt), "global_step10", first, wandb_run_id="abc123")
    moved = run_config(tmp_path, "wandb.enabled=true", "wandb.project=other", "wandb.name=x", "wandb.mode=offline")
    lines = resume_config.notice(moved, str(ckpt)).splitlines()[1:]
    assert len(lines) == 1 and lines[0].strip().startswith(
        "wandb.project: \"first\" -> \"other\": the resumed run opens its W&B run 'abc123' in the new project"), lines
    assert "records up to step 10 stay in the checkpoint's" in lines[0]
    assert resume_config.notice(run_config(tmp_path, "wandb.enabled=false", "wandb.project=other"), str(ckpt)) is None
    resume_config.save_record(str(ckpt), "global_step10", first)  # no W&B run recorded: nothing to continue
    assert resume_config.notice(moved, str(ckpt)) is None
