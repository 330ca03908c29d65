"""GPU check of attention sinks (gpt-oss ``s_aux``) in pf-trl's varlen backends, and of a tiny gpt-oss packed.

1. every backend available on (cuda, bf16) with ``sinks`` vs the exact reference (the ``sdpa`` backend on fp32
   copies: its explicit softmax), forward and gradients of q, k, v and the sinks, full and sliding-window (gpt-oss
   alternates both); flash-attn and PyTorch's varlen op rescale by their log-sum-exp and take the lse gradient
   from a second attention (``backends/_sinks.py``), flex takes its own differentiable lse;
2. a tiny gpt-oss (bf16, ``enable_padding_free(mode="internal")`` with each backend) vs the same examples padded
   (eager attention with sinks): per-example loss difference.

A missing backend is reported as ``unavailable: <reason>``, a failing one as ``error: <message>``. Prints a table,
writes ``sinks_check.json`` to ``--out``. ``--dry-run``: CPU, fp32, the CPU backends (sdpa; flex forward only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from pf_trl.attention import varlen_attention
from pf_trl.attention.dispatch import BACKENDS, backend_status, resolve_backend


def inputs(lengths, h, hkv, d, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, n, d, generator=g).to(device, dtype) for n in (h, hkv, hkv))
    sinks = (torch.randn(h, generator=g) * 2).to(device, torch.float32)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return q, k, v, sinks, cu.to(device)


def run(backend, q, k, v, sinks, cu, max_len, window, grad):
    leaves = [x.detach().clone().requires_grad_(grad) for x in (q, k, v, sinks)]
    out = varlen_attention(*leaves[:3], cu, cu, max_len, max_len, sliding_window=window, backend=backend,
                           sinks=leaves[3])
    grads = []
    if grad:
        w = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
        (out.float() * w).sum().backward()
        grads = [x.grad.float() for x in leaves]
    return out.detach().float(), grads


def kernel_table(device, dtype, dry):
    lengths = [5, 1, 9, 3] if dry else [300, 17, 1024, 1, 700, 64]
    h, hkv, d = (4, 2, 16) if dry else (16, 4, 64)
    q, k, v, sinks, cu = inputs(lengths, h, hkv, d, device, dtype)
    rows = []
    for window in (None, 128 if not dry else 3):
        ref, ref_grads = run("sdpa", q.float(), k.float(), v.float(), sinks, cu, max(lengths), window, True)
        for name in BACKENDS:
            row = {"backend": name, "window": window}
            grad = not (name == "flex" and device.type != "cuda")
            try:
                resolve_backend(name, device=device, dtype=dtype, window=(-1, -1) if window is None else (window - 1, 0),
                                head_dim=d, gqa=True, requires_grad=grad, sinks=True)
                out, grads = run(name, q, k, v, sinks, cu, max(lengths), window, grad)
                row["fwd_err"] = float((out - ref).abs().max())
                if grads:
                    row.update({f"d{n}_err": float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))
                                for n, a, b in zip(("q", "k", "v", "sinks"), grads, ref_grads)})
                row["status"] = "ok"
            except Exception as exc:
                status = backend_status(device, dtype).get(name)
                row["status"] = f"unavailable: {status}" if status else f"error: {type(exc).__name__}: {exc}"[:160]
            rows.append(row)
    return rows


def tiny_gpt_oss(device, dtype, dry):
    from pf_trl.attention import enable_padding_free, support
    from pf_trl.batching.collator import PaddingFreeCollator
    from pf_trl_dev.coverage import _examples, _padded, _per_example_nll, _starts, _vocab
    from pf_trl_dev.tiny import tiny_model

    rows = []
    base = tiny_model("gpt_oss").to(device, dtype).eval()
    exs = _examples(base.config, _vocab(base.config))
    ids, mask, _ = _padded(exs, int(exs[0][0]))
    with torch.no_grad():
        ref = _per_example_nll(base(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits,
                               exs, [(i, 0) for i in range(len(exs))])
    for name in BACKENDS:
        if backend_status(device, dtype)[name] is not None or (name == "flex" and dry):
            continue
        import copy

        model = copy.deepcopy(base)
        try:
            with support.use_matrix({}):
                enable_padding_free(model, mode="internal", backend=name, allow_unverified=True)
            batch = PaddingFreeCollator()([{"input_ids": e} for e in exs])
            batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "labels"}
            with torch.no_grad():
                got = _per_example_nll(model(**batch).logits, exs, _starts(exs))
            err = max(abs(a - b) for a, b in zip(got, ref) if a is not None)
            rows.append({"backend": name, "loss_err": err, "status": "ok"})
        except Exception as exc:
            rows.append({"backend": name, "status": f"error: {type(exc).__name__}: {exc}"[:160]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmark_outputs"))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    result = {"device": str(device), "dtype": str(dtype), "torch": torch.__version__}
    result["kernels"] = kernel_table(device, dtype, args.dry_run)
    print(f"attention sinks, {device}/{dtype} vs the fp32 exact reference (max abs fwd error, relative grad errors)")
    print(f"{'backend':13s} {'window':>6s} {'fwd':>9s} {'dq':>9s} {'dk':>9s} {'dv':>9s} {'dsinks':>9s}  status")
    for r in result["kernels"]:
        nums = " ".join(f"{r[k]:9.2e}" if k in r else f"{'-':>9s}" for k in ("fwd_err", "dq_err", "dk_err", "dv_err",
                                                                              "dsinks_err"))
        print(f"{r['backend']:13s} {str(r['window']):>6s} {nums}  {r['status']}")
    try:
        result["gpt_oss"] = tiny_gpt_oss(device, dtype, args.dry_run)
        for r in result["gpt_oss"]:
            print(f"tiny gpt-oss, internal mode, {r['backend']}: per-example loss vs padded eager "
                  f"{r.get('loss_err', float('nan')):.2e} ({r['status']})")
    except Exception:
        result["gpt_oss"] = traceback.format_exc(limit=2)
        print("tiny gpt-oss check failed:", result["gpt_oss"].splitlines()[-1])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sinks_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    bad = [r for r in result["kernels"] if r["status"] == "ok" and (
        r["fwd_err"] > (2e-2 if cuda else 1e-5) or any(r.get(k, 0) > (5e-2 if cuda else 1e-4)
                                                        for k in ("dq_err", "dk_err", "dv_err", "dsinks_err")))]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
