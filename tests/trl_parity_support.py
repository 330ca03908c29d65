"""What the TRL parity tests and ``benchmarks/trl_parity.py`` both build: a one-layer tiny Llama, tokenized rows with
a prompt prefix, and TRL's padded ``SFTTrainer`` beside ``PaddingFreeSFTTrainer`` from the same config fields."""

from __future__ import annotations

import random

import datasets

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
LENGTHS = [64, 90, 70, 66, 81, 70, 60]
PROMPTS = [10, 10, 10, 10, 10, 10, 50]  # the last row is all prompt in its first 40 tokens


def model(seed=0):
    from pf_trl.models import build_model

    return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=seed, **TINY)


def rows(lengths=LENGTHS, prompts=PROMPTS, *, seed=0, labels=True, mask_column=None):
    rng = random.Random(seed)
    out = []
    for n, p in zip(lengths, prompts):
        ids = [1] + [rng.randrange(3, 32000) for _ in range(n - 1)]
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


def trl_trainer(train, tmp_path, eval_rows=None, **kw):
    from trl import SFTConfig, SFTTrainer

    from pf_trl.data.tokenizer import load_tokenizer

    return SFTTrainer(model(), args=SFTConfig(**fields(tmp_path / "trl", **kw)),
                      train_dataset=datasets.Dataset.from_list(train),
                      eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
                      processing_class=load_tokenizer())


def pf_trainer(train, tmp_path, eval_rows=None, *, sft_config=False, **kw):
    from trl import SFTConfig

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = SFTConfig(**fields(tmp_path / "pf", **kw)) if sft_config else PaddingFreeConfig(
        **fields(tmp_path / "pf", padding_free_mode="huggingface", **kw))
    return PaddingFreeSFTTrainer(model(), args=args, train_dataset=datasets.Dataset.from_list(train),
                                 eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
                                 processing_class=load_tokenizer())
