"""GPU check of pf-trl's varlen attention backends: correctness vs the exact reference, kernel time, TFLOP/s.

One run:
  1. every backend available on (cuda, bf16) vs an fp32 reference (the exact per-segment ``sdpa`` backend on
     fp32 copies of the inputs): max abs error, forward and input gradients, for plain causal GQA, sliding
     window and softcap;
  2. kernel time per backend (``triton.testing.do_bench`` median, CUDA events if triton is missing) at total
     tokens 16k and 32k, 32 heads, 8 KV heads, head dim 128, ShareGPT-like segment lengths (lognormal, mean
     ~470, clipped to [8, 1024]), forward and forward+backward, with TFLOP/s counted on causal FLOPs
     (fwd: 4 * sum(L_i^2) / 2 * H * D; fwd+bwd: 3.5x fwd, FlashAttention's convention: the backward does
     2.5x the forward's matmul work);
  3. if transformers is importable: a tiny Llama in bf16 with ``enable_padding_free(mode="internal")`` vs the
     padded run (per-example loss difference).

A missing backend is reported as ``unavailable: <reason>``, a failing one as ``error: <message>``; the run
goes on. Prints a table and writes ``attention_check.json`` to ``--out`` (default ``$OUT``).
``--dry-run`` runs everything CPU-safe with tiny sizes (sdpa, flex forward) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from pf_trl.attention import varlen_attention
from pf_trl.attention.dispatch import BACKENDS, backend_status, resolve_backend

FWD_BWD_FACTOR = 3.5  # forward + backward FLOPs / forward FLOPs (FlashAttention's benchmark convention)


def sharegpt_lengths(total: int, *, mean: float = 470.0, sigma: float = 0.8, lo: int = 8, hi: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2
    lengths, acc = [], 0
    while acc < total:
        n = int(torch.empty(1).log_normal_(mu, sigma, generator=g).clamp(lo, hi).item())
        n = min(n, total - acc)
        lengths.append(n)
        acc += n
    return lengths


def make_inputs(lengths, h, hkv, d, device, dtype, seed=0, requires_grad=False):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lengths)
    q = torch.randn(t, h, d, generator=g).to(device, dtype)
    k = torch.randn(t, hkv, d, generator=g).to(device, dtype)
    v = torch.randn(t, hkv, d, generator=g).to(device, dtype)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    cu = cu.to(device)
    if requires_grad:
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    return q, k, v, cu, max(lengths)


def causal_flops(lengths, h, d) -> float:
    return 4.0 * sum(n * n for n in lengths) / 2.0 * h * d


def bench(fn, device) -> float:
    """Median milliseconds."""
    if device.type == "cuda":
        try:
            import triton.testing

            return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
        except ImportError:
            pass
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return float(sorted(times)[len(times) // 2])
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(sorted(times)[1])


def status_line(reason):
    return "available" if reason is None else f"unavailable: {reason}"


def check_correctness(backends, status, device, dtype, sizes, results, backward: bool):
    lengths = sizes["lengths"]
    cases = {
        "causal_gqa": {},
        "sliding_window": {"sliding_window": sizes["window"]},
        "softcap": {"softcap": 50.0},
    }
    for case, feats in cases.items():
        q, k, v, cu, mx = make_inputs(lengths, sizes["h"], sizes["hkv"], sizes["d"], device, dtype, seed=1)
        w = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(device, torch.float32)
        ref_in = [x.detach().float().requires_grad_(backward) for x in (q, k, v)]
        ref = varlen_attention(*ref_in, cu, cu, mx, mx, backend="sdpa", **feats)
        ref_grads = None
        if backward:
            (ref * w).sum().backward()
            ref_grads = [x.grad for x in ref_in]
        for name in backends:
            entry = results.setdefault(name, {}).setdefault("correctness", {})
            if status[name] is not None:
                entry[case] = status_line(status[name])
                continue
            try:
                inp = [x.detach().clone().requires_grad_(backward) for x in (q, k, v)]
                out = varlen_attention(*inp, cu, cu, mx, mx, backend=name, **feats)
                row = {"fwd_max_abs_err": float((out.detach().float() - ref.detach()).abs().max())}
                if backward:
                    (out.float() * w).sum().backward()
                    row["grad_max_abs_err"] = max(float((a.grad.float() - b).abs().max()) for a, b in zip(inp, ref_grads))
                    row["grad_ref_max"] = max(float(b.abs().max()) for b in ref_grads)
                entry[case] = row
            except Exception as exc:
                entry[case] = f"error: {type(exc).__name__}: {exc}"[:300]


def check_speed(backends, status, device, dtype, sizes, results, backward: bool):
    h, hkv, d = sizes["h"], sizes["hkv"], sizes["d"]
    for total in sizes["totals"]:
        lengths = sharegpt_lengths(total, mean=sizes["mean"], hi=sizes["hi"])
        flops = causal_flops(lengths, h, d)
        for name in backends:
            entry = results.setdefault(name, {}).setdefault("speed", {})
            key = f"T={total}"
            if status[name] is not None:
                entry[key] = status_line(status[name])
                continue
            row = {"segments": len(lengths), "mean_len": round(sum(lengths) / len(lengths), 1)}
            try:
                q, k, v, cu, mx = make_inputs(lengths, h, hkv, d, device, dtype)
                with torch.no_grad():
                    ms = bench(lambda: varlen_attention(q, k, v, cu, cu, mx, mx, backend=name), device)
                row.update(fwd_ms=round(ms, 3), fwd_tflops=round(flops / ms / 1e9, 1))
                if backward:
                    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
                    grad_out = torch.randn_like(q)

                    def step():
                        out = varlen_attention(qg, kg, vg, cu, cu, mx, mx, backend=name)
                        out.backward(grad_out)
                        qg.grad = kg.grad = vg.grad = None

                    ms = bench(step, device)
                    row.update(fwd_bwd_ms=round(ms, 3), fwd_bwd_tflops=round(FWD_BWD_FACTOR * flops / ms / 1e9, 1))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            entry[key] = row
            if device.type == "cuda":
                torch.cuda.empty_cache()


def model_check(device, dtype, results):
    try:
        import transformers

        from pf_trl.attention import enable_padding_free
        from pf_trl.batching.collator import PaddingFreeCollator
    except Exception as exc:
        results["model_check"] = f"skipped: {type(exc).__name__}: {exc}"
        return
    try:
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        )
        torch.manual_seed(0)
        ref = transformers.LlamaForCausalLM(cfg).to(device, dtype)
        ref.set_attn_implementation("sdpa")
        model = transformers.LlamaForCausalLM(cfg).to(device, dtype)
        model.load_state_dict(ref.state_dict())
        enable_padding_free(model, mode="internal")
        g = torch.Generator().manual_seed(0)
        exs = [torch.randint(0, 512, (n,), generator=g) for n in (300, 1, 517, 64, 129)]
        n = max(len(e) for e in exs)
        ids = torch.zeros(len(exs), n, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(exs):
            ids[i, : len(e)], mask[i, : len(e)] = e, 1
        with torch.no_grad():
            padded = ref(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits.float()
            batch = PaddingFreeCollator()([{"input_ids": e} for e in exs])
            batch.pop("labels")
            batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
            packed = model(**batch).logits[0].float()
        diffs, start = [], 0
        for i, e in enumerate(exs):
            diffs.append(float((packed[start : start + len(e)] - padded[i, : len(e)]).abs().max()))
            start += len(e)
        results["model_check"] = {
            "transformers": transformers.__version__,
            "backend": resolve_backend("auto", device=device, dtype=dtype, gqa=True, head_dim=32),
            "max_abs_logit_diff_per_example": diffs,
            "self_check": model._pf_padding_free.get("self_check"),
        }
    except Exception as exc:
        results["model_check"] = f"error: {type(exc).__name__}: {exc}"[:500]
        traceback.print_exc()


def print_table(report):
    print("\n== availability ({device}, {dtype})".format(**report["env"]))
    for name, reason in report["availability"].items():
        print(f"  {name:13s} {status_line(reason)}")
    print("\n== correctness vs fp32 reference (max abs error: fwd / grads)")
    for name, res in report["backends"].items():
        for case, row in res.get("correctness", {}).items():
            if isinstance(row, dict):
                grad = f" / {row['grad_max_abs_err']:.3e}" if "grad_max_abs_err" in row else ""
                print(f"  {name:13s} {case:15s} {row['fwd_max_abs_err']:.3e}{grad}")
            else:
                print(f"  {name:13s} {case:15s} {row}")
    print("\n== speed (median ms, TFLOP/s causal)")
    print(f"  {'backend':13s} {'tokens':>7s} {'segs':>5s} {'fwd ms':>9s} {'fwd TF/s':>9s} {'f+b ms':>9s} {'f+b TF/s':>9s}")
    for name, res in report["backends"].items():
        for key, row in res.get("speed", {}).items():
            if not isinstance(row, dict):
                print(f"  {name:13s} {key[2:]:>7s} {row}")
                continue
            if "error" in row and "fwd_ms" not in row:
                print(f"  {name:13s} {key[2:]:>7s} error: {row['error']}")
                continue
            print(
                f"  {name:13s} {key[2:]:>7s} {row['segments']:>5d} {row.get('fwd_ms', float('nan')):>9.3f} "
                f"{row.get('fwd_tflops', float('nan')):>9.1f} {row.get('fwd_bwd_ms', float('nan')):>9.3f} "
                f"{row.get('fwd_bwd_tflops', float('nan')):>9.1f}" + (f"  error: {row['error']}" if "error" in row else "")
            )
    if "model_check" in report:
        print("\n== model check:", json.dumps(report["model_check"]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU ok (checks the script, not the GPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmark_outputs"))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--totals", default="16384,32768")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--no-model-check", action="store_true")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.dry_run:
        sizes = dict(h=4, hkv=2, d=32, totals=[256, 512], lengths=[37, 1, 64, 9, 120], window=16, mean=40.0, hi=100)
    else:
        sizes = dict(h=32, hkv=8, d=128, totals=[int(t) for t in args.totals.split(",")],
                     lengths=sharegpt_lengths(4096, seed=3), window=256, mean=470.0, hi=1024)
    backends = [b for b in args.backends.split(",") if b]
    status = {name: backend_status(device, dtype)[name] for name in backends}
    backward = not args.no_backward
    # uncompiled flex (CPU) has no backward: run it forward-only there
    status_bwd = device.type == "cpu" and status.get("flex", "missing") is None

    env = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dry_run": args.dry_run,
    }
    for mod in ("triton", "flash_attn", "flash_attn_interface", "transformers"):
        try:
            m = __import__(mod)
            env[mod] = getattr(m, "__version__", "installed")
        except Exception:
            env[mod] = None
    from pf_trl.attention.backends.flash_attn import kernel_for
    from pf_trl.attention.flash_packages import installed_flash_kernels
    from pf_trl.benchmarking.e2e import versions

    env["versions"] = versions()
    env["flash_packages"] = installed_flash_kernels()  # which flash_attn_varlen_func imports (fa2 / fa3 / fa4)
    env["flash_attn_backend_kernel"] = kernel_for(device)[0]  # what the flash_attn rows below ran
    report = {"env": env, "availability": status, "sizes": {k: v for k, v in sizes.items() if k != "lengths"},
              "fwd_bwd_flops": f"{FWD_BWD_FACTOR}x the forward's", "backends": {}}
    t0 = time.time()
    results = report["backends"]
    # CPU dry run: flex forward only
    bw_backends = [b for b in backends if not (status_bwd and b == "flex")]
    check_correctness(bw_backends, status, device, dtype, sizes, results, backward=backward)
    if status_bwd:
        check_correctness(["flex"], status, device, dtype, sizes, results, backward=False)
    check_speed(bw_backends, status, device, dtype, sizes, results, backward=backward)
    if status_bwd:
        check_speed(["flex"], status, device, dtype, sizes, results, backward=False)
    if not args.no_model_check:
        model_check(device, dtype if cuda else torch.float32, report)
    report["wall_s"] = round(time.time() - t0, 1)
    print_table(report)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"\nwrote {path} ({report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
