"""Cross-entropy over the LM head without the full ``[tokens, vocab]`` logits.

``chunked_cross_entropy(hidden, weight, targets)`` returns the *sum* of the token cross-entropies (and the number of
top-1 hits, for the token-accuracy metric). Only supervised positions are passed in (the caller selects them), so
prompt tokens never go through the LM head at all.

How memory stays flat: the forward walks the tokens in chunks of ``chunk_size``; for each chunk it builds the fp32
logits ``[chunk, vocab]``, reduces them to the loss, and -- when gradients are needed -- immediately turns them into
``d loss / d hidden`` for the chunk and accumulates ``d loss / d weight`` (the approach of Liger's fused linear
cross-entropy). Nothing of size ``[tokens, vocab]`` is ever alive: the peak is one chunk of logits plus the
``[tokens, hidden]`` and ``[vocab, hidden]`` gradient buffers. ``backward`` only scales the stored gradients by the
incoming scalar. Under ``torch.no_grad`` (evaluation) no gradient is computed.

The math is exactly ``F.cross_entropy(hidden @ weight.T (+ bias), targets, reduction="sum")`` computed in fp32 per
chunk: tests check loss and gradients against the plain path at 1e-6 (fp32).

On CUDA with ``liger-kernel`` installed, :func:`linear_cross_entropy` uses Liger's Triton kernel instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_cross_entropy", "plain_cross_entropy", "linear_cross_entropy", "resolve_fused_loss", "FUSED_LOSS_CHOICES"]

FUSED_LOSS_CHOICES = ("auto", "chunked", "liger", "none")
DEFAULT_CHUNK_SIZE = 1024


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size: int, compute_grad: bool):
        n = hidden.shape[0]
        device = hidden.device
        loss = torch.zeros((), dtype=torch.float32, device=device)
        correct = torch.zeros((), dtype=torch.int64, device=device)
        need_h = compute_grad and ctx.needs_input_grad[0]
        need_w = compute_grad and ctx.needs_input_grad[1]
        need_b = compute_grad and bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        acc_dtype = torch.float32
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        for start in range(0, n, chunk_size):
            stop = min(start + chunk_size, n)
            h = hidden[start:stop]
            t = targets[start:stop]
            logits = h @ weight.t()
            if bias is not None:
                logits = logits + bias
            logits = logits.float()
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, t[:, None]).squeeze(1)
            loss += (lse - target_logit).sum()
            correct += (logits.argmax(dim=-1) == t).sum()
            if need_h or need_w or need_b:
                # softmax - onehot, in place on the chunk's logits
                probs = logits.sub_(lse[:, None]).exp_()
                probs[torch.arange(stop - start, device=device), t] -= 1.0
                g = probs.to(weight.dtype)
                if need_h:
                    grad_h[start:stop] = g @ weight
                if need_w:
                    grad_w.addmm_(g.t().to(acc_dtype), h.to(acc_dtype))
                if need_b:
                    grad_b += probs.sum(0)
                del probs, g
            del logits
        ctx.save_for_backward(
            grad_h if grad_h is not None else torch.empty(0),
            grad_w if grad_w is not None else torch.empty(0),
            grad_b if grad_b is not None else torch.empty(0),
        )
        ctx.has = (need_h, need_w, need_b)
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        need_h, need_w, need_b = ctx.has
        if (need_h or need_w or need_b) is False and any(ctx.needs_input_grad[:3]):
            raise RuntimeError("chunked_cross_entropy was run without gradients (compute_grad=False); cannot backward")
        out_h = grad_h * grad_loss.to(grad_h.dtype) if need_h else None
        out_w = (grad_w * grad_loss).to(ctx.weight_dtype) if need_w else None
        out_b = (grad_b * grad_loss).to(ctx.bias_dtype) if need_b else None
        return out_h, out_w, out_b, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``cross_entropy(hidden @ weight.T + bias, targets)`` and the count of top-1 hits.

    Args:
        hidden: ``[N, H]`` hidden states of the supervised positions (already shifted: row i predicts targets[i]).
        weight: ``[V, H]`` LM head weight. bias: ``[V]`` or None.
        targets: ``[N]`` token ids, all valid (no -100: select the supervised positions first).
        chunk_size: tokens per chunk (peak extra memory ~ ``chunk_size x V x 4`` bytes, twice).

    Returns:
        ``(loss_sum fp32 scalar, correct int64 scalar)``.
    """
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden must be [N, H] and targets [N]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if hidden.shape[0] == 0:
        # keep the graph connected so that backward works on an all-masked micro-batch
        zero = (hidden.sum() * 0.0 + weight.sum() * 0.0).float()
        return zero, torch.zeros((), dtype=torch.int64, device=hidden.device)
    compute_grad = torch.is_grad_enabled() and (
        hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    )
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, int(chunk_size), compute_grad)


def plain_cross_entropy(hidden, weight, targets, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path: the full logits, fp32 cross-entropy (sum) and top-1 hits."""
    logits = F.linear(hidden, weight, bias).float()
    loss = F.cross_entropy(logits, targets, reduction="sum")
    correct = (logits.detach().argmax(-1) == targets).sum()
    return loss, correct


def _liger_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:
        return False
    return True


def resolve_fused_loss(choice: str, device: torch.device) -> str:
    """``auto`` -> ``liger`` on CUDA with liger-kernel installed, else ``chunked``."""
    if choice not in FUSED_LOSS_CHOICES:
        raise ValueError(f"fused_loss must be one of {FUSED_LOSS_CHOICES}, got {choice!r}")
    if choice == "auto":
        return "liger" if _liger_available(device) else "chunked"
    if choice == "liger" and not _liger_available(device):
        raise ValueError("fused_loss='liger' needs a CUDA device and `pip install liger-kernel`; use 'chunked' instead")
    return choice


def linear_cross_entropy(hidden, weight, targets, bias=None, *, impl: str = "chunked", chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Dispatch to ``chunked`` / ``liger`` / ``none`` (plain). Returns ``(loss_sum, correct)``."""
    if impl == "chunked":
        return chunked_cross_entropy(hidden, weight, targets, bias, chunk_size=chunk_size)
    if impl == "none":
        return plain_cross_entropy(hidden, weight, targets, bias)
    if impl == "liger":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        out = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, targets, bias, None, -100, 0.0, 0.0, "sum")
        loss = out[0] if isinstance(out, tuple) else out
        # Liger does not return the logits: token accuracy is not available on this path
        return loss.float(), torch.full((), -1, dtype=torch.int64, device=hidden.device)
    raise ValueError(f"unknown cross-entropy implementation {impl!r}")
