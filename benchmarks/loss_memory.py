"""Memory of the LM-head loss (forward + backward) at 8k and 32k supervised tokens, 128k x 2048 head, bf16.

Methods (hidden ``[N, 2048]`` and head weight ``[131072, 2048]`` in bf16, both requiring grad):

- ``plain``: ``F.cross_entropy((hidden @ W.T).float(), targets)`` -- what a causal LM's own loss does (full logits,
  upcast to fp32).
- ``trl_fused``: TRL 1.16's fused LM head kernel (``trl.kernels.ChunkedLogProbFunction``, the kernel of
  ``add_fused_lm_head``), called as TRL calls it.
- ``pf_trl``: pf-trl's loss on a plain linear head as it runs on this device (``supervised_loss_terms``, path
  ``linear``): on CPU 1024-token chunks under activation checkpointing; on CUDA it is ``trl_fused`` on the supervised
  positions.
- ``pf_trl_before``: pf-trl's previous chunked CE (Liger-style: gradients computed in the forward, an fp32
  ``[V, H]`` gradient buffer saved for the backward), kept here verbatim for the before/after comparison.

Method of measurement (no FLOPs are spent, so the 32k case runs in seconds on a laptop): the loss runs under
``FakeTensorMode`` (tensors carry shape, dtype and device but no data), and a ``TorchDispatchMode`` counts the bytes
of every tensor storage the loss creates, from creation until the storage is freed (a weakref on the storage, as
``torch.distributed._tools.mem_tracker.MemTracker`` does). Reported: ``peak`` (max live bytes during forward +
backward, excluding the inputs), ``held`` (bytes still alive after the forward, i.e. kept until the backward reaches
the loss), and the weight gradient's dtype. It is exact for tensor storages; it ignores allocator caching and
fragmentation, and kernels' internal workspaces. ``--validate`` runs a small case (1024 x 8192 x 256) for real,
each method in a fresh process, and compares the count with the growth of the process's peak RSS (``ru_maxrss``).

    python benchmarks/loss_memory.py [--tokens 8192 32768] [--vocab 131072] [--hidden 2048] [--out FILE] [--validate]
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from pf_trl.trainer.loss import HeadPlan, supervised_loss_terms  # noqa: E402

METHODS = ("plain", "trl_fused", "pf_trl", "pf_trl_checkpointed", "pf_trl_before")


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of tensor storages created inside the mode while they are alive (peak and current)."""

    def __init__(self, inputs=()) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, object] = {}
        for t in inputs:  # views of the inputs share their storage: not new memory
            self._refs[t.untyped_storage()._cdata] = t

    def _free(self, key: int, nbytes: int, _ref) -> None:
        self._refs.pop(key, None)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self._refs:
                    nbytes = storage.nbytes()
                    self._refs[key] = weakref.ref(storage, lambda r, k=key, n=nbytes: self._free(k, n, r))
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
        return out


def _previous_pf_trl(hidden, weight, targets, chunk_size=1024):
    """pf-trl's previous chunked CE (before this change), verbatim in its memory behaviour."""

    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight):
            n = hidden.shape[0]
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            grad_h = torch.empty_like(hidden)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            for start in range(0, n, chunk_size):
                stop = min(start + chunk_size, n)
                h, t = hidden[start:stop], targets[start:stop]
                logits = (h @ weight.t()).float()
                lse = torch.logsumexp(logits, dim=-1)
                loss += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(stop - start, device=hidden.device), t] -= 1.0
                g = probs.to(weight.dtype)
                grad_h[start:stop] = g @ weight
                grad_w.addmm_(g.t().float(), h.float())
                del probs, g, logits
            ctx.save_for_backward(grad_h, grad_w)
            ctx.weight_dtype = weight.dtype
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            grad_h, grad_w = ctx.saved_tensors
            return grad_h * grad_loss.to(grad_h.dtype), (grad_w * grad_loss).to(ctx.weight_dtype)

    return Fn.apply(hidden, weight)


def loss_fn(method: str, hidden, weight, targets):
    if method == "plain":
        return F.cross_entropy((hidden @ weight.t()).float(), targets, reduction="sum")
    if method == "trl_fused":
        from trl.kernels import ChunkedLogProbFunction

        logprobs = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0,
                                                ("log_probs", "entropy", "is_top1"))[0]
        return -logprobs.sum()
    if method == "pf_trl_before":
        return _previous_pf_trl(hidden, weight, targets)
    if method == "pf_trl_checkpointed":
        # pf-trl's CPU path before the token-chunk function: generic autograd on 1024-token chunks under activation
        # checkpointing (each chunk's backward allocates [chunk, vocab] buffers and a fresh [vocab, hidden] gradient)
        from pf_trl.trainer.loss import _module_terms

        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = weight
        return _module_terms(head, hidden, targets, 1.0, None, 1024, False, True, linear=True).nll.sum()
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = weight  # the benchmark's Parameter: nothing new is allocated
    return supervised_loss_terms(head, hidden, targets, HeadPlan("linear")).nll.sum()


def measure(method: str, tokens: int, vocab: int, hidden_size: int, *, fake: bool = True,
            dtype: torch.dtype = torch.bfloat16) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode

    ctx = FakeTensorMode() if fake else torch.autocast("cpu", enabled=False)
    with ctx:
        hidden = torch.randn(tokens, hidden_size, dtype=dtype).requires_grad_()
        weight = torch.nn.Parameter(torch.randn(vocab, hidden_size, dtype=dtype) * 0.02)
        targets = torch.randint(0, vocab, (tokens,))
        tracker = LiveBytes((hidden, weight, targets))
        with tracker:
            loss = loss_fn(method, hidden, weight, targets)
            held = tracker.live
            loss.backward()
            # the gradients are outputs, not workspace: report them apart
            grads = hidden.grad.untyped_storage().nbytes() + weight.grad.untyped_storage().nbytes()
            del loss
        return {"method": method, "tokens": tokens, "vocab": vocab, "hidden": hidden_size,
                "peak_bytes": tracker.peak, "held_after_forward_bytes": held, "grad_bytes": grads,
                "weight_grad_dtype": str(weight.grad.dtype).replace("torch.", "")}


def _rss_child(method: str, tokens: int, vocab: int, hidden_size: int) -> None:
    """In a fresh process: peak RSS growth (KiB) of one real loss forward + backward beyond its inputs."""
    import resource

    torch.manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, dtype=torch.bfloat16).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(vocab, hidden_size, dtype=torch.bfloat16) * 0.02)
    targets = torch.randint(0, vocab, (tokens,))
    loss_fn(method, hidden[:8], weight, targets[:8]).backward()  # load kernels and thread pools first
    hidden.grad = weight.grad = None
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss_fn(method, hidden, weight, targets).backward()
    print(json.dumps({"rss_growth_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}))


def validate(tokens=1024, vocab=8192, hidden_size=256) -> list[dict]:
    """Real CPU tensors in a subprocess each: the tracker's peak vs the growth of the process's peak RSS."""
    import subprocess

    rows = []
    for method in METHODS:
        counted = measure(method, tokens, vocab, hidden_size)
        out = subprocess.run([sys.executable, __file__, "--rss-child", method, str(tokens), str(vocab), str(hidden_size)],
                             capture_output=True, text=True, check=True).stdout
        rss = json.loads(out.strip().splitlines()[-1])["rss_growth_kib"] * 1024
        rows.append({"method": method, "tokens": tokens, "vocab": vocab, "hidden": hidden_size,
                     "tracker_peak_bytes": counted["peak_bytes"], "rss_peak_growth_bytes": rss})
    return rows


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rss-child"]:
        _rss_child(argv[1], *map(int, argv[2:5]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "loss_memory.json"))
    parser.add_argument("--validate", action="store_true", help="also compare the tracker with real RSS growth")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = [measure(m, n, args.vocab, args.hidden, dtype=dtype) for n in args.tokens for m in args.methods]
    head_mib = args.vocab * args.hidden * dtype.itemsize / 2**20
    print(f"loss forward+backward, head {args.vocab} x {args.hidden} {args.dtype} ({head_mib:,.0f} MiB), MiB beyond "
          "the inputs")
    print(f"{'tokens':>7} {'method':<15} {'peak':>9} {'held fwd->bwd':>14} {'grads':>8} {'W.grad':>9}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['method']:<15} {_mib(r['peak_bytes']):>9} {_mib(r['held_after_forward_bytes']):>14} "
              f"{_mib(r['grad_bytes']):>8} {r['weight_grad_dtype']:>9}")
    result = {"method": "FakeTensorMode + storage byte count (see module docstring)", "torch": torch.__version__,
              "rows": rows}
    if args.validate:
        result["validation"] = validate()
        for v in result["validation"]:
            print(f"validate {v['tokens']}x{v['vocab']}x{v['hidden']} {v['method']:<15} tracker "
                  f"{_mib(v['tracker_peak_bytes']):>6} MiB, real peak RSS growth {_mib(v['rss_peak_growth_bytes']):>6} MiB")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
