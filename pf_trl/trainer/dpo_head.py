"""The per-token scores of preference training on CPU: TRL's fused-LM-head outputs, computed in small token chunks.

TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) runs ``trl.kernels.ChunkedLogProbFunction``. On a
device without Triton (CPU) that kernel folds ``[4096, 32768]`` tiles with a dozen torch passes each (the transform
multiplies by 1.0 twice, ``[tokens, vocab]`` boolean masks are built for the top-1 and target tests, the backward
fills a zero tile and copies it back), far outside the caches: in a DPO step of a small model that head is about 80%
of the time. :class:`PreferenceHeadFunction` computes the same fields (``log_probs``, ``entropy``,
``log_sum_sq_probs``, ``mean_logits``, ``is_top1``) from the same math, one chunk of about 256 tokens at a time,
with few vectorized passes over each chunk and an in-place backward; it is about twice as fast there and never
holds more than a chunk of logits.

Precision is TRL's kernel's: the projection runs in the *matmul dtype* (autocast's dtype under autocast, else the
hidden states' dtype), the statistics in float32; the backward rounds the logits' gradient to the matmul dtype (TRL
writes it back into its tile) and accumulates both gradient GEMMs in float32 on float32 copies (TRL's CPU path).

It covers the head TRL's DPOTrainer installs, on CPU: a plain ``nn.Linear`` (not sharded), with the config's logit
scale and soft-cap (read as TRL reads them) and temperature 1.0 (TRL's DPOTrainer sets no other).
:func:`cpu_head_refusal` says when it does not apply; the caller then runs TRL's own head.
"""

from __future__ import annotations

import torch

from pf_trl.attention.precision import autocast_dtype, autocast_off
from pf_trl.errors import ConfigError

__all__ = ["OUTPUT_FIELDS", "PreferenceHeadFunction", "chunk_tokens", "cpu_head_refusal", "preference_head"]

OUTPUT_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
# logits of one token chunk: at most this many elements (32 MB in float32), so a chunk stays near the caches
_CHUNK_ELEMENTS = 1 << 23


def cpu_head_refusal(head: torch.nn.Module | None, device: torch.device) -> str | None:
    """Why :func:`preference_head` does not apply to ``head`` on ``device`` (``None``: it applies)."""
    if device.type != "cpu":
        return f"device {device.type} runs TRL's kernel (Triton where available)"
    if type(head) is not torch.nn.Linear:
        return f"the output head is {type(head).__name__}, not a plain nn.Linear"
    if type(head.weight) is not torch.nn.Parameter or hasattr(head.weight, "ds_id"):
        return "the head's weight is sharded (DTensor / ZeRO-3)"
    if not head.weight.is_floating_point():
        return f"the head's weight is {head.weight.dtype} (quantized?)"
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


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, scale: float,
            softcap: float | None) -> torch.Tensor:
    """float32 transformed logits of one chunk: ``h @ w.T (+ b)`` in ``w``'s dtype (the matmul dtype), then float32."""
    tile = torch.mm(h.to(w.dtype), w.t())
    if b is not None:
        tile.add_(b)
    return _transform(tile.float(), scale, softcap)


class PreferenceHeadFunction(torch.autograd.Function):
    """``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)`` of ``transform(hidden @ weight.T + bias)``
    at ``targets``, each ``[N]`` float32 (``None`` for a field not in ``fields``); ``log_probs`` and ``entropy`` are
    differentiable, the others are not (as TRL's kernel marks them). The backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                scale: float, softcap: float | None, fields: tuple[str, ...], step: int, mm: torch.dtype):
        with autocast_off(hidden.device.type):
            w, b = weight.to(mm), None if bias is None else bias.to(mm)
            n = hidden.shape[0]
            new = {name: hidden.new_empty(n, dtype=torch.float32) for name in OUTPUT_FIELDS[:4]
                   if name == "log_probs" or name in fields}
            is_top1 = torch.empty(n, dtype=torch.bool, device=hidden.device) if "is_top1" in fields else None
            lse = hidden.new_empty(n, dtype=torch.float32)
            for s in range(0, n, step):
                e = min(n, s + step)
                values = _chunk_fields(_logits(hidden[s:e], w, b, scale, softcap), targets[s:e], fields)
                lse[s:e] = values.pop("lse")
                for name, value in values.items():
                    (is_top1 if name == "is_top1" else new[name])[s:e] = value
        entropy = new.get("entropy")
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy if entropy is not None else lse)
        ctx.params = (scale, softcap, step, mm)
        ctx.set_materialize_grads(False)  # entropy is usually logged only: no zero gradient to fold in
        frozen = [new.get("log_sum_sq_probs"), new.get("mean_logits"), is_top1]
        ctx.mark_non_differentiable(*(x for x in frozen if x is not None))
        return new["log_probs"], entropy, new.get("log_sum_sq_probs"), new.get("mean_logits"), is_top1

    @staticmethod
    def backward(ctx, g_logp, g_entropy, *_):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grads = [torch.zeros_like(hidden) if need_h else None, torch.zeros_like(weight) if need_w else None,
                 torch.zeros_like(bias) if (need_b and bias is not None) else None]
        if g_logp is not None or g_entropy is not None:
            with autocast_off(hidden.device.type):
                grads = _backward(ctx, hidden, weight, bias, targets, lse, entropy, g_logp, g_entropy, grads)
        return (*grads, None, None, None, None, None, None)


def _backward(ctx, hidden, weight, bias, targets, lse, entropy, g_logp, g_entropy, grads):
    """The chunk loop of :meth:`PreferenceHeadFunction.backward`: float32 accumulators, cast back at the end."""
    scale, softcap, step, mm = ctx.params
    w, b = weight.to(mm), None if bias is None else bias.to(mm)
    w32 = w.float()  # the gradient GEMMs run in float32 on the matmul-dtype values (TRL's CPU path)
    grad_h, grad_w, grad_b = (None if g is None else g.float() for g in grads)
    n = hidden.shape[0]
    for s in range(0, n, step):
        e = min(n, s + step)
        h = hidden[s:e].to(mm)
        y = _logits(h, w, b, scale, softcap)
        # without a soft-cap, y is not read again: the gradient is built in its buffer
        grad = _logit_grad(y, lse[s:e], targets[s:e], None if g_logp is None else g_logp[s:e].float(),
                           None if g_entropy is None else (g_entropy[s:e].float(), entropy[s:e]), softcap is None)
        if softcap is not None:  # y = c tanh(scale z / c): dy/dz = scale (1 - (y / c)^2)
            grad.mul_(1.0 - (y / softcap) ** 2)
        if scale != 1.0:
            grad.mul_(scale)
        del y
        if mm != torch.float32:  # TRL stores the gradient in its matmul-dtype tile before the GEMMs
            grad = grad.to(mm).float()
        if grad_h is not None:
            grad_h[s:e] = grad @ w32
        if grad_w is not None:
            grad_w.addmm_(grad.t(), h.float())
        if grad_b is not None:
            grad_b += grad.sum(0)
    return [None if g is None else g.to(x.dtype) for g, x in zip((grad_h, grad_w, grad_b), (hidden, weight, bias))]


def _chunk_fields(y: torch.Tensor, targets: torch.Tensor, fields: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``lse``, ``log_probs`` and the requested fields of one chunk of transformed logits ``y [c, V]`` (float32).

    Written for few passes over ``y`` with vectorized reductions: ``amax`` then one ``exp`` (torch's ``logsumexp``
    and ``argmax`` each cost several times that on CPU)."""
    m = y.amax(-1)
    e = (y - m[:, None]).exp_()  # exp(y - max): the softmax's numerator
    total = e.sum(-1)
    lse = m + total.log()
    target = y.gather(1, targets[:, None]).squeeze(1)
    out = {"lse": lse, "log_probs": target - lse}
    if "mean_logits" in fields:
        out["mean_logits"] = y.sum(-1) / y.shape[1]
    if "entropy" in fields:  # H = lse - E_p[y]
        out["entropy"] = lse - (e * y).sum(-1) / total
    if "log_sum_sq_probs" in fields:  # log sum p^2, as TRL: log sum e^2 - 2 log sum e
        out["log_sum_sq_probs"] = (e * e).sum(-1).log() - 2 * total.log()
    if "is_top1" in fields:
        out["is_top1"] = _first_maximum(y, m, target, targets)
    return out


def _first_maximum(y: torch.Tensor, m: torch.Tensor, target: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Whether each target is the first maximum of its row (TRL's ``is_top1``: a tie with an earlier token is not
    a top-1). Only the rows whose target reaches the maximum are searched for an earlier tie."""
    top = target >= m
    rows = top.nonzero().squeeze(1)
    if rows.numel():
        before = torch.arange(y.shape[1], device=y.device) < targets[rows, None]
        top[rows] = ~((y[rows] == m[rows, None]) & before).any(-1)
    return top


def _logit_grad(y: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, g_logp: torch.Tensor | None,
                g_entropy: tuple[torch.Tensor, torch.Tensor] | None, in_place: bool) -> torch.Tensor:
    """d(loss)/d(transformed logits) of one chunk: ``g_logp * (onehot - p) - g_H * p * (log p + H)``, built in
    ``y``'s buffer when ``in_place`` (else ``y`` is kept: the soft-cap's derivative reads it)."""
    log_p = y.sub_(lse[:, None]) if in_place else y - lse[:, None]
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
                    chunk: int | None = None, matmul_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """TRL's fused-head fields of ``hidden [N, H]`` at ``targets [N]`` through ``head`` (a plain linear head, see
    :func:`cpu_head_refusal`): a dict of the fields in ``fields`` (``log_probs`` always), each ``[N]`` float32.

    Args:
        chunk: tokens per chunk (default :func:`chunk_tokens` of the vocabulary).
        matmul_dtype: the projection's dtype; default TRL's choice at this call: autocast's dtype under autocast,
            else ``hidden``'s dtype."""
    unknown = set(fields) - set(OUTPUT_FIELDS)
    if unknown:
        raise ConfigError(f"unknown fused-head fields {sorted(unknown)}; known: {', '.join(OUTPUT_FIELDS)}")
    step = int(chunk) if chunk else chunk_tokens(head.weight.shape[0])
    mm = matmul_dtype or autocast_dtype(hidden.device.type) or hidden.dtype
    values = PreferenceHeadFunction.apply(hidden, head.weight, head.bias, targets, float(scale), softcap,
                                          tuple(fields), step, mm)
    return {name: value for name, value in zip(OUTPUT_FIELDS, values, strict=True) if value is not None}
