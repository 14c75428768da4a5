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
