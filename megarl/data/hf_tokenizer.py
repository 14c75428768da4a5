"""The model folder's own tokenizer (``model.tokenizer: hf``): transformers' AutoTokenizer,
its chat template, and the special ids of ``generation_config.json``.

Invariants the rest of megarl relies on:

* ``encode_prompt(row)`` is exactly ``apply_chat_template(messages, add_generation_prompt=True)``
  for a chat row (plain-prompt rows become one user message when a template is in use), so
  the ids sent to vLLM are the ids the model was tuned on;
* ``eos_ids`` is every id generation must stop on (the tokenizer's EOS, then the
  ``eos_token_id`` of ``generation_config.json`` and ``config.json``, which may be lists);
  the engines stop on this list and responses end with one of these ids;
* ``pad_id`` is only ever placed where the loss mask is 0 (right padding); a tokenizer
  without a pad token pads with its first EOS id, which is safe for that reason;
* ``files()`` are the source folder's tokenizer files, copied unchanged into checkpoints and
  HF exports, so an export loads in transformers and vLLM like the model it came from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, cast

from megarl.data.prompts import PromptRecord, RolloutError

log = logging.getLogger("megarl")

HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
"""Files of an HF tokenizer folder (whichever exist), copied verbatim on export."""
GENERATION_CONFIG = "generation_config.json"


def has_hf_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` holds a transformers tokenizer (fast or SentencePiece)."""
    f = Path(folder)
    return any((f / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def has_fast_tokenizer(folder: str | Path) -> bool:
    """Whether ``folder`` describes its tokenizer for transformers (not a bare ``tokenizer.model``)."""
    f = Path(folder)
    return (f / "tokenizer.json").is_file() or (f / "tokenizer_config.json").is_file()


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class HFTokenizer:
    """AutoTokenizer of ``folder`` + chat template policy (``data.chat_template``, system prompt)."""

    def __init__(self, folder: str | Path, chat_template: str = "auto", system_prompt: str = "") -> None:
        from transformers import AutoTokenizer

        from megarl.errors import ConfigError

        self.folder = Path(folder)
        if not has_hf_tokenizer(self.folder):
            raise ConfigError(
                f"model.tokenizer: {self.folder} has no tokenizer.json, tokenizer.model or tokenizer_config.json"
                + ("" if self.folder.is_dir() else " (no such folder)")
            )
        self.hf = AutoTokenizer.from_pretrained(str(self.folder))
        self.system_prompt = system_prompt
        self.template: str | None
        self.template_source = f"the chat template of {self.folder}"
        """Where ``template`` came from, as error messages name it."""
        if chat_template == "none":
            self.template = None
        elif chat_template == "auto":
            self.template = self.hf.chat_template if isinstance(self.hf.chat_template, str) else None
        else:
            path = Path(chat_template)
            if not path.is_file():
                raise ConfigError(f"data.chat_template={chat_template}: no such file (or use auto/none)")
            self.template = path.read_text()
            self.template_source = f"the chat template data.chat_template={chat_template}"
        gen = self._json(GENERATION_CONFIG)
        model = self._json("config.json")
        eos: list[int] = []
        for v in (self.hf.eos_token_id, gen.get("eos_token_id"), model.get("eos_token_id")):
            eos += [i for i in _ids(v) if i not in eos]
        if not eos:
            raise RolloutError(
                f"{self.folder}: no EOS id in the tokenizer, {GENERATION_CONFIG} or config.json "
                "(generation could never stop)"
            )
        self.eos_ids = eos
        self.eos_id = eos[0]
        """The id appended after a supervised answer (the tokenizer's own EOS when it has one)."""
        bos = self.hf.bos_token_id if self.hf.bos_token_id is not None else gen.get("bos_token_id")
        self.bos_id: int | None = None if bos is None else int(bos)
        pad = self.hf.pad_token_id if self.hf.pad_token_id is not None else gen.get("pad_token_id")
        self.pad_id = int(pad) if pad is not None else self.eos_id
        """Right padding only (loss mask 0 there); the first EOS when the model has no pad token."""
        self.config_ids = (model.get("eos_token_id", eos[0]), model.get("bos_token_id", bos), model.get("pad_token_id"))
        """(eos, bos, pad) as the source ``config.json`` states them, for the exported config."""

    def _json(self, name: str) -> dict[str, Any]:
        from megarl.errors import ConfigError

        p = self.folder / name
        if not p.is_file():
            return {}
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: must hold a JSON object, got {type(data).__name__}")
        return data

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce (base vocabulary + added tokens)."""
        return len(self.hf)

    def messages(self, rec: PromptRecord) -> list[dict[str, Any]]:
        """The conversation of a row: its ``messages`` (or its prompt as one user turn), with
        the configured system prompt first unless the row brings its own."""
        msgs = list(rec.messages) if rec.messages is not None else [{"role": "user", "content": rec.prompt}]
        if self.system_prompt and not (msgs and msgs[0].get("role") == "system"):
            msgs = [{"role": "system", "content": self.system_prompt}, *msgs]
        return msgs

    def encode_prompt(self, rec: PromptRecord) -> list[int]:
        """Prompt ids for a row: the chat template with the generation prompt, or the plain
        text with the tokenizer's own special tokens (``data.chat_template: none``)."""
        if self.template is None:
            if rec.messages is not None:
                raise RolloutError(
                    f"{rec.where}: row has messages but no chat template is in use "
                    f"({self.folder} has none, or data.chat_template=none)"
                )
            return list(self.hf(rec.prompt, add_special_tokens=True)["input_ids"])
        ids = self._render(rec, self.messages(rec), add_generation_prompt=True, tokenize=True)
        return [int(i) for i in cast("list[int]", ids)]

    def _render(self, rec: PromptRecord, messages: list[dict[str, Any]], **kw: Any) -> Any:
        """``apply_chat_template``; a template that raises on this row (many refuse a system turn
        or turns that do not alternate) names the row."""
        try:
            return self.hf.apply_chat_template(messages, chat_template=self.template, return_dict=False, **kw)
        except Exception as e:  # jinja2's TemplateError (raise_exception) and whatever a template trips on
            from megarl.data.prompts import DataError

            roles = [m.get("role") for m in messages]
            raise DataError(
                f"{rec.where}: {self.template_source} refused this row's turns {roles}: {type(e).__name__}: {e}"
            ) from None

    def encode_answer(self, rec: PromptRecord) -> list[int]:
        """The reference answer as a continuation of the prompt, ending with EOS (warm start).

        With a chat template it is the assistant turn as the template writes it, up to and
        including its first stop id (e.g. ChatML's ``<|im_end|>``), so supervised targets
        end the way generation stops; a template whose prompt is not a prefix of the
        full conversation falls back to the answer's ids + ``eos_id``."""
        plain = [*self.hf(rec.answer, add_special_tokens=False)["input_ids"], self.eos_id]
        if self.template is None:
            return plain
        prompt = self.encode_prompt(rec)
        full = self._render(rec, [*self.messages(rec), {"role": "assistant", "content": rec.answer}], tokenize=True)
        ids = [int(i) for i in cast("list[int]", full)]
        if ids[: len(prompt)] != prompt:
            return plain
        tail = ids[len(prompt) :]
        stop = next((i for i, t in enumerate(tail) if t in self.eos_ids), None)
        return tail[: stop + 1] if stop is not None else [*tail, self.eos_id]

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=bos)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Response text with special tokens (EOS, chat markers) stripped."""
        return str(self.hf.decode(ids, skip_special_tokens=True))

    def decode_many(self, batch: list[list[int]]) -> list[str]:
        return [str(t) for t in self.hf.batch_decode(batch, skip_special_tokens=True)]

    def files(self) -> list[Path]:
        """The source folder's tokenizer files and generation config (copied unchanged on export)."""
        names = (*HF_TOKENIZER_FILES, GENERATION_CONFIG)
        return [self.folder / n for n in names if (self.folder / n).is_file()]


def open_tokenizer(cfg: Any, texts: list[str], train: bool) -> Any:
    """``model.tokenizer`` resolved: the HF folder's tokenizer (``hf``, a path, or ``auto`` with
    an ``init_from`` folder that has one), else the built-in SentencePiece model in
    ``train.run_dir/tokenizer``, trained on ``texts`` first when absent and ``train`` is set.
    The launcher's data check and the trainer both open the run's tokenizer through here."""
    from megarl.data.tokenizer import Tokenizer, is_builtin_model, train_tokenizer
    from megarl.errors import ConfigError

    m, d = cfg.model, cfg.data
    choice = m.tokenizer
    if choice == "auto":
        choice = "hf" if m.init_from and has_hf_tokenizer(m.init_from) else "builtin"
        spm = Path(m.init_from) / "tokenizer.model"
        if choice == "hf" and not has_fast_tokenizer(m.init_from) and is_builtin_model(spm):
            return Tokenizer(spm)  # an export of a built-in-tokenizer run from before tokenizer.json
        if choice == "builtin" and m.init_from and train:
            log.warning(
                "model.init_from=%s has no tokenizer files: model.tokenizer=auto uses the built-in SentencePiece "
                "tokenizer trained on the task's prompts, which a pretrained model does not know — point "
                "model.tokenizer at its tokenizer folder (or set model.tokenizer=builtin to say this is meant)",
                m.init_from,
            )
    if choice != "builtin":
        folder = m.init_from if choice == "hf" else choice
        if not folder:
            raise ConfigError("model.tokenizer=hf needs model.init_from (the HF folder holding the tokenizer)")
        return HFTokenizer(folder, d.chat_template, d.system_prompt)
    tdir = Path(cfg.train.run_dir) / "tokenizer"
    if train and not (tdir / "tokenizer.model").exists():
        try:
            return train_tokenizer(texts, tdir)
        except RuntimeError as e:  # sentencepiece: e.g. more distinct characters than its 48 pieces
            raise ConfigError(
                f"model.tokenizer={m.tokenizer!r}: the built-in tokenizer (48 pieces, for the arithmetic demo) "
                f"cannot be trained on these prompts ({str(e).splitlines()[-1].strip()}); give a tokenizer "
                "folder (model.tokenizer=PATH, or model.init_from with tokenizer files)"
            ) from None
    return Tokenizer(tdir / "tokenizer.model")
