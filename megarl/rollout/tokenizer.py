"""SentencePiece tokenizer: trained locally on the task corpus (there is no model hub here).

Ids 0..3 are fixed: pad=0, bos=1, eos=2, unk=3. Digits are split into single pieces, so
arithmetic answers tokenize one digit per token.
"""

from __future__ import annotations

import io
from pathlib import Path

PAD, BOS, EOS, UNK = 0, 1, 2, 3


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

    pad_id, bos_id, eos_id = PAD, BOS, EOS

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = list(self.sp.encode(text))
        return [BOS, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        return str(self.sp.decode([i for i in ids if i > UNK]))


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
