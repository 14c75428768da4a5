"""Bad input reaches the user as one line, ``megarl: <kind> error: <message>``, exit code 2,
before any process starts when it can be checked there (issue 14 C).

Most cases call ``megarl.cli.main`` in this process (the config/data checks run before the
launch; a launch would call ``subprocess.call``, which is made to fail the test); a few run
the real command as a subprocess for the exit code, the single stderr line and the time.
The run-time cases that need a real run are in ``tests/e2e/test_bad_input_runs.py``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from megarl import cli, launcher
from megarl.config import load_config, validate
from tests.helpers import ROOT

CONFIG = str(ROOT / "examples/grpo_cpu.yaml")


@pytest.fixture(autouse=True)
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A case that passes the pre-launch checks would start torchrun: fail the test instead."""

    def refuse(*args: Any, **kwargs: Any) -> int:
        raise AssertionError(f"a process was launched: {args[0] if args else kwargs}")

    monkeypatch.setattr(launcher.subprocess, "call", refuse)
    monkeypatch.delenv("RANK", raising=False)


def _one_line(capfd: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``megarl ARGV`` in-process; assert exit code 2 and exactly one stderr line."""
    capfd.readouterr()  # drop what the test's own setup printed (transformers' progress bars)
    rc = cli.main(argv)
    out, err = capfd.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("megarl: ") and " error: " in lines[0], lines[0]
    return lines[0]


def _jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("".join(ln + "\n" for ln in lines))
    return str(path)


def _rows(n: int) -> list[str]:
    return [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(n)]


# --------------------------------------------------------------------------- config, before launch


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["optim.lr=0"], "config error: optim.lr=0.0 must be > 0"),
        (["optim.lr=-1e-4"], "config error: optim.lr=-0.0001 must be > 0"),
        (
            ["rollout.temperature=0"],
            "config error: rollout.temperature=0.0 is greedy decoding: the "
            "rollout.samples_per_prompt=16 samples of a prompt would be identical",
        ),
        (["rollout.samples_per_prompt=1"], "rollout.samples_per_prompt=1 must be >= 2 with algo.advantage='grpo'"),
        (["rollout.samples_per_prompt=1", "algo.advantage=rloo"], "must be >= 2 with algo.advantage='rloo'"),
        (["rollout.kv_cache_gb=0"], "rollout.kv_cache_gb=0.0 must be > 0"),
        (
            ["rollout.kv_cache_gb=0.00005"],
            "rollout.kv_cache_gb=5e-05 holds 0 KV tokens per engine; one sequence "
            "of model.max_position_embeddings=64 needs 128",
        ),
        (["model.init_from=/nonexistent/model"], "model.init_from='/nonexistent/model' does not exist"),
    ],
)
def test_bad_settings_fail_before_launch(
    capfd: pytest.CaptureFixture[str], tmp_path: Path, sets: list[str], message: str
) -> None:
    argv = ["train", "--config", CONFIG, "--set", f"train.run_dir={tmp_path / 'run'}"]
    line = _one_line(capfd, argv + [a for s in sets for a in ("--set", s)])
    assert message in line


def test_kv_cache_that_holds_one_sequence_passes(tmp_path: Path) -> None:
    """The KV rule's boundary: 2 layers × 2 KV heads × 32 dims × K,V × fp32 = 1 KiB a token;
    128 tokens (one CPU block, covering 64 positions) need exactly 2^17 bytes."""
    cfg = load_config(CONFIG, ["rollout.kv_cache_gb=" + repr(2**17 / 2**30), f"train.run_dir={tmp_path}"])
    validate(cfg, 2)
    cfg = load_config(CONFIG, ["rollout.kv_cache_gb=" + repr((2**17 - 1024) / 2**30), f"train.run_dir={tmp_path}"])
    with pytest.raises(cli_config_error(), match="holds 0 KV tokens per engine"):
        validate(cfg, 2)


def cli_config_error() -> type[Exception]:
    from megarl.errors import ConfigError

    return ConfigError


def test_run_dir_that_is_a_file(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("x")
    line = _one_line(capfd, ["train", "--config", CONFIG, "--set", f"train.run_dir={tmp_path / 'taken' / 'run'}"])
    assert f"train.run_dir='{tmp_path}/taken/run' cannot be created: {tmp_path}/taken is a file" in line


def test_init_from_without_weights_or_of_another_architecture(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    base = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"train.run_dir={tmp_path / 'run'}",
        "--set",
        f"model.init_from={folder}",
    ]
    assert "has no config.json: not an HF model folder" in _one_line(capfd, base)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert f"model.init_from='{folder}' has no *.safetensors weights" in _one_line(capfd, base)
    _gpt2(folder)
    assert "unsupported HF config model_type='gpt2': supported: llama, qwen2" in _one_line(capfd, base)
    llama = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 64}  # fmt: skip
    for config, message in (
        ([1, 2], "unsupported HF config (top level)='list': config.json must hold a JSON object"),
        ({**llama, "num_attention_heads": "4"}, "unsupported HF config num_attention_heads='4': must be a positive integer"),
        ({**llama, "rms_norm_eps": -1}, "unsupported HF config rms_norm_eps=-1: must be a positive number"),
        ({k: v for k, v in llama.items() if k != "intermediate_size"}, "config.json: missing key 'intermediate_size'"),
    ):
        (folder / "config.json").write_text(json.dumps(config))
        assert message in _one_line(capfd, base), config


def test_run_dir_that_cannot_be_created(capfd: pytest.CaptureFixture[str]) -> None:
    line = _one_line(capfd, ["train", "--config", CONFIG, "--set", "train.run_dir=/proc/megarl_nope/run"])
    assert "config error: train.run_dir='/proc/megarl_nope/run' cannot be created: No such file or directory" in line


def test_yaml_syntax_error_names_file_and_line(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: 3\nmodel: {num_layers: 2\n")
    line = _one_line(capfd, ["train", "--config", str(bad)])
    assert line.startswith(f"megarl: config error: {bad}:4:1: invalid YAML (")
    line = _one_line(capfd, ["train", "--config", str(tmp_path)])
    assert line == f"megarl: config error: config file {tmp_path} is a directory, not a YAML file"


# --------------------------------------------------------------------------- data, before launch


def _data_case(tmp_path: Path, case: str) -> tuple[str, str]:
    """(data.source, expected message) of one bad-data case."""
    p = tmp_path / "p.jsonl"
    if case == "missing":
        return str(
            tmp_path / "none.jsonl"
        ), f"data error: data.source: prompt file {tmp_path}/none.jsonl does not exist"
    if case == "extension":
        (tmp_path / "p.csv").write_text("prompt,answer\n1+1=,2\n")
        return str(tmp_path / "p.csv"), "unsupported prompt file type '.csv' (use .jsonl, .parquet or a datasets save_to_disk folder)"
    if case == "missing_field":
        return _jsonl(p, _rows(5) + ['{"prompt": "2+2="}']), f"{p}:6: missing field 'answer' (data.answer_key"
    if case == "wrong_type":
        return _jsonl(
            p, _rows(3) + ['{"prompt": {"x": 1}, "answer": "2"}']
        ), f"{p}:4: field 'prompt' must be a string, got dict"
    if case == "bad_json":
        return _jsonl(p, _rows(2) + ['{"prompt": "2+2=", "answer": ']), f"{p}:3: invalid JSON (Expecting value"
    if case == "not_utf8":
        p.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+\xff2=", "answer": "4"}\n')
        return str(p), f"{p}:2: not valid UTF-8 (byte 0xff at column 15)"
    if case == "too_few_rows":
        return _jsonl(p, _rows(4)), f"data.source={p} has 4 rows, need more than data.num_val=4"
    if case == "none_fits":
        long = [json.dumps({"prompt": "1+" * 20 + "1=", "answer": "21"}) for _ in range(8)]
        return _jsonl(p, long), "no train prompt fits rollout.max_prompt_len=12 tokens (shortest: "
    if case == "builtin":
        return "builtin:arithmetc", "data.source='builtin:arithmetc': unknown built-in task 'arithmetc'"
    raise AssertionError(case)


DATA_CASES = [
    "missing",
    "extension",
    "missing_field",
    "wrong_type",
    "bad_json",
    "not_utf8",
    "too_few_rows",
    "none_fits",
    "builtin",
]


@pytest.mark.parametrize("case", DATA_CASES)
def test_bad_data_fails_before_launch(capfd: pytest.CaptureFixture[str], tmp_path: Path, case: str) -> None:
    source, message = _data_case(tmp_path, case)
    sets = [f"data.source={source}", "data.num_val=4", f"train.run_dir={tmp_path / 'run'}"]
    line = _one_line(capfd, ["train", "--config", CONFIG] + [a for s in sets for a in ("--set", s)])
    assert message in line, line


@pytest.mark.parametrize(
    ("sets", "needle"),
    [(["optim.lr=0"], "optim.lr=0.0 must be > 0"), (["data.source=builtin:nope"], "unknown built-in task 'nope'")],
)
def test_real_command_one_line_exit_2_fast(tmp_path: Path, sets: list[str], needle: str) -> None:
    """The installed entry point as a user runs it: exit code 2, one stderr line, nothing on
    stdout, seconds (no torchrun: that alone takes longer than the whole failure)."""
    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", CONFIG, "--set", f"train.run_dir={tmp_path}/r"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr
    assert elapsed < 20, elapsed
    print(f"{needle!r}: exit 2 in {elapsed:.2f}s")


def test_wrong_world_size_only_local_rank_0_leaves_by_itself(tmp_path: Path) -> None:
    """The two ranks of a hand-started torchrun with 2 processes for a 1-process config, as
    torchrun starts them (its environment, no torchrun: it would stop rank 1 itself). Rank 0
    says why and exits 2; rank 1 says nothing and is still there when rank 0 has long gone
    (a rank 1 that exited first had torchrun stop rank 0, sometimes before its line was out),
    and dies of torchrun's SIGTERM."""
    import os
    import signal

    cmd = [sys.executable, "-m", "megarl.cli", "train", "--config", CONFIG,
           "--set", "parallel.tensor_parallel=1", "--set", f"train.run_dir={tmp_path}/r"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != launcher.ERROR_DIR_ENV}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="1", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    ranks = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=tmp_path)
        for r in (0, 1)
    ]  # fmt: skip
    try:
        out0, err0 = ranks[0].communicate(timeout=120)
        took = time.perf_counter() - t0
        assert ranks[0].returncode == 2, err0
        assert err0.strip().splitlines() == [
            "megarl: config error: this run has 2 ranks (WORLD_SIZE) but parallel.tensor_parallel=1 × "
            "pipeline_parallel=1 × data_parallel=1 = 1: start it with `megarl train` (it launches torchrun "
            "itself) or --nproc-per-node=1"
        ], err0
        # rank 1 runs the same code to the same point: twice rank 0's time and it has not left
        with pytest.raises(subprocess.TimeoutExpired):
            ranks[1].wait(timeout=max(5.0, 2 * took))
        ranks[1].send_signal(signal.SIGTERM)  # what torchrun does once rank 0 has failed
        out1, err1 = ranks[1].communicate(timeout=30)
        assert ranks[1].returncode == -signal.SIGTERM and out1 == "" and err1 == "", (ranks[1].returncode, err1)
        print(f"rank 0 exit 2 after {took:.2f}s; rank 1 waited to be stopped")
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------- print-config, help


def test_print_config_shows_every_field_with_its_doc(capfd: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["train", "--config", CONFIG, "--set", "optim.lr=3e-4", "--print-config"])
    out, err = capfd.readouterr()
    assert rc == 0 and err == ""
    assert "  lr: 0.0003  # Peak learning rate." in out.splitlines()
    assert "  tensor_parallel: 2  # Tensor-parallel size of actor and reference." in out.splitlines()
    assert "  kv_cache_gb: 0.25  # KV cache per engine on CPU, GiB." in out.splitlines()
    # valid YAML that loads back into the same config
    again = tmp_yaml = yaml.safe_load(out)
    assert tmp_yaml["rollout"]["samples_per_prompt"] == 16
    from megarl.config import RunConfig
    from megarl.config.load import _build

    assert _build(RunConfig, again, "") == load_config(CONFIG, ["optim.lr=3e-4"])
    documented = [ln for ln in out.splitlines() if ":" in ln and not ln.rstrip().endswith(":")]
    assert all("  # " in ln for ln in documented), [ln for ln in documented if "  # " not in ln]


def test_train_help_mentions_print_config(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    assert "--print-config" in capfd.readouterr().out


# --------------------------------------------------------------------------- tools: convert, report


def _gpt2(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).save_pretrained(folder)
    return folder


def _mistral(folder: Path) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    MistralForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["gpt2", "mistral", "empty", "no_weights"])
def test_convert_refuses_with_one_line(capfd: pytest.CaptureFixture[str], tmp_path: Path, kind: str) -> None:
    hf = tmp_path / kind
    hf.mkdir()
    if kind == "gpt2":
        _gpt2(hf)
        message = f"convert error: {hf}/config.json: model_type 'gpt2' is not supported (supported: llama, qwen2, qwen3, qwen3_moe, mixtral)"
    elif kind == "mistral":
        _mistral(hf)
        message = f"convert error: {hf}/config.json: model_type 'mistral' is not supported"
    elif kind == "empty":
        message = f"convert error: {hf}/config.json not found: {hf} is not an HF model folder"
    else:
        (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (hf / "pytorch_model.bin").write_bytes(b"")
        message = f"convert error: no *.safetensors weights in {hf} (found pytorch_model.bin: re-save with"
    line = _one_line(capfd, ["convert", "hf-to-megarl", "--hf", str(hf), "--out", str(tmp_path / "ckpt")])
    assert message in line, line
    assert not (tmp_path / "ckpt").exists()


def test_convert_missing_checkpoint(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = _one_line(capfd, ["convert", "megarl-to-hf", "--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "o")])
    assert line == f"megarl: checkpoint error: checkpoint path {tmp_path}/none does not exist"


def test_convert_never_replaces_a_folder_that_is_not_an_hf_model(
    capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """megarl-to-hf replaces an earlier HF export at --out, and refuses anything else before any
    work: a run folder (holding the very checkpoint being read), a folder of the user's files."""
    from megarl.checkpoint.hf_io import replaceable_hf_folder

    run = tmp_path / "run"
    (run / "checkpoints/step_2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    line = _one_line(capfd, ["convert", "megarl-to-hf", "--ckpt", str(run / "checkpoints"), "--out", str(run)])
    assert f"convert error: --out: {run} exists and holds checkpoints/, metrics.jsonl: not an HF model folder" in line
    assert (run / "checkpoints/step_2").is_dir() and (run / "metrics.jsonl").read_text() == "{}\n"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    (mine / "config.json").write_text("{}")
    assert "holds notes.txt:" in _one_line(capfd, ["convert", "megarl-to-hf", "--ckpt", str(run), "--out", str(mine)])
    assert (mine / "notes.txt").read_text() == "keep"
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "--out " + str(afile) + " is a file" in _one_line(capfd, ["convert", "megarl-to-hf", "--ckpt", str(run), "--out", str(afile)])
    export = tmp_path / "export"  # an earlier export (sharded weights, tokenizer, chat template): replaceable
    export.mkdir()
    for name in ("config.json", "generation_config.json", "model-00001-of-00002.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "tokenizer.model"):
        (export / name).write_text("")
    replaceable_hf_folder(export)
    replaceable_hf_folder(tmp_path / "new")


def test_report_missing_and_empty(capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert _one_line(capfd, ["report", str(tmp_path / "none")]) == (
        f"megarl: report error: run folder {tmp_path}/none does not exist"
    )
    line = _one_line(capfd, ["report", str(tmp_path)])
    assert line.startswith(f"megarl: report error: {tmp_path}/metrics.jsonl not found")
    (tmp_path / "metrics.jsonl").write_text("")
    assert "metrics.jsonl has no records" in _one_line(capfd, ["report", str(tmp_path)])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "x": \n{"step": 3}\n')
    assert f"{tmp_path}/metrics.jsonl:2: Expecting value" in _one_line(capfd, ["report", str(tmp_path)])


def test_report_skips_a_cut_last_line_and_draws(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    recs = [{"step": s, "rollout/reward_mean": 0.1 * s, "train/lr": 1e-4} for s in range(1, 5)]
    text = "".join(json.dumps(r) + "\n" for r in recs)
    (tmp_path / "metrics.jsonl").write_text(text + '{"step": 5, "rollout/rew')  # killed mid-write
    with caplog.at_level(logging.WARNING, logger="megarl"):
        assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report" / "report.html").is_file()
    assert f"{tmp_path}/metrics.jsonl:5: skipping the cut last line" in caplog.text
    from megarl.metrics import read_metrics

    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
