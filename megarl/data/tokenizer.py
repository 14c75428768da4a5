"""Tokenizers: the interface the trainer uses, and the built-in SentencePiece one (the demo).

:class:`PromptTokenizer` is what rollouts, the warm start and exports need; it has two
implementations: :class:`Tokenizer` here (``model.tokenizer: builtin``, trained locally on
the task corpus) and ``megarl.data.hf_tokenizer.HFTokenizer`` (the model folder's own).

Built-in ids 0..3 are fixed: pad=0, bos=1, eos=2, unk=3. Digits are split into single
pieces, so arithmetic answers tokenize one digit per token.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from megarl.data.prompts import PromptRecord

PAD, BOS, EOS, UNK = 0, 1, 2, 3


class PromptTokenizer(Protocol):
    eos_id: int
    """Appended after a supervised answer; the first of ``eos_ids``."""
    eos_ids: list[int]
    """Every id generation stops on (engines and trainer use the same list)."""
    pad_id: int
    """Right padding (always under loss mask 0)."""
    bos_id: int | None
    config_ids: tuple[Any, Any, Any]
    """(eos, bos, pad) for an exported ``config.json``."""

    @property
    def vocab_size(self) -> int: ...

    def encode_prompt(self, rec: PromptRecord) -> list[int]:
        """The ids of a row's prompt, as sent to the engines."""
        ...

    def encode_answer(self, rec: PromptRecord) -> list[int]:
        """The row's reference answer as a continuation of its prompt, ending with EOS."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of response ids, special tokens stripped."""
        ...

    def decode_many(self, batch: list[list[int]]) -> list[str]:
        """``[decode(ids) for ids in batch]`` in one call."""
        ...

    def files(self) -> list[Path]:
        """Tokenizer files to copy into checkpoints and HF exports, unchanged."""
        ...


class Tokenizer:
    def __init__(self, model_file: str | Path) -> None:
        import sentencepiece as spm

        self.path = Path(model_file)
        if not self.path.exists():
            raise FileNotFoundError(f"tokenizer model {self.path} not found")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        if (self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id()) != (PAD, BOS, EOS):
            raise ValueError(f"{self.path}: expected pad/bos/eos ids 0/1/2")

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    pad_id, eos_id = PAD, EOS
    bos_id: int | None = BOS
    eos_ids = [EOS]
    config_ids = (EOS, BOS, PAD)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = list(self.sp.encode(text))
        return [BOS, *ids] if bos else ids

    def encode_prompt(self, rec: PromptRecord) -> list[int]:
        if rec.messages is not None:
            from megarl.errors import RolloutError

            raise RolloutError(f"{rec.where}: chat rows (messages) need model.tokenizer=hf and a chat template")
        return self.encode(rec.prompt)

    def encode_answer(self, rec: PromptRecord) -> list[int]:
        return [*self.encode(rec.answer, bos=False), EOS]

    def files(self) -> list[Path]:
        return [self.path]

    def decode(self, ids: list[int]) -> str:
        return str(self.sp.decode([i for i in ids if i > UNK]))

    def decode_many(self, batch: list[list[int]]) -> list[str]:
        """One SentencePiece call for a whole round's responses (half the time of one call each)."""
        if not batch:  # (SentencePiece reads [] as one empty sequence: it would answer '')
            return []
        return [str(t) for t in self.sp.decode([[i for i in ids if i > UNK] for ids in batch])]


def train_tokenizer(texts: list[str], out_dir: str | Path, vocab_size: int = 48) -> Tokenizer:
    """Train a small BPE SentencePiece model on ``texts``; deterministic for the same input."""
    import sentencepiece as spm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        split_digits=True,
        add_dummy_prefix=False,
        pad_id=PAD,
        bos_id=BOS,
        eos_id=EOS,
        unk_id=UNK,
        hard_vocab_limit=False,
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    tmp = out / "tokenizer.model.tmp"
    tmp.write_bytes(buf.getvalue())
    tmp.replace(out / "tokenizer.model")
    return Tokenizer(out / "tokenizer.model")


def is_builtin_model(model_file: str | Path) -> bool:
    """Whether ``model_file`` is a SentencePiece model with megarl's fixed ids (pad/bos/eos 0/1/2)."""
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(model_file))
    except (OSError, RuntimeError):
        return False
    return (sp.pad_id(), sp.bos_id(), sp.eos_id()) == (PAD, BOS, EOS)


def export_tokenizer_files(files: list[Path], out_dir: Path) -> None:
    """Copy a run's tokenizer files into an HF export, unchanged; a built-in SentencePiece
    model among them (and no ``tokenizer.json``) also gets the files transformers and vLLM
    read it by (:func:`write_hf_tokenizer`)."""
    import shutil

    for f in files:
        shutil.copyfile(f, out_dir / f.name)
    spm = out_dir / "tokenizer.model"
    if spm.is_file() and not (out_dir / "tokenizer.json").is_file() and is_builtin_model(spm):
        write_hf_tokenizer(spm, out_dir)


def write_hf_tokenizer(model_file: str | Path, out_dir: str | Path) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` in ``out_dir`` that encode and decode as
    :class:`Tokenizer` does (BOS first, SentencePiece's whitespace rules), so a megarl export
    opens in transformers and vLLM (and as ``model.tokenizer: auto``) with the ids it was
    trained on. transformers' own conversion of a bare ``tokenizer.model`` drops the BOS."""
    from tokenizers import Regex, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as FastTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    ex = SentencePieceExtractor(str(model_file))
    spec = ex.proto.normalizer_spec
    if ex.proto.trainer_spec.model_type != 2:  # BPE
        raise ValueError(f"{model_file}: only megarl's BPE SentencePiece models convert")
    parts: dict[str, Any] = ex.extract(models.BPE)  # type: ignore[assignment]  # (stubs say a tuple)
    fast = FastTokenizer(models.BPE(parts["vocab"], parts["merges"], unk_token="<unk>", fuse_unk=True))
    steps: list[normalizers.Normalizer] = (
        [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    )
    if spec.remove_extra_whitespaces:  # SentencePiece: runs of spaces collapse, ends are trimmed
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip()]
    if spec.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    fast.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    fast.decoder = decoders.Metaspace(
        replacement="▁", prepend_scheme="always", split=False
    )  # as SentencePiece: the first piece loses its leading space
    fast.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=fast, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    hf.save_pretrained(str(out_dir))
