"""The per-token scores of preference training on CPU: TRL's fused-LM-head outputs, computed in small token chunks.

TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) runs ``trl.kernels.ChunkedLogProbFunction``. On a
device without Triton (CPU) that kernel folds ``[4096, 32768]`` float32 tiles with a dozen torch passes each (the
transform multiplies by 1.0 twice, ``[tokens, vocab]`` boolean masks are built for the top-1 and target tests, the
backward fills a zero tile and copies it back), far outside the caches: in a DPO step of a small model that head is
about 80% of the time. :class:`PreferenceHeadFunction` computes the same fields (``log_probs``, ``entropy``,
``log_sum_sq_probs``, ``mean_logits``, ``is_top1``) from the same math, one chunk of about 256 tokens at a time,
with fused reductions (``logsumexp``, ``argmax``) and an in-place backward; it is about twice as fast there and never
holds more than a chunk of logits.

It covers the head TRL's DPOTrainer installs on CPU: a plain ``nn.Linear`` in float32 or float64, outside autocast,
with the config's logit scale and soft-cap (read as TRL reads them) and temperature 1.0 (TRL's DPOTrainer sets no
other). :func:`cpu_head_refusal` says when it does not apply; the caller then runs TRL's own head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["OUTPUT_FIELDS", "PreferenceHeadFunction", "chunk_tokens", "cpu_head_refusal", "preference_head"]

OUTPUT_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# logits of one token chunk: at most this many elements (32 MB in float32), so a chunk stays near the caches
_CHUNK_ELEMENTS = 1 << 23
_DTYPES = (torch.float32, torch.float64)


def cpu_head_refusal(head: torch.nn.Module | None, device: torch.device) -> str | None:
    """Why :func:`preference_head` does not apply to ``head`` on ``device`` (``None``: it applies)."""
    if device.type != "cpu":
        return f"device {device.type} runs TRL's kernel (Triton where available)"
    if type(head) is not torch.nn.Linear:
        return f"the output head is {type(head).__name__}, not a plain nn.Linear"
    if type(head.weight) is not torch.nn.Parameter or hasattr(head.weight, "ds_id"):
        return "the head's weight is sharded (DTensor / ZeRO-3)"
    if head.weight.dtype not in _DTYPES:
        return f"the head is {head.weight.dtype}; TRL's kernel rounds its tiles to that dtype"
    if torch.is_autocast_enabled("cpu"):
        return "autocast is on: TRL's kernel computes the projection in the autocast dtype"
    return None


def _transform(z: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    # TRL's order: scale, then soft-cap (temperature 1.0)
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of :func:`preference_head` at this vocabulary size (about 32 MB of float32 logits)."""
    return max(1, _CHUNK_ELEMENTS // max(1, vocab))


class PreferenceHeadFunction(torch.autograd.Function):
    """``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` of ``transform(hidden @ weight.T + bias)``
    at ``targets``, each ``[N]`` (``None`` for a field not in ``fields``); ``log_probs`` and ``entropy`` are
    differentiable, the others are not (as TRL's kernel marks them). The backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                scale: float, softcap: float | None, fields: tuple[str, ...], step: int):
        n, vocab = hidden.shape[0], weight.shape[0]
        new = {name: hidden.new_empty(n) for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")
               if name == "log_probs" or name in fields}
        is_top1 = torch.empty(n, dtype=torch.bool, device=hidden.device) if "is_top1" in fields else None
        lse = hidden.new_empty(n)
        for s in range(0, n, step):
            e = min(n, s + step)
            t = targets[s:e]
            y = _transform(F.linear(hidden[s:e], weight, bias), scale, softcap)
            lse[s:e] = torch.logsumexp(y, dim=-1)
            new["log_probs"][s:e] = y.gather(1, t[:, None]).squeeze(1) - lse[s:e]
            if "mean_logits" in new:
                new["mean_logits"][s:e] = y.sum(-1) / vocab
            if is_top1 is not None:  # argmax is the first maximum: a tie with an earlier token is not a top-1 (TRL)
                is_top1[s:e] = y.argmax(-1) == t
            if "entropy" in new or "log_sum_sq_probs" in new:
                p = torch.exp(y - lse[s:e, None])
                if "entropy" in new:  # H = lse - E_p[y]
                    new["entropy"][s:e] = lse[s:e] - (p * y).sum(-1)
                if "log_sum_sq_probs" in new:
                    new["log_sum_sq_probs"][s:e] = torch.log((p * p).sum(-1))
        entropy = new.get("entropy")
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if entropy is not None else lse)
        ctx.params = (scale, softcap, step)
        ctx.set_materialize_grads(False)  # entropy is usually logged only: no zero gradient to fold in
        frozen = [new.get("log_sum_sq_probs"), new.get("mean_logits"), is_top1]
        ctx.mark_non_differentiable(*(x for x in frozen if x is not None))
        return new["log_probs"], entropy, new.get("log_sum_sq_probs"), new.get("mean_logits"), is_top1

    @staticmethod
    def backward(ctx, g_logp, g_entropy, *_):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        scale, softcap, step = ctx.params
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if (need_b and bias is not None) else None
        if g_logp is None and g_entropy is None:
            return grad_h, grad_w, grad_b, None, None, None, None, None
        n = hidden.shape[0]
        for s in range(0, n, step):
            e = min(n, s + step)
            h = hidden[s:e]
            y = _transform(F.linear(h, weight, bias), scale, softcap)
            grad = _logit_grad(y, lse[s:e], targets[s:e], None if g_logp is None else g_logp[s:e],
                               None if g_entropy is None else (g_entropy[s:e], entropy[s:e]))
            if softcap is not None:  # y = c tanh(scale z / c): dy/dz = scale (1 - (y / c)^2)
                grad.mul_(1.0 - (y / softcap) ** 2)
            if scale != 1.0:
                grad.mul_(scale)
            del y
            if grad_h is not None:
                grad_h[s:e] = grad @ weight
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h)
            if grad_b is not None:
                grad_b += grad.sum(0)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _logit_grad(y: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g_logp: torch.Tensor | None,
                g_entropy: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """d(loss)/d(transformed logits) of one chunk: ``g_logp * (onehot - p) - g_H * p * (log p + H)``. Works in place
    on new buffers; ``y`` itself is kept (the soft-cap's derivative reads it)."""
    log_p = y - lse[:, None]
    if g_entropy is None:
        grad, term = log_p.exp_(), None  # p, in log_p's buffer
    else:
        g_h, h = g_entropy
        grad = torch.exp(log_p)
        term = log_p.add_(h[:, None]).mul_(grad).mul_(g_h[:, None])  # g_H * p * (log p + H), in log_p's buffer
    if g_logp is not None:
        grad.mul_(-g_logp[:, None])
        grad[torch.arange(targets.shape[0], device=targets.device), targets] += g_logp
    else:
        grad.zero_()
    if term is not None:
        grad.sub_(term)
    return grad


def preference_head(head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, *, scale: float = 1.0,
                    softcap: float | None = None, fields: tuple[str, ...] = ("log_probs",),
                    chunk: int | None = None) -> dict[str, torch.Tensor]:
    """TRL's fused-head fields of ``hidden [N, H]`` at ``targets [N]`` through ``head`` (a plain linear head, see
    :func:`cpu_head_refusal`): a dict of the fields in ``fields`` (``log_probs`` always), each ``[N]``. ``chunk``:
    tokens per chunk (default :func:`chunk_tokens` of the vocabulary)."""
    unknown = set(fields) - set(OUTPUT_FIELDS)
    if unknown:
        raise ValueError(f"unknown fused-head fields {sorted(unknown)}; known: {', '.join(OUTPUT_FIELDS)}")
    step = int(chunk) if chunk else chunk_tokens(head.weight.shape[0])
    values = PreferenceHeadFunction.apply(hidden, head.weight, head.bias, targets, float(scale), softcap,
                                          tuple(fields), step)
    return {name: value for name, value in zip(OUTPUT_FIELDS, values, strict=True) if value is not None}
