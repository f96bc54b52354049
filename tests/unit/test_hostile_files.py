"""Hostile YAML / JSON files given to the CLI tools end in one clean error (exit 2, the
file named), within seconds: a YAML anchor used inside its own value (which would spin
for ever), and lists nested 100000 deep (else a RecursionError traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

DEEP = 100_000
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_ARGS = ["backend=ddp", "nproc=2", "model.num_layers=1", "train.steps=4", "wandb.enabled=false"]


def _in_subprocess(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with a timeout, so a hang fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), ROOT) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("text,needle", [
    ("a: &a [*a]\n", "recursive alias: the anchor &a (line 1)"),
    ("run_dir: x\ntrain: &t {steps: 4, more: *t}\n", "recursive alias: the anchor &t (line 2)"),
    ("? &k [*k]\n: 1\n", "recursive alias"),
])
def test_a_recursive_yaml_alias_is_one_error_not_a_hang(tmp_path, text, needle):
    path = tmp_path / "y5.yaml"
    path.write_text(text)
    argv = [str(path), *TRAIN_ARGS, f"run_dir={tmp_path / 'run'}"]
    code = f"import sys\nfrom hdet_scale.train.cli import main\nsys.exit(main({argv!r}))"
    start = time.monotonic()
    done = _in_subprocess(code)  # ends (a hang would be TimeoutExpired)
    assert time.monotonic() - start < 60
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert str(path) in err and needle in err, err
    assert not (tmp_path / "run").exists()  # no rank started


def _cli(main, argv, capsys) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err, time.monotonic() - start


def _deep_json(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"hdet":' + "[" * DEEP + "]" * DEEP + "}")
    return path


def test_a_deeply_nested_deepspeed_json_is_one_error_in_hdet_train(tmp_path, capsys):
    from hdet_scale.train.cli import main

    path = _deep_json(tmp_path)
    rc, err, took = _cli(main, [f"deepspeed_config={path}", *TRAIN_ARGS, f"run_dir={tmp_path / 'run'}"], capsys)
    assert rc == 2 and took < 30
    assert "Traceback" not in err and "RecursionError" not in err
    assert f"deepspeed_config: file {str(path)!r} nests lists / mappings more than" in err, err


def test_a_deeply_nested_deepspeed_json_is_one_error_in_hdet_dryrun(tmp_path, capsys):
    from hdet_scale.dryrun import main

    path = _deep_json(tmp_path)
    rc, err, took = _cli(main, [str(path), "--world-size", "2"], capsys)
    assert rc == 2 and took < 30
    assert f"cannot read the DeepSpeed JSON {str(path)!r}: nests lists / mappings more than" in err, err


def test_a_deeply_nested_hf_config_is_one_error_in_hdet_dryrun(tmp_path, capsys):
    from hdet_scale.dryrun import main

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(json.load(open(os.path.join(ROOT, "hdet_scale/train/configs/deepspeed.json")))))
    hf = tmp_path / "config.json"
    hf.write_text('{"model_type": "llama", "x": ' + "[" * DEEP + "]" * DEEP + "}")
    rc, err, _ = _cli(main, [str(ds), "--world-size", "2", "--total-steps", "100", "--hf-config", str(hf)], capsys)
    assert rc == 2 and "RecursionError" not in err
    assert f"--hf-config: cannot read a Hugging Face config from {str(hf)!r}: nests" in err, err


@pytest.mark.parametrize("text", ["a: " + "[" * DEEP + "]" * DEEP + "\n",
                                  "deepspeed:\n  zero_optimization:\n    x: " + "{a: " * 80 + "1" + "}" * 80 + "\n"])
def test_a_deeply_nested_yaml_is_one_error_in_hdet_train(tmp_path, capsys, text):
    """The second nests 83 levels: PyYAML reads it, OmegaConf's merge raised RecursionError."""
    from hdet_scale.train.cli import main

    path = tmp_path / "deep.yaml"
    path.write_text(text)
    rc, err, took = _cli(main, [str(path), *TRAIN_ARGS, f"run_dir={tmp_path / 'run'}"], capsys)
    assert rc == 2 and took < 30 and "RecursionError" not in err
    assert f"config file {str(path)!r} nests lists / mappings more than" in err, err


def test_anchors_that_are_not_recursive_still_work(tmp_path):
    from hdet_scale.train.config import load_run_config

    path = tmp_path / "dry.yaml"
    path.write_text("model: &m\n  num_layers: 1\ntrain:\n  steps: &s 4\n  eval_batches: *s\n")
    run = load_run_config(str(path), [f"run_dir={tmp_path / 'run'}"])
    assert run["model"]["num_layers"] == 1 and run["train"]["steps"] == run["train"]["eval_batches"] == 4


def _deep_record(tmp_path, name: str) -> str:
    path = tmp_path / name
    path.write_text('{"runs": ' + "[" * DEEP + "]" * DEEP + "}")
    return str(path)


def test_deeply_nested_checkpoint_records_are_named_as_damaged(tmp_path):
    from hdet_scale.backends.checkpoints import read_layout
    from hdet_scale.errors import HDETStateError
    from hdet_scale.train import resume_config

    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    layout = _deep_record(ckpt, "hdet_layout.json")
    with pytest.raises(HDETStateError, match="hdet_layout.json is damaged"):
        read_layout(str(ckpt))
    record = _deep_record(ckpt, "hdet_run_config.json")
    with pytest.raises(HDETStateError, match=f"{record} is damaged"):
        resume_config._read(record)
    assert layout


def test_deeply_nested_metrics_and_plot_record_in_hdet_plot(tmp_path, capsys):
    from hdet_scale.plot import main
    from hdet_scale.plot_out import read_record

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n' + "[" * DEEP + "]" * DEEP + "\n"
                                            + '{"step": 2, "loss": 0.5}\n')
    rc, err, _ = _cli(main, [str(tmp_path)], capsys)
    assert rc == 2 and "RecursionError" not in err, err
    assert f"{tmp_path / 'metrics.jsonl'}:2: not a JSON record" in err, err
    plots = tmp_path / "plots"
    plots.mkdir()
    _deep_record(plots, ".hdet_plots.json")
    assert read_record(str(plots))["metrics"] is None  # unreadable, not a traceback
