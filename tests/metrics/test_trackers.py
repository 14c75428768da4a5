"""The W&B and MLflow trackers behind ``MetricsLogger``, with the real packages and no network:
W&B offline, MLflow on a SQLite store, both read back with their own readers (``readback``).
A run stopped after step 4, resumed from its checkpoint at step 2, is ONE tracker run whose
steps only go up and whose rows equal ``metrics.jsonl``; a failing tracker changes nothing."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.checkpoint.state import trim_metrics
from megarl.config import ConfigError, RunConfig, load_config, to_dict, validate
from megarl.metrics import MetricsLogger
from megarl.metrics.trackers import RunIds, TrackerThread, resolve
from tests.metrics.readback import WANDB_ENV, jsonl_by_step, mlflow_history, same, wandb_files, wandb_history

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch):
    for k, v in WANDB_ENV.items():
        monkeypatch.setenv(k, v)
    for k in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_DIR",
              "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(k, raising=False)
    yield
    import wandb

    wandb.teardown()  # W&B's service process ends with the test
    assert not [p.name() for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]


def _cfg(run_dir: Path, steps: int) -> RunConfig:
    cfg = load_config(None, [f"train.run_dir={run_dir}", f"train.steps={steps}", "train.trackers=jsonl,wandb,mlflow",
                             "train.tracking.project=proj", "train.tracking.group=sweep1",
                             "train.tracking.tags=grpo,cpu", "train.tracking.close_timeout_s=120"])
    validate(cfg, 1)
    return cfg


def _step_metrics(step: int) -> dict[str, float]:
    """What step ``step`` logs: the same in a replay of it (exact resume), as in the loop."""
    return {"rollout/reward_mean": 0.1 * step, "train/loss": 1.0 / step, "train/kl": float("nan") if step == 3 else 0.0,
            "progress/samples": 32.0 * step, "timing/step/total": 2.0 + step}


def _attempt(cfg: RunConfig, steps: range, resumed: bool, end: bool) -> dict[str, float]:
    logger = MetricsLogger.open(cfg.train, to_dict(cfg), enabled=True, resumed=resumed)
    if not resumed:
        logger.log(0, {"val/reward": 0.05})
    for s in steps:
        logger.log(s, _step_metrics(s))
        if s % 2 == 0:
            logger.log(s, {"timing/checkpoint_blocked_s": 0.25})  # a second record of the same step
    summary = {"steps": float(steps[-1]), "rl_wall_s": 9.5}
    if end:
        logger.log(steps[-1], {"val/reward": 0.75})
        summary["val/reward_end"] = 0.75
    else:
        summary["preempted_at_step"] = float(steps[-1])
    logger.summary(summary)
    logger.close(ok=True)
    return summary


def test_resumed_run_is_one_tracker_run_equal_to_the_jsonl(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _attempt(_cfg(run, 4), range(1, 5), resumed=False, end=False)  # preempted after step 4...
    trim_metrics(run / "metrics.jsonl", 2)  # ...its newest checkpoint is step 2's: steps 3, 4 replay
    cfg = _cfg(run, 6)  # requeued with a larger budget
    summary = _attempt(cfg, range(3, 7), resumed=True, end=True)

    jsonl = jsonl_by_step(run)
    assert sorted(jsonl) == list(range(7))
    assert json.loads((run / "config.json").read_text()) == to_dict(cfg)
    assert json.loads((run / "summary.json").read_text()) == summary
    ids = json.loads((run / "trackers.json").read_text())
    assert ids["wandb"]["step"] == ids["mlflow"]["step"] == 6

    # W&B: two offline parts of ONE run (the same id), steps only going up, rows = metrics.jsonl
    files = wandb_files(run)
    assert len(files) == 2 and {f.run_id for f in files} == {ids["wandb"]["run_id"]}
    assert [f.exit_code for f in files] == [0, 0]
    first = files[0].run
    assert (first["project"], first["display_name"], first["run_group"], first["tags"]) == ("proj", "run", "sweep1",
                                                                                          ["grpo", "cpu"])
    rows = wandb_history(files)
    assert sorted(rows) == list(range(7))
    for step, row in jsonl.items():
        assert row.keys() == rows[step].keys(), step
        assert all(same(v, rows[step][k]) for k, v in row.items()), (step, row, rows[step])
    assert files[-1].config == to_dict(cfg)  # the resumed part logged the resumed config (train.steps=6)
    assert files[0].config["train"]["steps"] == 4
    assert all(files[-1].summary[k] == v for k, v in summary.items())
    axes = {m.get("name") or m.get("glob_name"): m.get("step_metric") for f in files for m in f.metrics}
    assert axes == {"step": None, "progress/samples": "step", "*": "step"}  # two x-axes, steps by default

    # MLflow: one run in the experiment, continued; every (metric, step) once, equal to metrics.jsonl
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("proj")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    r = runs[0]
    assert r.info.status == "FINISHED" and r.info.run_name == "run"
    assert r.data.tags["group"] == "sweep1" and "grpo" in r.data.tags and "cpu" in r.data.tags
    hist = mlflow_history(client, r.info.run_id)
    assert sorted(hist) == list(range(7))
    for step, row in jsonl.items():
        assert row.keys() == hist[step].keys(), step
        assert all(same(v, hist[step][k]) for k, v in row.items()), (step, row, hist[step])
    params = r.data.params
    assert params["train.steps"] == "4" and r.data.tags["resumed.train.steps"] == "6"  # params are immutable
    assert params["optim.lr"] == str(cfg.optim.lr) and params["train.trackers"] == str(cfg.train.trackers)
    assert {k: r.data.metrics[f"summary/{k}"] for k in summary} == summary


class Raising:
    """A tracker whose every call raises (``start_ok``: only after a good start)."""

    name = "raising"

    def __init__(self, start_ok: bool = False, start_s: float = 0.0) -> None:
        self.start_ok, self.start_s, self.calls = start_ok, start_s, 0

    def start(self, run_id):
        time.sleep(self.start_s)
        if not self.start_ok:
            raise ConnectionError("tracker unreachable\nsecond line")
        return "r1"

    def log(self, step, metrics, wall_time):
        self.calls += 1
        raise RuntimeError("refused")

    summary = artifact = finish = log


@pytest.mark.parametrize("backend", [Raising(), Raising(start_ok=True)], ids=["start", "log"])
def test_a_failing_tracker_leaves_the_run_and_its_jsonl_unchanged(tmp_path: Path, backend: Raising,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    def run(folder: Path, trackers: list[TrackerThread]) -> list[dict]:
        logger = MetricsLogger(folder, enabled=True, tensorboard=False, trackers=trackers, close_timeout_s=5)
        for s in range(1, 6):
            logger.log(s, _step_metrics(s))
        logger.summary({"steps": 5.0})
        logger.close(ok=True)
        return [{k: v for k, v in json.loads(line).items() if k != "time"}
                for line in (folder / "metrics.jsonl").read_text().splitlines()]

    with caplog.at_level(logging.WARNING, logger="megarl"):
        failing = run(tmp_path / "a", [TrackerThread(backend, RunIds(tmp_path / "a.json", fresh=True))])
    plain = run(tmp_path / "b", [])
    assert json.dumps(failing) == json.dumps(plain) and len(plain) == 5  # (NaN-safe comparison)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("raising tracker off after an error in "), warnings
    assert backend.calls <= 2  # a log that raised (+ the finish after it); nothing later reached it


def test_a_slow_or_missing_tracker_does_not_slow_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    slow = TrackerThread(Raising(start_ok=True, start_s=3.0), RunIds(tmp_path / "ids.json", fresh=True))
    logger = MetricsLogger(tmp_path / "run", enabled=True, tensorboard=False, trackers=[slow], close_timeout_s=0.2)
    t0 = time.perf_counter()
    for s in range(1, 101):
        logger.log(s, _step_metrics(s))
    logger.close(ok=True)
    assert time.perf_counter() - t0 < 1.5  # the tracker's 3 s start is not waited for
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 100

    cfg = load_config(None, [f"train.run_dir={tmp_path / 'r2'}", "train.trackers=jsonl,wandb"])
    with monkeypatch.context() as mp, caplog.at_level(logging.WARNING, logger="megarl"):
        mp.setitem(sys.modules, "wandb", None)  # W&B not installed
        logger = MetricsLogger.open(cfg.train, to_dict(cfg), enabled=True, resumed=False)
        logger.log(1, {"x": 1.0})
        logger.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == ("raising tracker: still delivering after train.tracking.close_timeout_s=0.2; "
                           "leaving it (metrics.jsonl has every record)")
    assert len(warnings) == 2 and warnings[1].startswith("wandb tracker off after an error in start: "
                                                         "ModuleNotFoundError: ")
    assert warnings[1].endswith("pip install 'megarl[trackers]' (metrics.jsonl keeps every record)")
    assert (tmp_path / "r2" / "metrics.jsonl").read_text().count("\n") == 1


def test_tracking_settings_fall_back_to_the_trackers_environment(tmp_path: Path) -> None:
    t = RunConfig().train.tracking
    env = {"WANDB_PROJECT": "p", "WANDB_ENTITY": "team", "WANDB_NAME": "n", "WANDB_RUN_GROUP": "g",
           "WANDB_TAGS": "a, b", "MLFLOW_TRACKING_URI": "http://mlflow:5000", "MLFLOW_EXPERIMENT_NAME": "e"}
    r = resolve(t, tmp_path / "run1", env)
    assert (r.project, r.entity, r.name, r.group, r.tags, r.mlflow_uri, r.experiment) == (
        "p", "team", "n", "g", ("a", "b"), "http://mlflow:5000", "e")
    r = resolve(t, tmp_path / "run1", {})
    assert (r.project, r.experiment, r.name, r.default_uri) == ("megarl", "megarl", "run1", True)
    assert r.mlflow_uri == f"sqlite:///{tmp_path / 'run1' / 'mlflow.db'}"
    t.project, t.experiment = "cfg", ""
    assert resolve(t, tmp_path, {"WANDB_PROJECT": "p"}).experiment == "cfg"  # config beats the environment


def test_tracker_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"train.trackers\[1\]='neptune' must be one of"):
        load_config(None, ["train.trackers=jsonl,neptune"])
    with pytest.raises(ConfigError, match="train.trackers=.* names 'wandb' twice"):
        validate(load_config(None, ["train.trackers=wandb,wandb"]), 1)
    with pytest.raises(ConfigError, match="train.tracking.close_timeout_s=-1.0 must be >= 0"):
        validate(load_config(None, ["train.tracking.close_timeout_s=-1"]), 1)
    assert load_config(None, ["train.trackers=wandb"]).train.trackers == ["wandb"]


def test_artifacts_reach_both_trackers(tmp_path: Path) -> None:
    """train.tracking.artifacts: the loop hands hf_final/ (and the report folder) to every tracker."""
    run = tmp_path / "run"
    (run / "hf_final").mkdir(parents=True)
    (run / "hf_final" / "config.json").write_text("{}")
    cfg = load_config(None, [f"train.run_dir={run}", "train.trackers=jsonl,wandb,mlflow"])
    logger = MetricsLogger.open(cfg.train, to_dict(cfg), enabled=True, resumed=False)
    logger.log(1, {"x": 1.0})
    logger.artifact("hf_final", run / "hf_final")
    logger.close()
    (f,) = wandb_files(run)
    assert [(a["name"], a["type"], [e["path"] for e in a["manifest"]["contents"]]) for a in f.artifacts] == [
        (f"{f.run_id}-hf_final", "model", ["config.json"])]
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    assert [a.path for a in client.list_artifacts(run_id, "hf_final")] == ["hf_final/config.json"]
