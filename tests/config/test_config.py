"""Config loading and validation: unknown keys, wrong types and inconsistent sizes fail
before any process group starts, naming the field, the value and the rule."""

import re
from pathlib import Path

import pytest

from megarl.config import ConfigError, RunConfig, load_config, validate

ROOT = Path(__file__).resolve().parents[2]


def _leaves(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    for k, v in tree.items():
        out += _leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return out


def test_examples_load_and_validate(tmp_path: Path) -> None:
    """Every example loads with each of its YAML values in the typed config, and validates at
    its own world size (and not at another). Examples that start from files a checkout does
    not hold (``model.init_from``, ``data.source``) or name GPU-only settings validate with
    the stand-ins of :func:`tests.config.test_examples.local_stand_ins`."""
    import yaml

    from tests.config.test_examples import local_stand_ins

    paths = sorted((ROOT / "examples").glob("*.yaml"))
    assert {"grpo_cpu.yaml", "ppo_cpu.yaml", "byo_chat_math.yaml", "qwen_math_gpu.yaml", "agent_calc_cpu.yaml",
            "agent_python_qwen3_gpu.yaml", "grpo_moe_cpu.yaml", "grpo_qwen3_30b_a3b_gpu.yaml"} <= {
        p.name for p in paths
    }
    for path in paths:
        cfg = load_config(path)
        leaves = _leaves(yaml.safe_load(path.read_text()))
        assert leaves, path
        for dotted, value in leaves:
            got: object = cfg
            for part in dotted.split("."):
                got = getattr(got, part)
            assert got == value or (isinstance(value, int | float) and got == float(value)), (path.name, dotted)
        local_stand_ins(path.name, cfg, tmp_path)
        p = cfg.parallel
        world = p.tensor_parallel * p.pipeline_parallel * p.data_parallel
        validate(cfg, world)
        with pytest.raises(ConfigError):
            validate(cfg, world + 1)


def test_overrides_are_typed() -> None:
    cfg = load_config(None, ["train.steps=7", "optim.lr=3e-4", "train.tensorboard=false", "rollout.engine_addresses=a:1,b:2"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 3e-4 and cfg.train.tensorboard is False
    assert cfg.rollout.engine_addresses == ["a:1", "b:2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stpes=3"], "unknown config key 'train.stpes'"),
        (["nosection.x=1"], "unknown config key 'nosection'"),
        (["train.steps=abc"], "train.steps='abc' must be an int"),
        (["optim.lr=fast"], "optim.lr='fast' must be a float"),
        (["algo.kl_estimator=k9"], "algo.kl_estimator='k9' must be one of"),
        (["train.tensorboard=maybe"], "train.tensorboard='maybe' must be a bool"),
        (["coordinator.choose=both"], "coordinator.choose='both' must be one of .'total', 'prompts_and_samples'."),
    ],
)
def test_bad_keys_and_types(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, overrides)


def _cfg(**sections: dict) -> RunConfig:
    return load_config(None, [f"{s}.{k}={v}" for s, kv in sections.items() for k, v in kv.items()])


@pytest.mark.parametrize(
    ("cfg", "world", "message"),
    [
        (_cfg(parallel={"tensor_parallel": 3}), 3, "parallel.tensor_parallel=3 does not divide model.num_attention_heads=4"),
        (_cfg(parallel={"tensor_parallel": 4}), 4, "does not divide model.num_query_groups=2"),
        (_cfg(parallel={"pipeline_parallel": 3}), 3, "parallel.pipeline_parallel=3 does not divide model.num_layers=2"),
        (_cfg(parallel={"tensor_parallel": 2}), 3, "does not divide the trainer world size 3"),
        (_cfg(rollout={"num_prompts": 3, "samples_per_prompt": 2}), 1, "must be divisible by DP=1 × parallel.micro_batch_size=8"),
        (_cfg(parallel={"micro_batch_size": 4}, rollout={"num_prompts": 2, "samples_per_prompt": 2}), 2,
         "must be divisible by DP=2"),
        (_cfg(rollout={"max_prompt_len": 100, "max_response_len": 100}), 1, "exceeds model.max_position_embeddings"),
        (_cfg(model={"num_query_groups": 3}), 1, "model.num_query_groups=3 must divide model.num_attention_heads=4"),
        (_cfg(train={"steps": -1}), 1, "train.steps=-1 must be a positive integer"),
        (_cfg(train={"max_samples": -5}), 1, "train.max_samples=-5 must be a positive integer"),
        (_cfg(train={"evals_past_target": 2}), 1, "train.evals_past_target=2 needs train.target_val_reward > 0"),
        (_cfg(train={"target_window": 5}), 1, "train.target_window=5 needs train.target_val_reward > 0"),
        (_cfg(train={"target_window": 0, "target_val_reward": 0.5}), 1, "train.target_window=0 must be a positive integer"),
        (_cfg(train={"evals_past_target": 2, "target_val_reward": 0.5, "eval_every": 0}), 1,
         "train.evals_past_target=2 counts mid-run validations: set train.eval_every or train.eval_every_samples"),
        (_cfg(algo={"dual_clip": 0.5}), 1, "algo.dual_clip=0.5 must be > 1"),
        # coordinator.choose=prompts_and_samples: each group's halves must be whole micro-batches, S in the bounds
        (_cfg(coordinator={"enabled": True, "choose": "prompts_and_samples"}), 1,
         "parallel.micro_batch_size=8 must divide rollout.samples_per_prompt/2=4 with coordinator.choose=prompts_and_samples"),
        (_cfg(coordinator={"enabled": True, "choose": "prompts_and_samples", "max_samples_per_prompt": 4},
              parallel={"micro_batch_size": 4}), 1,
         r"rollout.samples_per_prompt=8 must lie in \[coordinator.min_samples_per_prompt=2, coordinator.max_samples_per_prompt=4\]"),
        (_cfg(coordinator={"enabled": True, "choose": "prompts_and_samples", "microbatch_parts": False},
              parallel={"micro_batch_size": 4}), 1,
         "coordinator.microbatch_parts=False must be True with coordinator.choose=prompts_and_samples"),
        (_cfg(coordinator={"min_samples_per_prompt": 1}), 1, "coordinator.min_samples_per_prompt=1 must be >= 2"),
        (_cfg(rollout={"min_response_len": 13}), 1, "rollout.min_response_len=13 must be in .0, max_response_len=12."),
        (_cfg(rollout={"engine_lease_s": 5}), 1, "rollout.engine_lease_s=5.0 must be 0 .off. or >= 15 s"),
        (_cfg(rollout={"engine_threads": -1}), 1, "rollout.engine_threads=-1 must be a positive integer"),
        (_cfg(data={"reward": "bleu"}), 1, "data.reward='bleu' is not a built-in reward .answer_prefix, arithmetic"),
        (_cfg(reward={"fn": "bleu"}), 1, r"reward.fn\[0\]='bleu' is not a built-in reward"),
        (_cfg(reward={"fn": "math,exact_match", "weights": "1"}), 1, "reward.weights=.1.0. has 1 entries, reward.fn has 2"),
        (_cfg(reward={"fn": "math", "timeout_s": 0}), 1, "reward.timeout_s=0.0 must be > 0 seconds"),
        (_cfg(reward={"workers": 0}), 1, "reward.workers=0 must be a positive integer"),
        (_cfg(model={"arch": "qwen2", "kv_channels": 64}), 1,
         "model.kv_channels=64 arch=qwen2 needs head_dim × num_attention_heads = hidden_size=128"),
        (_cfg(model={"arch": "qwen3", "linear_bias": True}), 1, "model.linear_bias=True is a Llama option"),
        (_cfg(model={"kv_channels": -1}), 1, "model.kv_channels=-1 must be a positive integer"),
        (_cfg(reward={"failed_reward": float("nan")}), 1, "reward.failed_reward=nan must be a finite number"),
        (_cfg(rollout={"temperature": float("nan")}), 1, "rollout.temperature=nan must be a finite number"),
        (_cfg(reward={"timeout_s": float("inf")}), 1, "reward.timeout_s=inf must be a finite number"),
        (_cfg(reward={"fn": "math,exact_match", "weights": [1.0, float("nan")]}), 1,
         r"reward.weights=\[1.0, nan\] must be a finite number"),
        (_cfg(algo={"kl_coef": -1.0}), 1, "algo.kl_coef=-1.0 must be >= 0"),
        (_cfg(algo={"clip_high": -0.2}), 1, "algo.clip_high=-0.2 must be >= 0"),
        (_cfg(algo={"lam": 1.5}), 1, r"algo.lam=1.5 must be in \[0, 1\]"),
        (_cfg(warm_start={"stop_at_exact": 1.5}), 1, r"warm_start.stop_at_exact=1.5 must be in \[0, 1\] .a share"),
        (_cfg(reward={"stop_after_failed_steps": -1}), 1, "reward.stop_after_failed_steps=-1 must be a positive integer"),
        (_cfg(coordinator={"noise_kind": "fisher"}), 1,
         "coordinator.noise_kind='fisher' must be 'plain' .raw gradients. or 'adam'"),
        (_cfg(coordinator={"enabled": True, "noise_kind": "adam"}, parallel={"use_distributed_optimizer": True}), 1,
         "parallel.use_distributed_optimizer=True must be false with coordinator.noise_kind='adam'"),
        (_cfg(coordinator={"lr_reference_batch": -1}), 1, "coordinator.lr_reference_batch=-1 must be a positive integer"),
        (_cfg(rollout={"sampling_seed": "prompt", "seeded": False}), 1,
         "rollout.sampling_seed='prompt' needs rollout.seeded=true"),
        (_cfg(rollout={"sampling_seed": "prompt"}, env={"fn": "calculator"}), 1,
         "rollout.sampling_seed='prompt' is for single-turn rollouts; env.fn='calculator' runs episodes"),
        (_cfg(train={"val_metric": "answer_prob"}, env={"agent": "a:b"}), 1,
         "train.val_metric='answer_prob' is for single-turn rollouts; env.agent='a:b' runs episodes"),
        (_cfg(rollout={"engine_logprobs_every": -1}), 1, "rollout.engine_logprobs_every=-1 must be a positive integer"),
        (_cfg(parallel={"pack_sequences": True}), 1,
         "parallel.pack_sequences=True packs token-budget micro-batches: set parallel.max_tokens_per_micro_batch"),
        (_cfg(parallel={"pack_sequences": True, "max_tokens_per_micro_batch": 256}, model={"attention": "unfused"}), 1,
         "parallel.pack_sequences=True needs model.attention=sdpa with the local spec .got 'unfused'"),
        (_cfg(parallel={"logprob_micro_batch_size": 48}), 1,
         "parallel.logprob_micro_batch_size=48 × DP=1 must divide rollout.num_prompts×samples_per_prompt=128"),
        (_cfg(parallel={"max_tokens_per_micro_batch": 20}), 1,
         "parallel.max_tokens_per_micro_batch=20 must be 0 .off. or >= rollout.max_prompt_len . max_response_len = 36"),
        (_cfg(parallel={"max_tokens_per_micro_batch": -1}), 1, "parallel.max_tokens_per_micro_batch=-1 must be a positive"),
        (_cfg(parallel={"max_tokens_per_micro_batch": 256}, coordinator={"enabled": True}), 1,
         "parallel.max_tokens_per_micro_batch=256 needs DP > 1 .actor and critic. with coordinator.enabled"),
        (_cfg(parallel={"max_tokens_per_micro_batch": 256, "micro_batch_size": 4}, coordinator={"enabled": True},
              algo={"name": "ppo", "advantage": "gae"}, critic={"parallel.tensor_parallel": 2}), 2,
         "parallel.max_tokens_per_micro_batch=256 needs DP > 1 .actor and critic."),
    ],
)
def test_inconsistent_sizes(cfg: RunConfig, world: int, message: str) -> None:
    from megarl.prelaunch import check_run

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("×", ".")):
        check_run(cfg, world)  # the config's rules + each reward imported, as `megarl train` runs them


def test_missing_file_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_weight_sync_transport_and_colocate_fields() -> None:
    cfg = load_config(None)
    assert cfg.weight_sync.transport == "auto" and cfg.rollout.colocate is False
    cfg = load_config(None, ["weight_sync.transport=http", "rollout.colocate=false"])
    assert cfg.weight_sync.transport == "http"
    validate(cfg, 1)
    with pytest.raises(ConfigError, match=r"weight_sync.transport='tcp' must be one of \['auto', 'shm', 'http', "
                                          r"'nccl', 'cuda_ipc'\]"):
        load_config(None, ["weight_sync.transport=tcp"])
    with pytest.raises(ConfigError, match="rollout.colocate='sometimes' must be a bool"):
        load_config(None, ["rollout.colocate=sometimes"])


def test_nccl_refused_for_colocated_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the rule holds on any machine
    cfg = load_config(None, ["weight_sync.transport=nccl", "rollout.colocate=true"])
    with pytest.raises(ConfigError, match=r"weight_sync.transport='nccl' cannot reach colocated engines"):
        validate(cfg, 1)
    validate(load_config(None, ["weight_sync.transport=cuda_ipc", "rollout.colocate=true"]), 1)


PPO = {"name": "ppo", "advantage": "gae"}
R3 = {"num_prompts": 3, "samples_per_prompt": 8}  # 24 responses: the actor's DP=3 × 8 splits them


@pytest.mark.parametrize(
    ("cfg", "world", "message"),
    [
        (_cfg(algo=PPO, rollout=R3, critic={"parallel.tensor_parallel": 3}), 3,
         "critic.parallel.tensor_parallel=3 does not divide model.num_attention_heads=4"),
        (_cfg(algo=PPO, critic={"parallel.tensor_parallel": 4}), 4,
         "critic.parallel.tensor_parallel=4 does not divide model.num_query_groups=2"),
        (_cfg(algo=PPO, rollout=R3, model={"num_layers": 2}, critic={"parallel.pipeline_parallel": 3}), 3,
         "critic.parallel.pipeline_parallel=3 does not divide model.num_layers=2"),
        (_cfg(algo=PPO, rollout=R3, critic={"parallel.pipeline_parallel": 2}), 3,
         "critic.parallel='TP×PP=1×2' does not divide the trainer world size 3"),
        # actor TP2 (DP1) splits 16 responses; the critic's DP2 × micro-batch 16 does not
        (_cfg(algo=PPO, parallel={"tensor_parallel": 2, "micro_batch_size": 16}, rollout={"num_prompts": 4, "samples_per_prompt": 4},
              critic={"parallel.tensor_parallel": 1}), 2,
         "rollout.num_prompts×samples_per_prompt=16 must be divisible by the critic's DP=2 × parallel.micro_batch_size=16"),
        (_cfg(critic={"parallel.tensor_parallel": 2}), 2, "critic.parallel='TP=2, PP=0' needs algo.name='ppo'"),
        (_cfg(algo=PPO, coordinator={"enabled": True}, critic={"parallel.pipeline_parallel": 2}), 2,
         "critic.parallel.pipeline_parallel=2 with coordinator.enabled needs the critic's DP > 1 or PP = 1"),
        (_cfg(algo=PPO, critic={"parallel.tensor_parallel": -1}), 1, "critic.parallel.tensor_parallel=-1 must be a positive integer"),
    ],
)
def test_critic_layout_errors_name_the_field(cfg: RunConfig, world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("×", ".").replace("'", ".")):
        validate(cfg, world)


def test_critic_layout_defaults_to_the_actor_and_validates() -> None:
    cfg = _cfg(algo=PPO, parallel={"tensor_parallel": 2, "micro_batch_size": 4})
    validate(cfg, 2)
    assert cfg.critic_layout(2) == (2, 1, 1)  # unset: the actor's TP/PP
    cfg = _cfg(algo=PPO, parallel={"tensor_parallel": 2, "micro_batch_size": 4}, critic={"parallel.tensor_parallel": 1})
    validate(cfg, 2)
    assert cfg.critic_layout(2) == (1, 1, 2)  # TP1 over 2 ranks: DP2
    cfg = _cfg(algo=PPO, critic={"parallel.pipeline_parallel": 2})
    validate(cfg, 2)
    assert cfg.critic_layout(2) == (1, 2, 1)


def test_explicit_head_dim_validates() -> None:
    """Qwen3-style head_dim × heads ≠ hidden_size (model.kv_channels); 0 keeps hidden / heads."""
    cfg = _cfg(model={"arch": "qwen3", "kv_channels": 64, "hidden_size": 96})  # 96 / 4 heads = 24 ≠ 64
    validate(cfg, 1)
    assert cfg.model.head_dim == 64
    assert _cfg().model.head_dim == 32


def test_engine_logprobs_on_the_steps_that_read_them() -> None:
    """Every k-th step from the first for the mismatch metrics; every step when the loss reads
    them (TIS, off-policy batches); never with k = 0 and an on-policy loss."""
    from megarl.rollout.sampling import CollectSettings, engine_logprobs_wanted

    def steps(**sections: dict) -> list[int]:
        return [s for s in range(12) if engine_logprobs_wanted(CollectSettings.of(_cfg(**sections)), s)]

    assert RunConfig().rollout.engine_logprobs_every == 10 and steps() == [0, 10]
    assert steps(rollout={"engine_logprobs_every": 3}) == [0, 3, 6, 9]
    assert steps(rollout={"engine_logprobs_every": 0}) == []
    assert steps(rollout={"engine_logprobs_every": 0}, algo={"tis_cap": 2.0}) == list(range(12))
    assert steps(rollout={"engine_logprobs_every": 0, "max_staleness": 1}, algo={"tis_cap": 2.0}) == list(range(12))


def test_set_gives_string_fields_the_text_as_typed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """YAML would cut a '#' comment, read 'no' as False and 'a: b' as a mapping; a string field
    takes the text itself, every other field the YAML value."""
    from megarl.config import load_config

    for text in ("You are a tutor #1 in math", "Solve it. Format: \\boxed{n}", "no", "null", "3"):
        assert load_config(None, [f"data.system_prompt={text}"]).data.system_prompt == text
    cfg = load_config(None, ["reward.fn=math,exact_match", "reward.weights=1,2", "coordinator.enabled=no", "train.steps=7"])
    assert (cfg.reward.fn, cfg.reward.weights, cfg.coordinator.enabled, cfg.train.steps) == (
        ["math", "exact_match"], [1.0, 2.0], False, 7
    )


def test_a_key_given_twice_in_the_yaml_is_refused_with_its_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from megarl.config import ConfigError, load_config

    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  num_prompts: 4\ntrain:\n  steps: 3\nrollout:\n  samples_per_prompt: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml:5:1: invalid YAML \(key 'rollout' given twice \(first at line 1\)\)"):
        load_config(path)
    path.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match=r"c.yaml:3:3: invalid YAML \(key 'steps' given twice"):
        load_config(path)


def test_cpu_engine_head_dims_are_vllms_and_others_are_refused() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from megarl.config import ConfigError, validate
    from megarl.config.cross import CPU_ENGINE_HEAD_DIMS

    assert list(CPU_ENGINE_HEAD_DIMS) == CPUAttentionBackend.get_supported_head_sizes()
    cfg = _cfg(model={"hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2})  # head_dim 16
    with pytest.raises(ConfigError, match="model.kv_channels=0 gives head_dim=16 .* which vLLM's CPU attention cannot "
                       "run .supported: 32, 64, 80"):
        validate(cfg, 1)
    cfg.rollout.engine_addresses = ["gpu-node:8000"]  # engines elsewhere: their own business
    validate(cfg, 1)


def test_coordinator_probe_parts_hold_whole_groups() -> None:
    """Micro-batches of 4 with 8 samples per prompt (examples/qwen_math_gpu.yaml's layout) split
    every GRPO group; the probe joins them in pairs, so the run needs two pairs at DP = 1 and
    whole pairs on every rank. Where no join fits the batch (micro-batch 12, groups of 8: runs
    of 24 rows) the config is refused, naming the fields (issue #41 D.4)."""
    from megarl.prelaunch import check_run

    def cfg(prompts: int, mbs: int) -> RunConfig:
        return _cfg(coordinator={"enabled": True, "min_prompts": 2},
                    rollout={"num_prompts": prompts, "samples_per_prompt": 8}, parallel={"micro_batch_size": mbs})

    check_run(cfg(2, 4), 1)  # 16 rows: two parts of one group each
    with pytest.raises(ConfigError, match=re.escape(
            "rollout.num_prompts×samples_per_prompt=8 must be >= 2 × lcm(parallel.micro_batch_size=4, "
            "rollout.samples_per_prompt=8) × algo.mini_batches=1 = 16")):
        check_run(cfg(1, 4), 1)
    check_run(cfg(4, 4), 2)  # DP = 2: one group per rank
    with pytest.raises(ConfigError, match=re.escape(  # ranks of 12 rows: the second starts mid-group
            "rollout.num_prompts×samples_per_prompt=24 must be divisible by DP=2 × lcm(parallel.micro_batch_size"
            "=12, rollout.samples_per_prompt=8) × algo.mini_batches=1 = 48") + ".*whole GRPO groups"):
        check_run(cfg(3, 12), 2)
    with pytest.raises(ConfigError, match=re.escape(  # mini-batches of 12 rows: one and a half groups
            "rollout.num_prompts×samples_per_prompt=24 must be divisible by DP=1 × lcm(parallel.micro_batch_size"
            "=4, rollout.samples_per_prompt=8) × algo.mini_batches=2 = 16")):
        check_run(_cfg(coordinator={"enabled": True, "min_prompts": 2}, rollout={"num_prompts": 3,
                       "samples_per_prompt": 8}, parallel={"micro_batch_size": 4}, algo={"mini_batches": 2}), 1)
    check_run(cfg(6, 12), 1)  # 48 rows: two runs of 24


def test_coordinator_start_the_probe_cannot_measure_is_refused() -> None:
    """At DP = 1 the noise estimate's parts are micro-batches: a start with one is named."""
    from megarl.prelaunch import check_run

    cfg = _cfg(coordinator={"enabled": True, "min_prompts": 2},
               rollout={"num_prompts": 4, "samples_per_prompt": 16}, parallel={"micro_batch_size": 64})
    with pytest.raises(ConfigError, match=r"rollout.num_prompts×samples_per_prompt=64 must be >= 2 × "
                       r"parallel.micro_batch_size=64 × algo.mini_batches=1 = 128"):
        check_run(cfg, 1)
    check_run(_cfg(coordinator={"enabled": True, "min_prompts": 2},
                   rollout={"num_prompts": 8, "samples_per_prompt": 16}, parallel={"micro_batch_size": 64}), 1)
    check_run(_cfg(coordinator={"enabled": True, "min_prompts": 2},  # DP = 2: the parts are ranks
                   rollout={"num_prompts": 8, "samples_per_prompt": 16}, parallel={"micro_batch_size": 64}), 2)


def test_only_the_ints_a_section_allows_may_be_zero() -> None:
    """Every int setting must be > 0 except those its section lists in ZERO_ALLOWED (0 = off,
    auto or none); each section names its own (before: one list of field-name suffixes)."""
    from megarl.config.rules import positive_ints, walk

    may_be_zero = []
    for path, value in walk(RunConfig()):
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                positive_ints(load_config(None, [f"{path}=0"]))
                may_be_zero.append(path)
            except ConfigError as e:
                assert str(e) == f"{path}=0 must be a positive integer"
    assert may_be_zero == [
        "model.kv_channels", "model.num_experts", "model.moe_ffn_hidden_size", "model.moe_dead_expert_steps",
        "model.vocab_size",
        "parallel.expert_tensor_parallel", "parallel.logprob_micro_batch_size",
        "parallel.max_tokens_per_micro_batch", "optim.warmup_steps", "reward.max_tasks_per_worker",
        "reward.worker_memory_mb", "reward.stop_after_failed_steps", "rollout.min_response_len",
        "rollout.engine_logprobs_every", "rollout.engine_threads", "rollout.max_staleness", "env.max_tokens",
        "algo.overlong_buffer_len", "critic.parallel.tensor_parallel", "critic.parallel.pipeline_parallel",
        "critic.warmup_steps", "warm_start.steps", "coordinator.warmup_steps", "coordinator.cooldown_steps",
        "coordinator.lr_reference_batch", "train.steps", "train.eval_every", "train.eval_every_samples",
        "train.max_samples", "train.save_every", "train.evals_past_target",
    ]  # fmt: skip
