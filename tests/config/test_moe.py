"""Mixture-of-experts settings: a Qwen3-MoE or Mixtral config.json maps onto the model section,
what megarl would not reproduce is refused naming the key, and the expert-parallel layout's rules
name the field, the value and the rule (pure: no processes)."""

import re

import pytest

from megarl.config import ConfigError, ModelConfig, load_config, validate
from megarl.config.hf import UnsupportedHFModel, model_config_from_hf

# Qwen3-30B-A3B's shape and routing, as its config.json on the hub holds them
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


# Mixtral-8x7B-v0.1's config.json as the hub holds it
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}
FAMILIES = {"qwen3_moe": QWEN3_30B_A3B, "mixtral": MIXTRAL_8X7B}


def test_mixtral_8x7b_config_maps_experts_and_routing() -> None:
    """Each expert is intermediate_size wide; the k weights are always renormalised."""
    m = model_config_from_hf(MIXTRAL_8X7B, ModelConfig())
    assert (m.arch, m.num_experts, m.expert_ffn_hidden_size, m.moe_router_topk) == ("mixtral", 8, 14336, 2)
    assert m.moe_norm_topk_prob and m.head_dim == 128 and m.kv_channels == 0 and m.rotary_base == 1e6
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (0.0, 0.0)  # router_aux_loss_coef is HF training's
    m.validate()
    # keys HF Mixtral does not read do not change it; its training-only jitter is not refused
    same = model_config_from_hf({**MIXTRAL_8X7B, "norm_topk_prob": False, "router_jitter_noise": 0.1}, ModelConfig())
    assert same == m


def test_qwen3_30b_a3b_config_maps_experts_and_routing() -> None:
    m = model_config_from_hf(QWEN3_30B_A3B, ModelConfig())
    assert (m.arch, m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk) == ("qwen3_moe", 128, 768, 8)
    assert m.moe_norm_topk_prob and m.head_dim == 128 and m.kv_channels == 128
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (0.0, 0.0)  # router_aux_loss_coef is HF training's
    m.validate()


def test_transformers5_spelling_of_the_expert_count() -> None:
    """transformers 5 writes ``num_local_experts`` (its attribute map), the hub ``num_experts``."""
    cfg = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert model_config_from_hf({**cfg, "num_local_experts": 64}, ModelConfig()).num_experts == 64
    with pytest.raises(UnsupportedHFModel, match="num_local_experts=64: differs from num_experts=128"):
        model_config_from_hf({**QWEN3_30B_A3B, "num_local_experts": 64}, ModelConfig())
    assert not model_config_from_hf({**QWEN3_30B_A3B, "norm_topk_prob": False}, ModelConfig()).moe_norm_topk_prob


_QWEN3_MOE_REFUSALS = [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2: megarl builds a mixture of experts in every layer"),
    ({"mlp_only_layers": [0, 47]}, "mlp_only_layers=[0, 47]: megarl builds a mixture of experts in every layer"),
    ({"shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size=5632"),
    ({"n_shared_experts": 1}, "n_shared_experts=1"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),  # aux-free bias routing (DeepSeek-V3)
    ({"n_group": 8}, "n_group=8"),  # group-limited routing
    ({"topk_group": 4}, "topk_group=4"),
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok=129: exceeds num_experts=128"),
    ({"num_experts": 0}, "num_experts=0: must be a positive integer"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
]
_MIXTRAL_REFUSALS = [
    ({"sliding_window": 4096}, "sliding_window=4096: megarl attends over the full context"),
    ({"num_local_experts": 0}, "num_local_experts=0: must be a positive integer"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9: exceeds num_experts=8"),
    ({"num_local_experts": 4, "num_experts": 8}, "num_local_experts=4: differs from num_experts=8"),
    ({"n_shared_experts": 1}, "n_shared_experts=1"),
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
]


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [("qwen3_moe", *row) for row in _QWEN3_MOE_REFUSALS] + [("mixtral", *row) for row in _MIXTRAL_REFUSALS],
)
def test_unsupported_moe_configs_are_refused_naming_the_key(family: str, change: dict, message: str) -> None:
    with pytest.raises(UnsupportedHFModel, match="unsupported HF config " + re.escape(message)):
        model_config_from_hf({**FAMILIES[family], **change}, ModelConfig())


def _moe(*sets: str, arch: str = "qwen3_moe") -> list[str]:
    width = "model.moe_ffn_hidden_size=64" if arch == "qwen3_moe" else "model.ffn_hidden_size=64"  # mixtral: one width
    return [f"model.arch={arch}", "model.num_experts=4", width, *sets]


_COORD_EP2 = ("parallel.expert_parallel=2", "coordinator.enabled=true", "coordinator.min_prompts=2",
              "parallel.micro_batch_size=4", "rollout.samples_per_prompt=4")  # fmt: skip


@pytest.mark.parametrize(
    ("sets", "world", "message"),
    [
        (_moe("parallel.expert_parallel=3"), 3, "parallel.expert_parallel=3 does not divide model.num_experts=4"),
        (_moe("parallel.expert_parallel=2"), 1, "parallel.expert_parallel=2 does not divide the data-parallel size 1"),
        (
            _moe("parallel.expert_parallel=2", "parallel.tensor_parallel=2"),
            2,
            "parallel.expert_parallel=2 does not divide the data-parallel size 1 (EP × TP=4 must divide TP × DP=2",
        ),
        (["parallel.expert_parallel=2"], 2, "parallel.expert_parallel=2 needs a mixture-of-experts model"),
        (["model.num_experts=4"], 1, "model.num_experts=4 needs arch=qwen3_moe or mixtral"),
        (["model.arch=qwen3_moe"], 1, "model.num_experts=0 must be >= 1 with arch=qwen3_moe"),
        (["model.arch=mixtral"], 1, "model.num_experts=0 must be >= 1 with arch=mixtral"),
        (
            ["model.arch=mixtral", "model.num_experts=4", "model.moe_ffn_hidden_size=64"],
            1,
            "model.moe_ffn_hidden_size=64 differs from model.ffn_hidden_size=256",
        ),
        (
            ["model.arch=mixtral", "model.num_experts=4", "model.moe_norm_topk_prob=false"],
            1,
            "model.moe_norm_topk_prob=False must be true: arch=mixtral always renormalises its k routing weights",
        ),
        (_moe("model.moe_router_topk=5"), 1, "model.moe_router_topk=5 exceeds model.num_experts=4"),
        (_moe("model.moe_aux_loss_coeff=-0.1"), 1, "model.moe_aux_loss_coeff=-0.1 must be >= 0"),
        (
            _moe("parallel.tensor_parallel=2"),
            2,
            "parallel.sequence_parallel=False with a mixture-of-experts model at parallel.tensor_parallel=2: "
            "megatron trains MoE layers under TP only with sequence parallelism",
        ),
        (
            _moe("parallel.expert_parallel=2", "parallel.max_tokens_per_micro_batch=512"),
            2,
            "parallel.max_tokens_per_micro_batch=512 with parallel.expert_parallel=2",
        ),
        (  # the noise probe's parts are DP ranks: the experts' parts are EP groups, here one
            _moe("parallel.expert_parallel=2", "coordinator.enabled=true", "coordinator.microbatch_parts=false"),
            2,
            "parallel.expert_parallel=2 must be at most DP/2=1 with coordinator.enabled and DP ranks as the noise "
            "probe's parts",
        ),
        (  # one EP group: each rank needs two runs of micro-batches for two expert parts
            _moe(*_COORD_EP2, "rollout.num_prompts=2"),
            2,
            "rollout.num_prompts×samples_per_prompt=8 must be >= 2 × parallel.micro_batch_size=4 × "
            "algo.mini_batches=1 × EP=2 = 16 with coordinator.enabled at DP = EP = 2",
        ),
        # vLLM's CPU fused-MoE kernel needs hidden % 32 == 0 (kv_channels 32: a head size CPU attention runs)
        (_moe("model.hidden_size=144", "model.kv_channels=32"), 1, "model.hidden_size=144 is not a multiple of 32"),
    ],
)
def test_moe_layout_rules_name_the_field(sets: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, sets), world)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("ep", [1, 2])
def test_a_valid_moe_layout_trains(ep: int, arch: str) -> None:
    """MoE runs are accepted since the engines' experts are synced pre-packed (megarl.engine.experts),
    while the MoE rules still apply to the very same layout."""
    cfg = load_config(None, _moe(f"parallel.expert_parallel={ep}", arch=arch))
    assert (cfg.model.arch, cfg.model.num_experts, cfg.parallel.expert_parallel) == (arch, 4, ep)
    assert validate(cfg, 2) is None  # (a refusal raises ConfigError)
    broken = _moe(f"parallel.expert_parallel={ep}", "model.hidden_size=144", "model.kv_channels=32", arch=arch)
    with pytest.raises(ConfigError, match=re.escape("model.hidden_size=144 is not a multiple of 32")):
        validate(load_config(None, broken), 2)


_SP = ("parallel.tensor_parallel=2", "parallel.sequence_parallel=true")
_TP4 = ("parallel.tensor_parallel=4", "model.num_query_groups=4", "parallel.sequence_parallel=true")


@pytest.mark.parametrize(
    ("sets", "world", "message"),
    [
        (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel=True splits the sequence over TP ranks: "
         "needs parallel.tensor_parallel > 1"),
        (_moe(*_SP, "algo.router_replay=trainer"), 2, "algo.router_replay='trainer' with parallel.sequence_parallel"),
        (_moe(*_SP, "parallel.expert_tensor_parallel=3"), 2, "parallel.expert_tensor_parallel=3 must be 0 "
         "(= parallel.tensor_parallel) or divide parallel.tensor_parallel=2"),
        (_moe(*_TP4, "parallel.expert_tensor_parallel=3"), 4,
         "parallel.expert_tensor_parallel=3 must be 0 (= parallel.tensor_parallel) or divide parallel.tensor_parallel=4"),
        (_moe(*_TP4, "parallel.expert_tensor_parallel=2", "algo.name=ppo", "algo.advantage=gae",
              "critic.parallel.tensor_parallel=1"), 4,
         "parallel.expert_tensor_parallel=2 differs from parallel.tensor_parallel=4 with a critic on its own layout"),
        (_moe(*_SP, "parallel.expert_tensor_parallel=1", "algo.name=ppo", "algo.advantage=gae",
              "critic.parallel.tensor_parallel=1"), 2,
         "parallel.expert_tensor_parallel=1 differs from parallel.tensor_parallel=2 with a critic on its own layout"),
        ([*_SP, "coordinator.enabled=true"], 2, "parallel.sequence_parallel=True with coordinator.enabled: its grad "
         "probe reads gradients before the TP sum"),
        (_moe("algo.name=ppo", "algo.advantage=gae", "critic.parallel.tensor_parallel=2"), 2,
         "parallel.sequence_parallel=False with a mixture-of-experts model at critic.parallel.tensor_parallel=2"),
    ],
)  # fmt: skip
def test_sequence_parallel_rules_name_the_field(sets: list[str], world: int, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, sets), world)


@pytest.mark.parametrize(
    ("sets", "world"),
    [
        (_moe(*_SP), 2),
        (_moe(*_SP, "parallel.expert_parallel=2", "parallel.expert_tensor_parallel=2"), 4),
        (_moe(*_SP, "parallel.expert_tensor_parallel=1"), 2),
        (_moe(*_SP, "parallel.expert_parallel=2", "parallel.expert_tensor_parallel=1"), 4),
        (_moe(*_TP4, "parallel.expert_tensor_parallel=2"), 4),
        (_moe(*_TP4, "parallel.expert_tensor_parallel=2", "parallel.expert_parallel=2"), 8),
        (_SP, 2),
    ],
)
def test_sequence_parallel_layouts_validate(sets: tuple[str, ...], world: int) -> None:
    """MoE at TP 2 (and TP 2 × EP 2) with sequence parallelism, and a dense model with it; the
    critic's own TP-1 layout runs without it (megatron refuses SP at TP 1)."""
    cfg = load_config(None, list(sets))
    assert validate(cfg, world) is None and cfg.parallel.sequence_parallel
    assert not cfg.parallel.critic(1, 1, world).sequence_parallel
    assert cfg.parallel.critic(2, 1, world // 2).sequence_parallel
    # the critic's own TP builds its experts split over that TP; at the actor's TP, the actor's expert TP
    assert cfg.parallel.critic(1, 1, world).expert_tp == 1
    assert cfg.parallel.critic(2, 1, world // 2).expert_tp == cfg.parallel.expert_tp


def test_the_coordinator_measures_an_ep2_layout_from_two_expert_parts() -> None:
    """DP = EP = 2 with micro-batch parts: 16 responses give each rank two runs of 4, so two
    expert parts (the EP group's unions); the planner's smallest batch says the same."""
    from megarl.planning import Planner, PlanSettings

    cfg = load_config(None, _moe(*_COORD_EP2, "rollout.num_prompts=4"))
    assert validate(cfg, 2) is None
    planner = Planner(PlanSettings.of(cfg), dp=2, models=["actor"])
    assert planner.coord is not None
    assert (planner.coord.run.min_batch, planner.coord.run.equal_shares) == (16, True)


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["algo.router_replay=trainer"],
            "algo.router_replay='trainer' needs a mixture-of-experts model; model.arch=llama",
        ),
        (["algo.router_replay=rollout"], "algo.router_replay='rollout' needs a mixture-of-experts model"),
        (["algo.router_replay=always"], "algo.router_replay='always' must be one of ['off', 'trainer', 'rollout']"),
        # the engines' routes need vLLM's V2 model runner: GPU only
        (
            _moe("algo.router_replay=rollout"),
            "algo.router_replay='rollout' needs the engines' routes (vLLM's V2 runner, GPU only), not on CPU; use trainer",
        ),
    ],
)
def test_router_replay_rules_name_the_field(sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config(None, sets), 1)


def test_router_replay_trainer_is_accepted_for_moe() -> None:
    cfg = load_config(None, _moe("algo.router_replay=trainer"))
    assert cfg.algo.router_replay == "trainer" and validate(cfg, 1) is None
    assert load_config(None, _moe()).algo.router_replay == "off"


def test_router_replay_rollout_is_refused_with_episodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a GPU the engines' routes are accepted for single-turn samples; multi-turn episodes
    (each turn a request of its own) are refused naming the field."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    cfg = load_config(None, _moe("algo.router_replay=rollout"))
    assert validate(cfg, 1) is None
    cfg = load_config(None, _moe("algo.router_replay=rollout", "env.agent=pkg.mod:fn"))
    with pytest.raises(ConfigError, match=re.escape("algo.router_replay='rollout' takes single-turn samples' routes")):
        validate(cfg, 1)
