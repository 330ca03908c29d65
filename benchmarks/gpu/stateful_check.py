"""GPU check of the stateful layers: the kernels path vs each example run alone, vs pf-trl's segments path.

    python benchmarks/gpu/stateful_check.py --out DIR [--dry-run]

For one tiny model per hybrid family (``pf_trl_dev.tiny``, float32), packed examples of uneven lengths:

- ``alone``: every example run by itself (eval, no cache): the reference;
- ``kernels``: the packed row through the CUDA kernels transformers calls, with the boundaries pf-trl hands them
  (``seq_idx`` for causal-conv1d / mamba-ssm, ``cu_seqlens`` for flash-linear-attention); only where the family's
  kernel packages import (``pf_trl.attention.stateful.KERNEL_ROUTES``);
- ``segments``: the packed row through pf-trl's own path (the mixers run per segment batch);
- ``leak``: the packed row with the boundaries dropped at the stateful layers (the negative control).

Eval-mode logits vs ``alone`` (max |diff|), and the train-mode loss and gradients of ``kernels`` vs ``segments``
(Granite / Bamba / Mamba2 take a fused training kernel there). A path is exact when it stays below ``TOL``
(float32, TF32 off) and the negative control is conclusive when the leak is at least 10 x ``TOL``. Prints a table, writes ``DIR/stateful_check.json``. ``--dry-run``: CPU, segments only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # pf_trl_dev (the tiny models) is in the checkout, not in the installed package
    sys.path.insert(0, str(ROOT))

FAMILIES = [  # (model_type, tiny variant), the most fine-tuned first: a run cut short still covers them
    ("qwen3_5_text", None), ("qwen3_next", None), ("granitemoehybrid", "attention"), ("nemotron_h", None),
    ("mamba2", None), ("lfm2_moe", None), ("falcon_h1", None), ("bamba", "attention"), ("kimi_linear", None),
    ("jamba", None), ("mamba", None), ("minimax", None), ("recurrent_gemma", None),
]
DRY_FAMILIES = [("qwen3_5_text", None), ("mamba2", None), ("lfm2_moe", None)]
LENGTHS = (9, 1, 14, 5, 11, 40, 70)
TOL = 2e-4


def _examples(model, device):
    from pf_trl.attention.enable import special_token_ids

    avoid = special_token_ids(model.config)
    pool = torch.tensor([i for i in range(3, 200) if i not in avoid])
    g = torch.Generator().manual_seed(0)
    return [pool[torch.randint(0, len(pool), (n,), generator=g)].to(device) for n in LENGTHS]


def _batch(exs, device):
    from pf_trl.batching.collator import PaddingFreeCollator

    batch = PaddingFreeCollator()([{"input_ids": e.cpu()} for e in exs])
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@contextlib.contextmanager
def _boundaries_dropped():
    from pf_trl.attention import stateful

    def whole_row(state, arguments, layout):
        call = {k: v for k, v in arguments.items() if k not in stateful.BOUNDARY_KWARGS}
        if isinstance(call.get("attention_mask"), stateful.PackedLayout):
            call["attention_mask"] = None
        return state.inner(**call)

    original = stateful._run_segments, stateful.choose_path
    stateful._run_segments = whole_row
    stateful.choose_path = lambda *a, **k: "segments"
    try:
        yield
    finally:
        stateful._run_segments, stateful.choose_path = original


def _packed_logits(model, batch):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        return model(**inputs).logits[0].float()


def _train_loss_and_grads(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    return float(out.loss), grads


def _grad_rel(a, b) -> float:
    return max(float((a[k] - g).norm()) / max(float(g.norm()), 1e-8) for k, g in b.items())


def check_family(model_type: str, variant: str | None, device: torch.device) -> dict:
    from pf_trl.attention import enable_padding_free, stateful, support
    from pf_trl_dev.tiny import tiny_model

    model = tiny_model(model_type, variant=variant).to(device).eval()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    with support.use_matrix({}):  # judged here on its own, as the coverage sweep does
        enable_padding_free(model, mode="internal", allow_unverified=True)
    kinds = stateful.describe(model)
    exs = _examples(model, device)
    batch = _batch(exs, device)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=e[None], use_cache=False).logits[0].float() for e in exs])
    row = {"type": model_type, "variant": variant, "kinds": kinds}
    stateful.set_stateful_path(model, "segments")
    row["segments_err"] = float((_packed_logits(model, batch) - alone).abs().max())
    seg_loss, seg_grads = _train_loss_and_grads(model, batch)
    with _boundaries_dropped():
        row["leak"] = float((_packed_logits(model, batch) - alone).abs().max())
    kind = next(iter(kinds))
    route = stateful.KERNEL_ROUTES.get(kind)
    row["kernel_packages"] = list(route.packages) if route else []
    usable = route is not None and device.type == "cuda" and all(stateful._package_usable(p) for p in route.packages)
    if usable:
        stateful.set_stateful_path(model, "kernels")
        try:
            row["kernels_err"] = float((_packed_logits(model, batch) - alone).abs().max())
            k_loss, k_grads = _train_loss_and_grads(model, batch)
            row["kernels_loss_diff"] = abs(k_loss - seg_loss)
            row["kernels_grad_rel"] = _grad_rel(k_grads, seg_grads)
        except Exception as exc:
            row["kernels_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    else:
        row["kernels"] = "n/a: " + ("no kernel takes boundaries" if route is None else
                                    ("CPU" if device.type != "cuda" else f"needs {', '.join(route.packages)}"))
    tol = TOL
    row["tolerance"] = tol
    row["leak_conclusive"] = row["leak"] >= 10 * tol
    row["segments_exact"] = row["segments_err"] <= tol
    if "kernels_err" in row:
        row["kernels_exact"] = row["kernels_err"] <= tol and row["kernels_grad_rel"] <= 1e-2
    return row


def _isolated(model_type: str, variant, args) -> dict:
    """One family checked by a child process of this script, stopped after ``args.isolate`` seconds."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, __file__, "--families", model_type, "--out", tmp, *(["--dry-run"] if args.dry_run else [])]
        try:
            subprocess.run(cmd, capture_output=True, text=True, timeout=args.isolate)
        except subprocess.TimeoutExpired:
            return {"type": model_type, "variant": variant, "error": f"not done after {args.isolate:.0f} s"}
        result = Path(tmp) / "stateful_check.json"
        rows = json.loads(result.read_text())["rows"] if result.is_file() else []
    return rows[0] if rows else {"type": model_type, "variant": variant, "error": "the child process wrote no row"}


def _table_row(r: dict) -> str:
    if "error" in r:
        return f"| {r['type']} | error: {r['error']} | | | | | | {r['seconds']} |"
    kern = r.get("kernels_error") or (f"{r['kernels_err']:.2e} ({'exact' if r['kernels_exact'] else 'NOT EXACT'})"
                                      if "kernels_err" in r else r.get("kernels", "-"))
    return (f"| {r['type']}{'/' + r['variant'] if r['variant'] else ''} | {', '.join(r['kinds'])} | "
            f"{', '.join(r['kernel_packages']) or '-'} | {kern} | {r['segments_err']:.2e} "
            f"({'exact' if r['segments_exact'] else 'NOT EXACT'}) | {r['leak']:.2e}"
            f"{'' if r['leak_conclusive'] else ' (too small to tell)'} | "
            + (f"{r['kernels_grad_rel']:.2e}" if "kernels_grad_rel" in r else "-") + f" | {r['seconds']} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--dry-run", action="store_true", help="CPU, three families, segments only")
    parser.add_argument("--families", default=None, help="comma-separated model types (default: all, in order)")
    parser.add_argument("--isolate", type=float, default=0, metavar="SECONDS",
                        help="check each family in a process of its own, stopped after SECONDS (first kernel "
                        "compilations can take minutes): one slow family does not cost the others")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("pf_trl").setLevel(logging.ERROR)  # "no sweep evidence": judged here on its own
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 comparisons: no TF32 rounding in the reference
    families = DRY_FAMILIES if args.dry_run else FAMILIES
    if args.families:
        wanted = args.families.split(",")
        families = [f for f in families if f[0] in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # each row printed and saved as soon as it is known: a run stopped by its time limit keeps what it measured
    print(f"device: {device}")
    print("| type | kind | kernel packages | kernels vs alone | segments vs alone | leak (no boundaries) | "
          "kernels grad rel vs segments | seconds |")
    print("|" + "---|" * 8, flush=True)
    rows = []
    for model_type, variant in families:
        t0 = time.time()
        if args.isolate:
            row = _isolated(model_type, variant, args)
        else:
            try:
                row = check_family(model_type, variant, device)
            except Exception as exc:
                row = {"type": model_type, "variant": variant, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        row["seconds"] = round(time.time() - t0, 1)
        rows.append(row)
        print(_table_row(row), flush=True)
        (out / "stateful_check.json").write_text(json.dumps({"device": str(device), "rows": rows}, indent=1))
    bad = [r["type"] for r in rows if "error" in r or not r.get("segments_exact") or r.get("kernels_exact") is False]
    if bad:
        print(f"NOT EXACT or failed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
