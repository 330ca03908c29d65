"""What the DPO parity tests and ``benchmarks/dpo_throughput.py`` both build: tiny models, preference rows, TRL's
``DPOTrainer`` beside ``PaddingFreeDPOTrainer`` from the same config fields, and the comparison of one step."""

from __future__ import annotations

import random

import datasets
import torch

TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
WORDS = ("the a cat dog runs sleeps quickly blue green red house tree over under with and because never always one "
         "two three small large river stone light dark").split()
# loss and metrics: float32 rounding of sums over ~100 tokens; gradients: relative to each tensor's largest entry
RTOL, ATOL, GRAD_RTOL = 2e-5, 2e-6, 1e-4


def model(arch: str = "llama", seed: int = 0):
    from pf_trl.models import build_model

    if arch == "llama":
        return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=seed, **TINY)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, vocab_size=32000, max_position_embeddings=512, **TINY)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def pairs(n: int, *, seed: int = 0, long: int = 20) -> list[dict]:
    rng = random.Random(seed)

    def text(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [dict(prompt=text(rng.randint(3, 12)), chosen=text(rng.randint(2, long)),
                 rejected=text(rng.randint(2, long))) for _ in range(n)]


def fields(tmp_path, **kw) -> dict:
    base = dict(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                dataloader_num_workers=0, disable_tqdm=True, logging_steps=1, learning_rate=1e-3)
    base.update(kw)
    return base


def trainer(cls, rows, tmp_path, *, arch="llama", ref=True, eval_rows=None, peft_config=None, model_obj=None, **kw):
    """``cls`` (TRL's DPOTrainer or PaddingFreeDPOTrainer) on ``rows``, with a DPOConfig of ``fields``; ``ref``: a
    separate reference model (seed 1) or TRL's default (None)."""
    from trl import DPOConfig

    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig

    pf_keys = {"max_tokens_per_batch", "padding_free_mode", "attention_backend"}
    config_cls = PaddingFreeDPOConfig if pf_keys & set(kw) else DPOConfig
    args = config_cls(**fields(tmp_path / cls.__name__, **kw))
    return cls(model_obj if model_obj is not None else model(arch), ref_model=model(arch, seed=1) if ref else None,
               args=args, train_dataset=datasets.Dataset.from_list(rows),
               eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
               processing_class=load_tokenizer(), peft_config=peft_config)


def one_step(t, indices, *, mutate=None, backward=True):
    """Loss, metrics and gradients (``backward``) of one micro-batch of ``indices`` (TRL's order) through
    ``compute_loss``."""
    batch = t.data_collator([t.train_dataset[i] for i in indices])
    if mutate is not None:
        mutate(batch)
    t.model.train()
    t.model.zero_grad()
    for values in t._metrics["train"].values():
        values.clear()
    t._total_train_tokens = 0  # TRL's num_tokens counts on from earlier steps
    with torch.set_grad_enabled(backward):
        loss = t.compute_loss(t.model, batch)
    if backward:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in t._metrics["train"].items() if v}
    return float(loss.detach()), metrics, grads


def differences(a, b) -> list[str]:
    """What differs between two ``one_step`` results beyond float32 rounding (empty: equal)."""
    (la, ma, ga), (lb, mb, gb) = a, b
    bad = []
    if abs(la - lb) > ATOL + RTOL * abs(la):
        bad.append(f"loss {la} != {lb}")
    for key in sorted(set(ma) | set(mb)):
        x, y = ma.get(key), mb.get(key)
        if x is None or y is None or abs(x - y) > ATOL + RTOL * abs(x):
            bad.append(f"{key} {x} != {y}")
    if set(ga) != set(gb):
        bad.append(f"gradient names differ: {sorted(set(ga) ^ set(gb))}")
    for name in ga.keys() & gb.keys():
        scale = float(ga[name].abs().max())
        if float((ga[name] - gb[name]).abs().max()) > GRAD_RTOL * scale + 1e-9:
            bad.append(f"grad {name}")
    return bad
