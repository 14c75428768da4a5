"""Prompt data: sources (``prompts``: JSONL, Parquet, the built-in tasks, the resumable
sampler; ``saved_dataset``: HF ``save_to_disk`` folders), tokenizers (``tokenizer``: the
PromptTokenizer interface and the built-in SentencePiece one; ``hf_tokenizer``: the model
folder's own, with its chat template).
"""
