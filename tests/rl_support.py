"""What the GRPO/RLOO parity tests and ``benchmarks/grpo_throughput.py`` both build: a tiny Llama saved with the
shipped tokenizer (TRL builds the reference model from the policy's folder), prompts, a reward function, TRL's
trainer beside pf-trl's from the same config fields, and the comparison of logged metrics."""

from __future__ import annotations

import contextlib
import functools
import gc
import random
from collections.abc import Iterator
from pathlib import Path

import datasets
import torch

# initializer_range 0.2: a model whose outputs depend on positions and context clearly (the default 0.02 leaves a
# 2-layer model near uniform, where a wrong position moves a log-probability by only ~1e-4 of its value)
TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            initializer_range=0.2)
WORDS = ("the a cat dog runs sleeps quickly blue green red house tree over under with and because never always one "
         "two three small large river stone light dark").split()
# timings and counters that differ between any two runs
_TIMES = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos")


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """While open, the objects that exist now are left out of garbage collection: every ``train()`` ends in
    accelerate's ``free_memory()``, a full ``gc.collect()`` that otherwise walks everything the test process holds
    (transformers, TRL, datasets: 0.5-1 s a run). They are handed back to the collector after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@functools.cache
def tokenizer(folder: str | None = None):
    """The shipped tokenizer (from ``folder`` when given), loaded once per process: parsing its 32,000-token
    vocabulary takes ~1.5 s, and the trainers of one test module all set it up alike (TRL sets its pad token)."""
    from pf_trl.data.tokenizer import load_tokenizer

    return load_tokenizer(folder) if folder else load_tokenizer()


def model_folder(root: Path, *, seed: int = 0, **overrides) -> str:
    """A tiny Llama (sdpa, float32) and the shipped tokenizer saved in ``root``; returns the folder."""
    from pf_trl.models import build_model

    folder = root / f"tiny-llama-{seed}"
    if not (folder / "config.json").exists():
        build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=seed, **{**TINY, **overrides}
                    ).save_pretrained(folder)
        tokenizer().save_pretrained(folder)
    return str(folder)


def prompts(n: int, *, seed: int = 0, equal: bool = False, words: tuple[int, int] = (2, 12)) -> datasets.Dataset:
    """``n`` prompts of random words; ``equal``: every prompt has the same number of tokens."""
    rng = random.Random(seed)
    tok = tokenizer()
    rows = []
    while len(rows) < n:
        text = " ".join(rng.choice(WORDS) for _ in range(words[1] if equal else rng.randint(*words)))
        if equal and rows and len(tok(text)["input_ids"]) != len(tok(rows[0]["prompt"])["input_ids"]):
            continue
        rows.append({"prompt": text})
    return datasets.Dataset.from_list(rows)


def reward_length(completions, **kwargs) -> list[float]:
    """A simple verifiable reward: longer completions (in characters) score higher, capped at 40."""
    return [min(len(c), 40) / 40.0 for c in completions]


def config_fields(tmp_path, **kw) -> dict:
    base = dict(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                dataloader_num_workers=0, disable_tqdm=True, logging_steps=1, learning_rate=1e-2,
                per_device_train_batch_size=4, num_generations=2, max_completion_length=8, beta=0.1, max_steps=2,
                temperature=0.9)
    base.update(kw)
    return base


def trainer(cls, config_cls, folder: str, dataset, tmp_path, **kw):
    args = config_cls(**config_fields(tmp_path / cls.__name__, **kw))
    return cls(model=folder, reward_funcs=reward_length, args=args, train_dataset=dataset,
               processing_class=tokenizer(folder))


def logged(history: list[dict]) -> list[dict]:
    """Every logged value but timings."""
    return [{k: v for k, v in h.items() if k not in _TIMES} for h in history]


def compare_logs(a: list[dict], b: list[dict], rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """What differs between two :func:`logged` histories beyond float32 rounding."""
    bad = []
    if len(a) != len(b):
        return [f"{len(a)} log entries vs {len(b)}"]
    for step, (x, y) in enumerate(zip(a, b)):
        if set(x) != set(y):
            bad.append(f"step {step} keys differ: {sorted(set(x) ^ set(y))}")
        for key in x.keys() & y.keys():
            if isinstance(x[key], (int, float)) and abs(x[key] - y[key]) > atol + rtol * abs(x[key]):
                bad.append(f"step {step} {key}: {x[key]} vs {y[key]}")
    return bad


def parameters(t) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}
