"""benchmarks/demo_seeds.py: the batch path read from metrics records, and its reversals."""

from benchmarks.demo_seeds import batch_path, reversals


def test_batch_path_and_reversals():
    recs = [
        {"step": s, "rollout/responses": b, "train/lr": 1e-4}
        for s, b in enumerate([512] * 3 + [1024] * 2 + [512] * 4 + [256] * 3, start=1)
    ]
    recs.insert(2, {"step": 2, "val/reward": 0.5})  # a validation record has no batch
    path, lr = batch_path(recs)
    assert path == [(1, 512), (4, 1024), (6, 512), (10, 256)]
    assert lr == 1e-4
    assert reversals(path) == 1  # up, then down twice: one reversal
    assert reversals([(1, 512), (4, 1024), (6, 512), (9, 1024)]) == 2
    assert reversals([(1, 512), (4, 256), (9, 128)]) == 0 and reversals([(1, 512)]) == 0


def test_summarise_means_and_spread():
    from benchmarks.demo_seeds import PHASES, summarise

    base = {p: 0.1 for p in PHASES} | {"rl_s": 50.0, "total_s": 60.0, "batches": "512@1", "reversals": 0, "eras": 0}
    rows = [base | {"seed": s, "val_start": 0.2, "val_end": v} for s, v in ((1, 0.4), (2, 0.6))]
    out = summarise(rows)
    assert out["seeds"] == [1, 2]
    assert out["val_end"]["mean"] == 0.5 and abs(out["val_end"]["sd"] - 0.1414) < 1e-4
    assert out["val_end"]["per_seed"] == [0.4, 0.6] and out["rl_s"]["sd"] == 0.0
