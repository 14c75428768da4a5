"""The loop's stop rules and validation cadence (``megarl.metrics.progress.Progress``), on made-up
validation curves: the run loop calls exactly these after every step."""

import json

from megarl.config import TrainConfig
from megarl.metrics.progress import Progress


def _drive(t: TrainConfig, batches: list[int], vals: dict[int, float]) -> tuple[list[int], int | None, Progress]:
    """Steps of ``batches`` responses each; ``vals[step]`` is the validation a due step gets.
    Returns the steps that validated, the step the run stopped after (None: ran out), the state."""
    p, validated = Progress(), []
    for step, b in enumerate(batches, start=1):
        due = p.count(b, step, t)
        val = vals.get(step, 0.0) if due else None
        if due:
            validated.append(step)
        if p.stop(step, val, t) is not None:
            return validated, step, p
    return validated, None, p


def test_validation_every_n_samples_follows_a_changing_batch() -> None:
    t = TrainConfig(eval_every=3, eval_every_samples=100)
    validated, stopped, p = _drive(t, [64, 64, 128, 32, 32, 256, 16], {})
    # cumulative 64, 128 | 256 | 288, 320 | 576 | 592: multiples of 100 passed at steps 2, 3, 5, 6
    assert validated == [2, 3, 5, 6] and stopped is None and p.samples == 592
    validated, _, _ = _drive(TrainConfig(eval_every=3), [64] * 7, {})
    assert validated == [3, 6]


def test_target_stop_waits_for_the_validations_past_it() -> None:
    t = TrainConfig(eval_every=2, target_val_reward=0.5, evals_past_target=2)
    # reached at step 4; later validations fall below the target and still count
    vals = {2: 0.3, 4: 0.55, 6: 0.45, 8: 0.6, 10: 0.7}
    validated, stopped, p = _drive(t, [8] * 12, vals)
    assert stopped == 8 and p.reached_step == 4 and p.evals_since == 2 and validated == [2, 4, 6, 8]
    _, stopped, p = _drive(TrainConfig(eval_every=2, target_val_reward=0.5), [8] * 12, vals)
    assert stopped == 4 and p.evals_since == 0
    _, stopped, p = _drive(TrainConfig(eval_every=2, target_val_reward=0.9), [8] * 12, vals)
    assert stopped is None and p.reached_step == 0


def test_sample_budget_stops_and_state_round_trips() -> None:
    t = TrainConfig(eval_every=0, max_samples=100)
    _, stopped, p = _drive(t, [32, 32, 32, 32, 32], {})
    assert stopped == 4 and p.samples == 128
    q = Progress()
    q.load_state_dict(p.state_dict())
    assert q == p and q.done(t) is not None  # resumed from the stopping step's checkpoint: no more steps
    t = TrainConfig(eval_every=0, max_samples=200)  # (resumed with a larger budget)
    # a resumed run continues the count: one more step of 32 is past the budget at once
    assert q.done(t) is None and q.count(32, 5, t) is False and q.stop(5, None, t) is None  # 160
    assert q.count(32, 6, t) is False and q.stop(6, None, t) is None  # 192
    assert q.count(32, 7, t) is False and q.stop(7, None, t) == "224 responses trained (train.max_samples=200)"


def test_restore_fills_the_progress_part_and_accepts_checkpoints_without_it(monkeypatch, tmp_path) -> None:
    """``state.restore`` with the checkpoint reader isolated (this is about which parts load):
    a checkpoint written before Progress existed resumes with zero counts; any other missing
    part still fails, naming it."""
    import pytest

    from megarl.checkpoint import state

    saved = {"step": 7, "planner": {"x": 1}, "progress": {"samples": 448, "reached_step": 5, "evals_since": 1}}
    monkeypatch.setattr(state, "load_checkpoint", lambda path, models: dict(saved))

    class Part:
        def load_state_dict(self, s):
            self.s = s

        def state_dict(self):
            return {}

    planner, progress = Part(), Progress()
    assert state.restore(tmp_path, {}, {"planner": planner, "progress": progress}, optional=["progress"]) == 7
    assert planner.s == {"x": 1} and progress == Progress(448, 5, 1)
    del saved["progress"]
    fresh = Progress()
    assert state.restore(tmp_path, {}, {"planner": planner, "progress": fresh}, optional=["progress"]) == 7
    assert fresh == Progress()
    with pytest.raises(ValueError, match=r"has no state for \['progress'\]"):
        state.restore(tmp_path, {}, {"planner": planner, "progress": fresh})


def test_a_target_window_stops_on_the_mean_of_the_last_validations_not_one_lucky_one() -> None:
    vals = {1: 0.3, 2: 0.3, 3: 0.6, 4: 0.35, 5: 0.4, 6: 0.45, 7: 0.6, 8: 0.7, 9: 0.7}
    _, stopped, _ = _drive(TrainConfig(eval_every=1, target_val_reward=0.5), [8] * 10, vals)
    assert stopped == 3  # one lucky validation ends the run without a window
    t = TrainConfig(eval_every=1, target_val_reward=0.5, target_window=3)
    # means of the last three: 0.40 (step 3), 0.417, 0.45, 0.40, 0.483, 0.583 (step 8)
    _, stopped, p = _drive(t, [8] * 10, vals)
    assert stopped == 8 and p.reached_step == 8
    assert p.recent == [0.45, 0.6, 0.7] and abs(p.target_mean() - 1.75 / 3) < 1e-12
    # with validations past it, the window keeps sliding and the reached step stays
    t2 = TrainConfig(eval_every=1, target_val_reward=0.5, target_window=3, evals_past_target=1)
    _, stopped, p = _drive(t2, [8] * 10, vals)
    assert stopped == 9 and p.reached_step == 8 and p.recent == [0.6, 0.7, 0.7]


def test_the_target_window_resumes_exactly_and_older_checkpoints_load() -> None:
    t = TrainConfig(eval_every=1, target_val_reward=0.5, target_window=3)
    p = Progress()
    for step, v in enumerate([0.3, 0.6, 0.35], start=1):
        p.count(8, step, t)
        assert p.stop(step, v, t) is None
    q = Progress()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))  # what a checkpoint's state.json holds
    assert q == p and q.recent == [0.3, 0.6, 0.35]
    # the resumed run and the uninterrupted one stop at the same step
    for run in (p, q):
        run.count(8, 4, t)
        assert run.stop(4, 0.6, t) is not None  # (0.6 + 0.35 + 0.6) / 3 = 0.517 >= 0.5
    assert p.reached_step == q.reached_step == 4
    legacy = Progress()
    legacy.load_state_dict({"samples": 16, "reached_step": 0, "evals_since": 0})  # before target_window
    assert legacy == Progress(16, 0, 0, [])
