"""``hdet.logging.jsonl`` appended to by a second run (a library script run twice with
the same path would mix two runs in one file without a word, and hdet-plot then plot the
first alone). The logger warns when the file's records already reach the new run's first
step, and removes nothing."""

from __future__ import annotations

import json
import warnings

from hdet_scale.logging import MetricsLogger, last_logged_step


def _run(path, steps, **kw) -> list[str]:
    logger = MetricsLogger(str(path), **kw)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for s in steps:
            logger.log({"train/loss": 1.0 / s}, step=s)
    logger.close()
    return [str(w.message) for w in seen if "hdet.logging.jsonl" in str(w.message)]


def test_a_second_run_into_the_same_file_warns_and_keeps_the_first(tmp_path):
    path = tmp_path / "m.jsonl"
    assert _run(path, [1, 2, 3]) == []  # a new file: nothing to say
    said = _run(path, [1, 2])
    assert len(said) == 1 and str(path) in said[0] and "up to step 3" in said[0] and "from step 1" in said[0], said
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 2, 3, 1, 2]  # the first run's records are all still there


def test_a_resume_that_goes_on_after_the_last_record_is_silent(tmp_path):
    path = tmp_path / "m.jsonl"
    _run(path, [1, 2, 3])
    with open(path, "a") as f:
        f.write('{"step": 4, "train/lo')  # a torn last line (a crash mid-write) is skipped
    assert last_logged_step(str(path)) == 3
    assert _run(path, [4, 5]) == []
    # a dead run that logged past its checkpoint (step 3 here, resumed at 2): overlapping steps
    assert len(_run(path, [2])) == 1


def test_a_logger_that_starts_the_file_anew_does_not_warn(tmp_path):
    """hdet-train's fresh run (``append=False``: its run_dir check refused an earlier
    run's metrics unless train.overwrite=true)."""
    path = tmp_path / "m.jsonl"
    _run(path, [1, 2, 3])
    assert _run(path, [1], append=False) == []
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


def test_a_jsonl_path_rank_0_could_not_open_is_refused_with_the_config(tmp_path):
    """hdet.logging.jsonl naming a folder would train until rank 0's first record
    (IsADirectoryError) while the other ranks die of a lost peer: resolve_config, which
    every rank runs before the first collective, names the key; a good path passes and
    nothing is created by the check."""
    import pytest

    from hdet_scale.backends.common import resolve_config
    from hdet_scale.errors import HDETConfigError

    def block(jsonl):
        return {"replicas": 1, "axes": {"lr": {"spread_ratio": 0.0}}, "auto": {"enabled": False},
                "schedule": {"total_steps": 10},
                "logging": {"jsonl": str(jsonl)}}

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for bad, says in ((tmp_path, "is a folder"), (a_file / "m.jsonl", "is not a folder"),
                      ("/dev/null", "not a regular file"), ("/proc/m.jsonl", "kernel filesystem")):
        with pytest.raises(HDETConfigError, match="hdet.logging.jsonl") as e:
            resolve_config(block(bad), world=1)
        assert says in str(e.value) and str(bad) in str(e.value), e.value
    good = tmp_path / "new" / "deeper" / "m.jsonl"
    assert resolve_config(block(good), world=1).logging.jsonl == str(good)
    assert not (tmp_path / "new").exists()  # checked, not created


def test_a_jsonl_path_under_the_home_folder_is_expanded(monkeypatch, tmp_path):
    """hdet.logging.jsonl "~/m.jsonl" in a library config does not write into a folder
    literally named "~" in the working directory (hdet-train expands "~" in its own
    paths): the block's paths are expanded as a shell would: jsonl and wandb.dir."""
    from hdet_scale.config import HDETConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = HDETConfig.from_dict({"replicas": 1, "schedule": {"total_steps": 10},
                                "logging": {"jsonl": "~/runs/m.jsonl", "wandb": {"dir": "~/wb"}}})
    assert cfg.logging.jsonl == str(tmp_path / "runs" / "m.jsonl")
    assert cfg.logging.wandb.dir == str(tmp_path / "wb")
