"""What ``megarl train`` checks before any process group or engine starts, beyond the config's
own rules (:func:`megarl.config.validate`): each reward and the environment class are imported and
their signatures checked (:func:`check_run`), and every data row is read and measured with the run's own tokenizer
(:func:`check_data`). (The launcher then picks the checkpoint to resume,
``megarl.checkpoint.integrity.choose_resume``.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from megarl.config import RunConfig, validate
from megarl.data.hf_tokenizer import open_tokenizer
from megarl.data.prompts import load_prompts
from megarl.errors import ConfigError, DataError
from megarl.rewards.env_spec import import_env
from megarl.rewards.specs import check_reward_config
from megarl.rollout.demonstrations import tokenizer_texts


def check_run(cfg: RunConfig, world_size: int) -> None:
    """Raise ConfigError naming the setting; nothing is started."""
    validate(cfg, world_size)
    check_reward_config(cfg)  # imports each reward and checks its signature
    checks: list[tuple[str, str, Callable[[str], Any]]] = [("env.fn", cfg.env.fn, import_env)]
    if cfg.env.agent:  # (its endpoint imports torch: the launcher stays torch-free without an agent)
        from megarl.rewards.agent import import_agent

        checks.append(("env.agent", cfg.env.agent, import_agent))
    for setting, spec, load in checks:
        if spec:  # the environment class or agent function: imported, its signature checked
            try:
                load(spec)
            except (Exception, SystemExit) as e:  # the user's import-time error too, named
                raise ConfigError(f"{setting}={spec!r} {e}") from e


def check_data(cfg: RunConfig) -> dict[str, int]:
    """Launcher pre-check: read and validate every row, count them, and check that prompts fit
    ``rollout.max_prompt_len`` under the run's tokenizer (trained here into
    ``train.run_dir/tokenizer`` exactly as the trainer would, or the one already there).
    Raises :class:`DataError`; returns row counts for the log."""
    try:  # the first thing written there (the tokenizer, logs, checkpoints)
        Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.run_dir={cfg.train.run_dir!r} cannot be created: {e.strerror or e}") from None
    train, val = load_prompts(cfg.data, cfg.data.seed)
    tok = open_tokenizer(cfg, tokenizer_texts(cfg.env.fn, train), train=True)
    limit, mode = cfg.rollout.max_prompt_len, cfg.data.overlong_prompt
    counts = {"train_rows": len(train), "val_rows": len(val)}
    for split, rows in (("train", train), ("validation", val)):
        lengths = [len(tok.encode_prompt(r)) for r in rows]
        overlong = sum(n > limit for n in lengths)
        counts[f"{split}_overlong"] = overlong
        if rows and overlong == len(rows) and mode == "skip":
            i = min(range(len(rows)), key=lengths.__getitem__)
            raise DataError(
                f"data.source={cfg.data.source}: no {split} prompt fits rollout.max_prompt_len={limit} tokens "
                f"(shortest: {lengths[i]} tokens, at {rows[i].where}); raise rollout.max_prompt_len "
                "or set data.overlong_prompt=truncate"
            )
    return counts
