"""What the TRL parity tests and ``benchmarks/trl_parity.py`` both build: a one-layer tiny Llama, tokenized rows with
a prompt prefix, and TRL's padded ``SFTTrainer`` beside ``PaddingFreeSFTTrainer`` from the same config fields.

Rows of random token ids need no 32,000-row head: tests on them pass ``vocab_size=SMALL_VOCAB`` (to ``rows`` and to
the trainers alike), which keeps every comparison and cuts the logits (and TRL's entropy over them) 30-fold. Rows of
text keep the shipped tokenizer's vocabulary (the default).
"""

from __future__ import annotations

import random

import datasets

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
LENGTHS = [64, 90, 70, 66, 81, 70, 60]
PROMPTS = [10, 10, 10, 10, 10, 10, 50]  # the last row is all prompt in its first 40 tokens
TOKENIZER_VOCAB = 32000  # the shipped tokenizer's
SMALL_VOCAB = 1024
# tokenizer settings that TRL and pf-trl write onto the tokenizer they are given: a trainer with one gets its own
_TOKENIZER_WRITERS = ("eos_token", "pad_token", "chat_template_path")
_shared_tokenizer = None


def tokenizer(fresh: bool = False):
    """The shipped tokenizer, loaded once per process (parsing its 32,000-token vocabulary costs ~0.4 s of CPU a
    time); ``fresh`` loads a copy of its own for a trainer that writes onto it."""
    global _shared_tokenizer
    from pf_trl.data.tokenizer import load_tokenizer

    if fresh:
        return load_tokenizer()
    if _shared_tokenizer is None:
        _shared_tokenizer = load_tokenizer()
    return _shared_tokenizer


def model(seed=0, vocab_size=TOKENIZER_VOCAB):
    from pf_trl.models import build_model

    return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=seed, vocab_size=vocab_size, **TINY)


def rows(lengths=LENGTHS, prompts=PROMPTS, *, seed=0, labels=True, mask_column=None, vocab_size=TOKENIZER_VOCAB):
    rng = random.Random(seed)
    out = []
    for n, p in zip(lengths, prompts):
        ids = [1] + [rng.randrange(3, vocab_size) for _ in range(n - 1)]
        row = {"input_ids": ids}
        if labels:
            row["labels"] = [-100] * p + ids[p:]
        if mask_column:
            row[mask_column] = [0] * p + [1] * (n - p)
        out.append(row)
    return out


def fields(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                dataloader_num_workers=0, disable_tqdm=True, logging_steps=1, learning_rate=1e-2)
    base.update(kw)
    return base


def trl_trainer(train, tmp_path, eval_rows=None, *, vocab_size=TOKENIZER_VOCAB, **kw):
    from trl import SFTConfig, SFTTrainer

    return SFTTrainer(model(vocab_size=vocab_size), args=SFTConfig(**fields(tmp_path / "trl", **kw)),
                      train_dataset=datasets.Dataset.from_list(train),
                      eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
                      processing_class=tokenizer(fresh=any(k in kw for k in _TOKENIZER_WRITERS)))


def pf_trainer(train, tmp_path, eval_rows=None, *, sft_config=False, vocab_size=TOKENIZER_VOCAB, **kw):
    from trl import SFTConfig

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = SFTConfig(**fields(tmp_path / "pf", **kw)) if sft_config else PaddingFreeConfig(
        **fields(tmp_path / "pf", padding_free_mode="huggingface", **kw))
    return PaddingFreeSFTTrainer(model(vocab_size=vocab_size), args=args,
                                 train_dataset=datasets.Dataset.from_list(train),
                                 eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
                                 processing_class=tokenizer(fresh=any(k in kw for k in _TOKENIZER_WRITERS)))
