"""The ``data`` section: where prompts come from (built-in task, JSONL, Parquet, datasets
folder), their fields and chat template. Its rows are read and measured before the run
starts by :func:`megarl.prelaunch.check_data`, not here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class DataConfig:
    source: str = "builtin:arithmetic"
    """'builtin:arithmetic' (a+b, a-b), 'builtin:multiply' (a*b, the agents example), a
    .jsonl/.parquet file or an HF datasets save_to_disk folder (or several, comma-separated)."""
    prompt_key: str = "prompt"
    """Field holding the prompt text in file rows."""
    messages_key: str = "messages"
    """Field holding OpenAI-style chat turns ([{role, content}]); used instead of the prompt."""
    chat_template: str = "auto"
    """'auto' (the HF tokenizer's own template: applied to chat rows and to plain prompts as one
    user turn), 'none' (plain prompts as raw text), or a Jinja template file."""
    system_prompt: str = ""
    """System turn put first in every templated prompt that has none ('' = none)."""
    answer_key: str = "answer"
    """Field holding the reference answer in file rows."""
    num_train: int = 20000
    """Built-in task: training prompts generated."""
    num_val: int = 128
    """Validation prompts (built-in: generated; files: the last rows)."""
    max_operand: int = 50
    """Built-in tasks: arithmetic draws operands from [0, max_operand), multiply from
    [max_operand // 10, max_operand)."""
    overlong_prompt: Literal["skip", "truncate"] = "skip"
    """What to do with a prompt longer than rollout.max_prompt_len (always counted)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded, resumable)."""
    seed: int = 1234
    """Seed of the built-in task's data (and so of its tokenizer); separate from train.seed."""
    reward: str = ""
    """Deprecated alias of ``reward.fn`` (one built-in name); use the ``reward`` section."""
