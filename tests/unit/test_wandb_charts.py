"""W&B per-replica line-series charts (``hdet_scale.wandb_charts``) and the x axis of our
own run, in a real offline W&B run: the tables W&B writes hold exactly the values of the
sync records, one line per replica."""

from __future__ import annotations

import json

import pytest

from hdet_scale.config import WandbConfig

SYNCS = [(5, {"hdet/sync": 1, "hdet/loss/replica_0": 2.0, "hdet/loss/replica_1": 2.5,
              "hdet/lr/replica_0/group_0": 0.1, "hdet/lr/replica_1/group_0": 0.3, "hdet/temperature": 0.2}),
         (10, {"hdet/sync": 2, "hdet/loss/replica_0": 1.5, "hdet/loss/replica_1": 1.0,
               "hdet/lr/replica_0/group_0": 0.15, "hdet/lr/replica_1/group_0": 0.25, "hdet/temperature": 0.2})]


def test_sync_records_become_one_chart_per_value_with_a_line_per_replica(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from hdet_scale.logging import MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(wandb=WandbConfig(enabled=True, mode="offline", dir=str(tmp_path)))
    # a step record (no hdet/sync) is not charted: the charts hold one point per sync
    logger.log({"hdet/loss": 3.0, "hdet/lr/replica_0/group_0": 9.0, "hdet/lr/replica_1/group_0": 9.0}, step=1)
    for step, record in SYNCS:
        logger.log(record, step=step)
    logger.close()
    tables = {p.name.split("_table_")[0]: p for p in tmp_path.rglob("*.table.json")}
    assert set(tables) == {"group_0", "loss"}, sorted(tables)  # charts/hdet/lr/group_0, charts/hdet/loss
    rows = json.loads(tables["group_0"].read_text())["data"]
    assert sorted(map(tuple, rows)) == [(5, "replica_0", 0.1), (5, "replica_1", 0.3),
                                        (10, "replica_0", 0.15), (10, "replica_1", 0.25)]
    rows = json.loads(tables["loss"].read_text())["data"]
    assert sorted(map(tuple, rows)) == [(5, "replica_0", 2.0), (5, "replica_1", 2.5),
                                        (10, "replica_0", 1.5), (10, "replica_1", 1.0)]
    assert "charts/hdet/lr/group_0" in str(tables["group_0"])


def test_no_sync_record_no_chart(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from hdet_scale.logging import MetricsLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(wandb=WandbConfig(enabled=True, mode="offline", dir=str(tmp_path)))
    logger.log({"hdet/loss": 3.0, "hdet/lr/replica_0/group_0": 0.1}, step=1)
    logger.close()
    assert not list(tmp_path.rglob("*.table.json"))
