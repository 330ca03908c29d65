"""The model's own training objective, computed at the supervised positions of a packed row only.

A transformers causal LM turns its last hidden state into logits with its output-embeddings module (``lm_head``)
and, for some families, a fixed post-processing: Granite divides by ``logits_scaling``, Cohere multiplies by
``logit_scale``, Gemma 2/3 soft-cap with ``final_logit_softcapping`` (read from the config exactly as TRL's fused LM
head reads them: :func:`head_transform_from_config`). pf-trl computes the loss through one of three paths, chosen by
:func:`plan_head` and never silently different from the model's own logits:

- ``linear``: the head is a plain ``nn.Linear`` (biased or not, tied or not). On a Triton device (CUDA, XPU) TRL's
  chunked log-prob kernel (``trl.kernels.ChunkedLogProbFunction``, the kernel of TRL's own fused LM head) applies
  scale and softcap in fp32 and never builds the ``[tokens, vocab]`` logits; its backward recomputes each tile, so no
  ``[vocab, hidden]`` gradient buffer is kept from forward to backward, and it accumulates the GEMMs in fp32
  explicitly (no in-place op under autocast). Under DeepSpeed ZeRO-3 the head is read inside TRL's
  ``maybe_gather_lm_head_ctx``; an FSDP2 ``DTensor`` head is gathered once. Elsewhere (CPU), where that kernel falls
  back to torch ops on ``[4096, 32768]`` fp32 tiles, the head is applied to token chunks under activation
  checkpointing instead (the same FLOPs, less than half the peak memory: ``benchmarks/loss_memory.py``); a ZeRO-3
  partitioned head is then called as a module, whose hooks gather it (also for the recompute in backward).
- ``module``: any other head module (a PEFT LoRA/DoRA wrapper on ``lm_head``, a head with a projection) or label
  smoothing: the head *module* is called on chunks of supervised positions under activation checkpointing, then the
  config transform is applied. Adapters get their gradients; the peak is one chunk of fp32 logits.
- ``model``: the head probe (:func:`probe_head`) found that the model's logits are not ``transform(head(hidden))``:
  the model's own forward is run with ``logits_to_keep`` = the supervised positions, so its own head and
  post-processing produce the logits (``[supervised, vocab]`` at once: more memory, the same loss).

Per-token terms then give the TRL objective: ``nll`` (``-log p(target)``), ``dft`` (``nll * p(target)``, the weight
detached, as TRL), and label smoothing as transformers' ``LabelSmoother`` (``(1 - eps) * nll + eps * mean_v(-log p_v)``).
:func:`router_aux_loss` is the MoE load-balancing loss over the real tokens of the row.

:func:`install_pf_loss_forward` puts all of it behind the model's own forward (``model(..., pf_loss=True)``), which is
how the trainer computes its loss; :func:`check_loss_options` refuses the loss options it cannot reproduce.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pf_trl.attention.precision import autocast_dtype, autocast_off
from pf_trl.batching.packing import IGNORE_INDEX, count_targets
from pf_trl.batching.packing import shift_labels as shift
from pf_trl.errors import ConfigError, ModelSupportError
from pf_trl.sharding import full_shape, gathered_forward, is_zero3_partitioned

__all__ = [
    "FUSED_LOSS_CHOICES",
    "LOSS_TYPES",
    "HeadPlan",
    "LossTerms",
    "PFLossOptions",
    "aligned_supervised_positions",
    "check_loss_options",
    "head_transform_from_config",
    "install_pf_loss_forward",
    "plan_head",
    "probe_head",
    "resolve_fused_loss",
    "router_aux_loss",
    "supervised_loss_terms",
    "supervised_positions",
]

logger = logging.getLogger("pf_trl.trainer")  # the loss path is chosen while the trainer is built

FUSED_LOSS_CHOICES = ("auto", "chunked", "liger", "none")
LOSS_TYPES = ("nll", "dft")
DEFAULT_CHUNK_SIZE = 1024
# vocabulary columns per tile of TRL's kernel: the value TRL's fused LM head uses (trl.trainer.utils)
VOCAB_CHUNK = 32768


# ------------------------------------------------------------------------------------------- positions


def supervised_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices of the hidden rows that predict a supervised token, and those tokens.

    ``labels`` is ``[B, T]`` (a packed row has ``B == 1``). Row ``b * T + t`` of the flattened hidden states predicts
    ``labels[b, t + 1]``; it is kept when that label is not -100. Kept outside the model's layers and small on
    purpose: it is the one data-dependent gather of the loss.
    """
    return aligned_supervised_positions(labels[:, 1:], width=labels.shape[1])


def aligned_supervised_positions(shift_labels: torch.Tensor, *, width: int | None = None):
    """:func:`supervised_positions` for labels already aligned with the positions that predict them
    (``shift_labels[b, t]`` is the target of hidden row ``b * width + t``; sequence parallelism shifts the whole row
    before cutting it, so the targets across a rank border survive)."""
    keep = shift_labels != IGNORE_INDEX
    b, t = keep.nonzero(as_tuple=True)
    index = b * (shift_labels.shape[1] if width is None else width) + t
    return index, shift_labels[keep]


# ------------------------------------------------------------------------------------------- the head


def head_transform_from_config(config) -> tuple[float, float | None]:
    """``(logit_scale, final_logit_softcapping)`` of a causal LM config, read as TRL's ``add_fused_lm_head`` reads them.

    Cohere ``logit_scale`` (and ``output_multiplier`` / ``lm_head_multiplier``) multiply the logits; Granite and
    MiniCPM3 divide them by ``logits_scaling`` (HyperCLOVA X multiplies); Gemma 2/3 soft-cap after scaling.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if getattr(text, "model_type", None) == "hyperclovax" else 1.0 / text.logits_scaling
    return (1.0 if scale is None else float(scale)), (None if softcap is None else float(softcap))


def apply_head_transform(logits: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scale * logits / softcap)`` (each part only when set): the model's post-processing."""
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _is_plain_linear(module) -> bool:
    return type(module) is torch.nn.Linear


@dataclass
class HeadPlan:
    """How the loss reaches the logits: ``path`` (linear | module | model), the transform, and why; ``probe`` is the
    head probe's relative difference (:func:`probe_head`; ``None`` when it did not run)."""

    path: str
    scale: float = 1.0
    softcap: float | None = None
    reason: str = ""
    probe: float | None = None


def backbone_of(model) -> torch.nn.Module:
    """The module that maps ids to the last hidden state: ``model.base_model``, or, where that is the model itself
    (Llama 4, Mllama: ``base_model_prefix`` names a sub-model that is absent), its ``model`` attribute.

    Raises :class:`~pf_trl.errors.ModelSupportError` (a ``ValueError``) when there is none, so the trainer refuses the model instead of crashing later."""
    backbone = model.base_model
    if backbone is model:
        inner = getattr(model, "model", None)
        if isinstance(inner, torch.nn.Module) and inner is not model:
            return inner
        raise ModelSupportError(
            f"pf-trl cannot find the backbone of {type(model).__name__} (base_model_prefix "
            f"{model.base_model_prefix!r} names no sub-module), so it cannot compute the loss at the supervised "
            "positions only; train it padded (padding_free=False)"
        )
    return backbone


def probe_head(model, scale: float, softcap: float | None, *, length: int = 8, seed: int = 0) -> float | None:
    """Max relative difference between the model's own logits and ``transform(head(base_model(ids)))``.

    A short eval-mode forward (no grad) of the model and of its backbone, as the loss path calls it; under DeepSpeed
    ZeRO-3 each module gathers its partitions for its forward (:func:`pf_trl.sharding.gathered_forward`). ``None``
    when it cannot run (parameters on the meta device).
    """
    params = list(model.parameters())
    if not params or any(p.device.type == "meta" for p in params):
        return None
    head = model.get_output_embeddings()
    backbone = backbone_of(model)
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 0) or full_shape(head.weight)[0])
    device = params[0].device
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed)).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), gathered_forward(model):
            logits = model(input_ids=ids, use_cache=False).logits.float()
            # the backbone called as the pf-trl loss path calls it (a forward hook would miss models whose forward
            # calls an inner module of the backbone directly, e.g. OPT's decoder)
            hidden = backbone(input_ids=ids, use_cache=False).last_hidden_state
            if head_in_features(head) not in (None, hidden.shape[-1]):
                return math.inf  # a transform maps the hidden state to the head's width first (Electra): not linear
            mine = apply_head_transform(head(hidden), scale, softcap).float()
    finally:
        model.train(was_training)
    return float((logits - mine).abs().max() / logits.abs().max().clamp(min=1e-6))


def head_in_features(head) -> int | None:
    """The width the head's vocabulary projection reads (``None`` when it has no 2-D weight to tell)."""
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(full_shape(weight)[1])
    return None


def plan_head(model, *, label_smoothing: float = 0.0, probe: bool = True) -> HeadPlan:
    """Choose the loss path for ``model`` (linear | module | model, see the module docstring).

    Raises :class:`~pf_trl.errors.ModelSupportError` (a ``ValueError``) when none reproduces the model's logits."""
    head = model.get_output_embeddings()
    if head is None:
        raise ModelSupportError(f"{type(model).__name__} has no output embeddings (lm_head): pf-trl cannot compute its loss")
    scale, softcap = head_transform_from_config(model.config)
    diff = probe_head(model, scale, softcap) if probe else None
    plan = _plan_from_probe(model, head, scale, softcap, diff, label_smoothing)
    plan.probe = diff
    return plan


def _plan_from_probe(model, head, scale: float, softcap: float | None, diff: float | None,
                     label_smoothing: float) -> HeadPlan:
    if diff is not None:
        dtype = next(model.parameters()).dtype
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        if diff > tolerance:
            if not _accepts_logits_to_keep(model):
                raise ModelSupportError(
                    f"pf-trl cannot reproduce the logits of {type(model).__name__} (its forward post-processes the "
                    f"head output in a way pf-trl does not know: relative difference {diff:.3g}), and its forward has "
                    "no logits_to_keep to run its own head on the supervised positions only. Train it with "
                    "padding_free=False (padded)."
                )
            what = ("its head does not read the last hidden state as it is (a transform before the vocabulary "
                    "projection)" if math.isinf(diff) else
                    f"the model's logits differ from transform(lm_head(hidden)) by {diff:.3g}")
            return HeadPlan("model", scale, softcap,
                            f"{what}: its own forward computes the logits at the supervised positions (logits_to_keep)")
    if not _is_plain_linear(head):
        return HeadPlan("module", scale, softcap, f"the head is a {type(head).__name__}: it is called chunk by chunk")
    if label_smoothing > 0:
        return HeadPlan("module", scale, softcap, "label smoothing needs the whole log-softmax: chunked head module")
    return HeadPlan("linear", scale, softcap, "plain linear head: TRL's chunked log-prob kernel")


def _accepts_logits_to_keep(model) -> bool:
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------------- per-token terms


@dataclass
class LossTerms:
    """Per supervised token: ``nll`` (differentiable), ``smooth`` (``sum_v -log p_v``, when asked), ``top1`` (bool,
    the target is the first argmax) and ``entropy`` (of the predicted distribution, detached: TRL's ``entropy``
    metric; None where the path does not compute it). Float terms are in :func:`loss_dtype` of the logits."""

    nll: torch.Tensor
    top1: torch.Tensor
    smooth: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is accumulated in: float32, or the model's own dtype when it is wider (float64)."""
    return dtype if dtype == torch.float64 else torch.float32


def _terms_from_logits(logits: torch.Tensor, targets: torch.Tensor, with_smooth: bool):
    logp = torch.log_softmax(logits.to(loss_dtype(logits.dtype)), dim=-1)
    nll = -logp.gather(1, targets[:, None]).squeeze(1)
    top1 = logits.detach().argmax(-1) == targets
    smooth = -logp.sum(-1) if with_smooth else None
    with torch.no_grad():  # a metric: no gradient, no graph
        entropy = -(logp.exp() * logp).sum(-1)
    return nll, top1, smooth, entropy


def _chunk_terms(head, weight, bias, scale, softcap, with_smooth, hidden, targets):
    # a plain linear head is applied functionally (its weight possibly gathered from FSDP2 shards), any other head
    # module is called as the model calls it
    logits = head(hidden) if weight is None else F.linear(hidden, weight, bias)
    # the head's matmul in the model's precision (autocast's dtype under autocast, as the model runs its head), the
    # transform and the log-softmax in the loss dtype (float32)
    logits = logits.to(loss_dtype(logits.dtype))
    return _terms_from_logits(apply_head_transform(logits, scale, softcap), targets, with_smooth)


def _gather_ctx(weight, bias):
    try:
        from trl.trainer.utils import maybe_gather_lm_head_ctx
    except ImportError:  # pragma: no cover - TRL without ZeRO-3 support
        return nullcontext()
    return maybe_gather_lm_head_ctx(weight, bias)


def _full_weight(head):
    from torch.distributed.tensor import DTensor

    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor):  # FSDP2 shards the head: gather it once for the chunk loop
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    return weight, bias


def _fused_terms(head, hidden, targets, scale, softcap, vocab_chunk) -> LossTerms:
    from trl.kernels import ChunkedLogProbFunction

    weight, bias = _full_weight(head)
    with _gather_ctx(weight, bias):
        logprobs, entropy, _, _, top1 = ChunkedLogProbFunction.apply(
            hidden, weight, bias, targets, 1.0, int(vocab_chunk), softcap, scale, ("log_probs", "entropy", "is_top1")
        )
    return LossTerms(nll=-logprobs, top1=top1, entropy=entropy.detach())


def _module_terms(head, hidden, targets, scale, softcap, chunk_size, with_smooth, checkpointed,
                  linear: bool = False) -> LossTerms:
    from torch.utils.checkpoint import checkpoint

    weight, bias = _full_weight(head) if linear else (None, None)
    parts = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, t = hidden[start:start + chunk_size], targets[start:start + chunk_size]
        args = (head, weight, bias, scale, softcap, with_smooth, h, t)
        if checkpointed and torch.is_grad_enabled():
            # recompute the chunk's logits in backward: one chunk of [chunk, vocab] alive at a time
            parts.append(checkpoint(_chunk_terms, *args, use_reentrant=False))
        else:
            parts.append(_chunk_terms(*args))
    nll = torch.cat([p[0] for p in parts])
    top1 = torch.cat([p[1] for p in parts])
    smooth = torch.cat([p[2] for p in parts]) if with_smooth else None
    return LossTerms(nll=nll, top1=top1, smooth=smooth, entropy=torch.cat([p[3] for p in parts]).detach())


# logits of one token chunk on the CPU path: at most this many elements (128 MB in float32), whatever the vocabulary
LOGITS_CHUNK_ELEMENTS = 1 << 25


def chunk_tokens(chunk_size: int, vocab: int) -> int:
    """Supervised tokens per chunk: at most ``chunk_size``, and at most :data:`LOGITS_CHUNK_ELEMENTS` logits."""
    return max(1, min(int(chunk_size), LOGITS_CHUNK_ELEMENTS // max(1, int(vocab))))


class _LinearTokenChunks(torch.autograd.Function):
    """Per-token terms of ``transform(hidden @ W.T + b)`` for a plain linear head, one token chunk at a time.

    Nothing of size ``[chunk, vocab]`` is kept between forward and backward (the backward recomputes each chunk's
    logits), and the weight gradient of all chunks accumulates into one ``[vocab, hidden]`` buffer, in place: the
    generic autograd of a chunk (``F.linear`` + ``log_softmax`` + ``gather``) allocated a new ``[vocab, hidden]``
    gradient per chunk plus three ``[chunk, vocab]`` buffers in its backward (the extra ~0.8 GB peak on a tied
    262k-vocabulary head). The projection runs in the model's precision (the autocast dtype under autocast, as the
    model's own head and TRL's kernel run it; recorded for the backward, which autocast does not reach), everything
    after it in :func:`loss_dtype` of the weight, with autocast off.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, chunk, with_smooth):
        mm = autocast_dtype(hidden.device.type) or weight.dtype
        with autocast_off(hidden.device.type):
            return _LinearTokenChunks._forward(ctx, mm, hidden, weight, bias, targets, scale, softcap, chunk,
                                               with_smooth)

    @staticmethod
    def _forward(ctx, mm, hidden, weight, bias, targets, scale, softcap, chunk, with_smooth):
        ct = loss_dtype(weight.dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        w, b = weight.to(mm), None if bias is None else bias.to(mm)
        nll = torch.empty(n, dtype=ct, device=hidden.device)
        smooth = torch.empty(n, dtype=ct, device=hidden.device) if with_smooth else None
        top1 = torch.empty(n, dtype=torch.bool, device=hidden.device)
        entropy = torch.empty(n, dtype=ct, device=hidden.device)
        for s in range(0, n, chunk):
            t = targets[s:s + chunk]
            y = apply_head_transform(F.linear(hidden[s:s + chunk].to(mm), w, b).to(ct), scale, softcap)
            lse = torch.logsumexp(y, dim=-1)
            nll[s:s + chunk] = lse - y.gather(1, t[:, None]).squeeze(1)
            if with_smooth:
                smooth[s:s + chunk] = vocab * lse - y.sum(-1)
            top1[s:s + chunk] = y.argmax(-1) == t
            entropy[s:s + chunk] = lse - (torch.exp(y - lse[:, None]) * y).sum(-1)  # H = lse - E_p[y]
            del y
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.params = (scale, softcap, chunk, with_smooth, mm)
        ctx.mark_non_differentiable(top1, entropy)
        return nll, smooth, top1, entropy

    @staticmethod
    def backward(ctx, g_nll, g_smooth, _g_top1, _g_entropy):
        with autocast_off(ctx.saved_tensors[0].device.type):
            return _LinearTokenChunks._backward(ctx, g_nll, g_smooth)

    @staticmethod
    def _backward(ctx, g_nll, g_smooth):
        hidden, weight, bias, targets = ctx.saved_tensors
        scale, softcap, chunk, with_smooth, mm = ctx.params
        w, b = weight.to(mm), None if bias is None else bias.to(mm)
        ct = loss_dtype(weight.dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulation for half-precision weights (as TRL's kernel); one buffer for every chunk
        grad_w = torch.zeros(weight.shape, dtype=ct, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=ct, device=bias.device) if (need_b and bias is not None) else None
        for s in range(0, n, chunk):
            h, t = hidden[s:s + chunk], targets[s:s + chunk]
            rows = torch.arange(t.shape[0], device=t.device)
            z = F.linear(h.to(mm), w, b).to(ct)
            y = apply_head_transform(z, scale, softcap)
            # d/dy of nll = softmax - onehot(target); of smooth (sum_v -log p_v) = vocab * softmax - 1
            gy = torch.softmax(y, dim=-1)
            coef = g_nll[s:s + chunk] if g_nll is not None else torch.zeros(t.shape[0], dtype=ct, device=y.device)
            if with_smooth and g_smooth is not None:
                gs = g_smooth[s:s + chunk]
                gy.mul_((coef + vocab * gs)[:, None]).sub_(gs[:, None])
            else:
                gy.mul_(coef[:, None])
            gy[rows, t] -= coef
            if softcap is not None:  # y = softcap * tanh(scale * z / softcap): dy/dz = scale * (1 - (y / softcap)^2)
                gy.mul_(1.0 - (y / softcap) ** 2).mul_(scale)
            elif scale != 1.0:
                gy.mul_(scale)
            del y, z
            if need_h:
                grad_h[s:s + chunk] = (gy.to(mm) @ w).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(gy.t(), h.to(ct))
            if grad_b is not None:
                grad_b += gy.sum(0)
        if grad_w is not None and grad_w.dtype != weight.dtype:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None and grad_b.dtype != bias.dtype:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _linear_chunk_terms(head, hidden, targets, scale, softcap, chunk_size, with_smooth) -> LossTerms:
    weight, bias = _full_weight(head)
    chunk = chunk_tokens(chunk_size, weight.shape[0])
    nll, smooth, top1, entropy = _LinearTokenChunks.apply(hidden, weight, bias, targets, scale, softcap, chunk,
                                                          with_smooth)
    return LossTerms(nll=nll, top1=top1, smooth=smooth, entropy=entropy)


def _triton_device(device: torch.device) -> bool:
    try:
        from trl.kernels.chunked_logprob import _use_triton
    except ImportError:  # pragma: no cover
        return False
    return bool(_use_triton(device))


def supervised_loss_terms(head, hidden, targets, plan: HeadPlan, *, impl: str = "chunked",
                          chunk_size: int = DEFAULT_CHUNK_SIZE, with_smooth: bool = False) -> LossTerms:
    """Per-token terms of the supervised positions ``hidden [N, H]`` -> ``targets [N]`` through ``head``.

    ``plan.path`` ``linear`` / ``module`` as in the module docstring (``model`` is handled by the caller, which
    already holds the logits: see :func:`terms_from_model_logits`). ``impl="none"`` computes the plain full logits of
    the supervised positions at once (the reference path); ``"liger"`` uses Liger's fused linear cross-entropy.
    """
    if hidden.shape[0] == 0:
        # an all-masked micro-batch: a differentiable zero that still reaches the backbone and every trainable head
        # parameter (DDP expects a gradient for each; the step's divisor counts the other micro-batches' tokens).
        # The head is called on the zero rows, not read: a ZeRO-3 head exists only inside its own forward.
        dtype = loss_dtype(hidden.dtype)
        touch = hidden.sum().to(dtype) * 0 + head(hidden).to(dtype).sum() * 0
        empty = hidden.new_zeros((0,), dtype=dtype) + touch
        return LossTerms(nll=empty, top1=torch.zeros(0, dtype=torch.bool, device=hidden.device),
                         smooth=empty if with_smooth else None, entropy=hidden.new_zeros((0,), dtype=dtype))
    if impl == "liger":
        return _liger_terms(head, hidden, targets, plan)
    # a ZeRO-3 head is partitioned outside its own forward: call the module (its hooks gather the weight, again for
    # the checkpointed recompute in backward, and reduce its gradient) instead of reading the weight
    linear = plan.path == "linear" and not is_zero3_partitioned(head.weight)
    if impl == "none":
        return _module_terms(head, hidden, targets, plan.scale, plan.softcap, hidden.shape[0], with_smooth, False,
                             linear)
    if linear and not with_smooth and _triton_device(hidden.device):
        return _fused_terms(head, hidden, targets, plan.scale, plan.softcap, VOCAB_CHUNK)
    # without Triton, TRL's kernel folds [4096, 32768] fp32 tiles in torch (5 GB peak for a 128k x 2048 head at 8k
    # tokens, benchmarks/loss_memory.py); recomputed token chunks cost the same FLOPs with less
    if linear:
        return _linear_chunk_terms(head, hidden, targets, plan.scale, plan.softcap, chunk_size, with_smooth)
    weight = getattr(head, "weight", None)  # an adapter wrapper exposes its base layer's weight
    vocab = weight.shape[0] if isinstance(weight, torch.Tensor) else int(getattr(head, "out_features", 0) or 0)
    chunk = chunk_tokens(chunk_size, vocab)
    return _module_terms(head, hidden, targets, plan.scale, plan.softcap, chunk, with_smooth, True, linear)


def terms_from_model_logits(logits: torch.Tensor, targets: torch.Tensor, *, with_smooth: bool = False) -> LossTerms:
    """Per-token terms from logits the model produced itself (the ``model`` path)."""
    nll, top1, smooth, entropy = _terms_from_logits(logits.reshape(-1, logits.shape[-1]), targets, with_smooth)
    return LossTerms(nll=nll, top1=top1, smooth=smooth, entropy=entropy)


def _liger_terms(head, hidden, targets, plan: HeadPlan) -> LossTerms:
    if plan.path != "linear" or plan.scale != 1.0 or plan.softcap is not None:
        raise ConfigError(
            "fused_loss='liger' (or use_liger_kernel) covers a plain linear head without logit scaling or "
            f"softcapping; this model's head needs {plan.reason!r}. Use fused_loss='chunked'."
        )
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    with _gather_ctx(head.weight, head.bias):  # ZeRO-3: Liger computes its gradients in the forward (as TRL does)
        out = LigerFusedLinearCrossEntropyFunction.apply(hidden, head.weight, targets, head.bias, None, IGNORE_INDEX,
                                                         0.0, 0.0, "none")
    nll = (out[0] if isinstance(out, tuple) else out).float()
    # Liger returns no logits: token accuracy is not available on this path
    return LossTerms(nll=nll, top1=torch.zeros_like(targets, dtype=torch.bool))


def objective_sum(terms: LossTerms, *, loss_type: str = "nll", label_smoothing: float = 0.0,
                  vocab_size: int | None = None) -> torch.Tensor:
    """Sum over the supervised tokens of TRL's per-token SFT loss (divide by the token count of the step)."""
    if loss_type == "dft":
        # DFT (https://huggingface.co/papers/2508.05629): each token's loss weighted by its detached probability
        return (terms.nll * torch.exp(-terms.nll).detach()).sum()
    if loss_type != "nll":
        raise ConfigError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if label_smoothing > 0:
        if terms.smooth is None or not vocab_size:
            raise ConfigError("label smoothing needs the smoothing term and the vocabulary size")
        # transformers' LabelSmoother: (1 - eps) * nll + eps * sum_v(-log p_v) / V, both over the same tokens
        return (1 - label_smoothing) * terms.nll.sum() + label_smoothing * terms.smooth.sum() / vocab_size
    return terms.nll.sum()


# ------------------------------------------------------------------------------------------- MoE aux loss


def router_aux_loss(model, router_logits, real_tokens: int | None, total_tokens: int) -> torch.Tensor | None:
    """The model's load-balancing loss over the real tokens of a packed row (``None`` if the model has none).

    A padded run passes its ``attention_mask`` so padding does not count; a packed row has no padding except
    pf-trl's optional ``pad_to_multiple_of`` tail, masked here the same way (``real_tokens`` first tokens are
    real). The function is the model's own module's ``load_balancing_loss_func``. A model whose module has none
    adds no load-balancing term to its loss even when it returns router logits (Llama 4: sigmoid routing, its
    config's ``router_aux_loss_coef`` unused), so neither does pf-trl.
    """
    module = sys.modules.get(type(model).__module__)
    func = getattr(module, "load_balancing_loss_func", None)
    if func is None:
        return None
    text = model.config.get_text_config()
    num_experts = getattr(model, "num_experts", None) or getattr(text, "num_local_experts", None) or text.num_experts
    top_k = getattr(model, "num_experts_per_tok", None) or text.num_experts_per_tok
    mask = None
    if real_tokens is not None and real_tokens < total_tokens:
        device = router_logits[0].device
        mask = (torch.arange(total_tokens, device=device) < real_tokens)[None].long()
    return func(router_logits, num_experts, top_k, mask)


# ------------------------------------------------------------------------------------------- choices


def _liger_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:
        return False
    return True


def resolve_fused_loss(choice: str, device: torch.device, *, use_liger_kernel: bool = False) -> str:
    """``auto`` -> ``liger`` when ``use_liger_kernel`` asks for it (CUDA + liger-kernel), else ``chunked``."""
    if choice not in FUSED_LOSS_CHOICES:
        raise ConfigError(f"fused_loss must be one of {FUSED_LOSS_CHOICES}, got {choice!r}")
    if choice == "auto":
        return "liger" if use_liger_kernel and _liger_available(device) else "chunked"
    if choice == "liger" and not _liger_available(device):
        raise ConfigError("fused_loss='liger' needs a CUDA device and `pip install liger-kernel`; use 'chunked' instead")
    return choice


# ------------------------------------------------------------------------------------------- the model's forward


@dataclass
class PFLossOptions:
    """What the ``pf_loss=True`` forward computes: the loss path (``impl``: chunked | none | liger), the token chunk of
    the ``module`` path, TRL's ``loss_type`` and the label smoothing factor."""

    impl: str = "chunked"
    chunk_size: int = DEFAULT_CHUNK_SIZE
    loss_type: str = "nll"
    label_smoothing: float = 0.0


def install_pf_loss_forward(model: torch.nn.Module, impl: str = "chunked", chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                            options: PFLossOptions | None = None, probe: bool = True) -> HeadPlan:
    """Give ``model.forward`` a ``pf_loss=True`` path: backbone -> supervised positions -> the model's own objective.

    Returns the :class:`HeadPlan` (how the logits are reproduced). The patched forward returns
    ``{"loss_sum", "num_tokens", "correct", "entropy_sum", "aux_loss"}``: the sum over supervised tokens of the
    per-token objective, their count, top-1 hits, the sum of the predicted distributions' entropies (TRL's ``entropy``
    metric; None on the Liger path), and the MoE load-balancing loss over the real tokens (``None`` unless the config
    sets ``output_router_logits``). Going through ``model.forward`` (not ``model.model``) keeps DDP/FSDP wrappers and
    ZeRO-3 hooks in the loop; other calls use the previous forward (generation is unchanged). ``model`` is the
    transformers model itself (PEFT's base model: adapters live inside its modules).
    """
    options = options or PFLossOptions(impl=impl, chunk_size=chunk_size)
    plan = plan_head(model, label_smoothing=options.label_smoothing, probe=probe)
    logger.info("pf-trl: loss path %s (%s)", plan.path, plan.reason)
    with_smooth = options.loss_type == "nll" and options.label_smoothing > 0
    text_config = model.config.get_text_config()
    vocab_size = int(getattr(text_config, "vocab_size", 0) or full_shape(model.get_output_embeddings().weight)[0])
    previous = model.forward
    backbone = backbone_of(model)

    @functools.wraps(type(model).forward)
    def forward(self, *args, pf_loss: bool = False, pf_real_tokens: int | None = None, **kwargs):
        if not pf_loss:
            return previous(*args, **kwargs)
        labels = kwargs.pop("labels", None)
        shift_labels = kwargs.pop("shift_labels", None)  # sequence parallel: targets already aligned (no shift)
        if (labels is None) == (shift_labels is None):
            raise ConfigError("the pf_loss forward needs exactly one of labels / shift_labels")
        kwargs.pop("num_items_in_batch", None)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        if plan.path == "model":
            # the model's own head and post-processing, only at the supervised positions
            keep = (shift_labels if shift_labels is not None else shift(labels)) != IGNORE_INDEX
            out = previous(*args, logits_to_keep=keep, **kwargs)
        else:
            out = backbone(*args, **kwargs)
        return _objective(self, out, labels, plan, options, with_smooth=with_smooth, vocab_size=vocab_size,
                          with_router=bool(kwargs.get("output_router_logits")), pf_real_tokens=pf_real_tokens,
                          shift_labels=shift_labels)

    model.forward = types.MethodType(forward, model)
    return plan


def check_loss_options(args) -> None:
    """Refuse the combinations of SFTTrainer loss options pf-trl cannot reproduce on packed rows, naming each (single
    fields are refused by :func:`pf_trl.trainer.parity.check_config`)."""
    loss_type = getattr(args, "loss_type", "nll")
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not supported with padding_free (supported: {', '.join(LOSS_TYPES)})")
    if loss_type == "dft" and getattr(args, "label_smoothing_factor", 0.0) > 0:
        raise ConfigError(
            "label_smoothing_factor with loss_type='dft': TRL applies no smoothing to the DFT loss (it would be ignored "
            "in silence). Set label_smoothing_factor=0 or loss_type='nll'."
        )
    liger_config = getattr(args, "liger_kernel_config", None) or {}
    if getattr(args, "use_liger_kernel", False) and args.fused_loss not in ("auto", "liger"):
        raise ConfigError(f"use_liger_kernel=True asks for Liger's fused cross-entropy, but fused_loss={args.fused_loss!r}")
    if liger_config.get("fused_linear_cross_entropy"):
        raise ConfigError('liger_kernel_config={"fused_linear_cross_entropy": True} replaces the model forward; use '
                         "fused_loss='liger' for Liger's fused cross-entropy on the supervised positions")


@torch.compiler.disable(reason="data-dependent gather of supervised positions and a chunk loop over them")
def _objective(model, out, labels, plan: HeadPlan, options: PFLossOptions, *, with_smooth: bool, vocab_size: int,
               with_router: bool, pf_real_tokens: int | None, shift_labels=None) -> dict[str, Any]:
    """The objective after the backbone (or the model's own head): runs eagerly under torch.compile (one intended
    graph break after the backbone), since the number of supervised tokens changes every step and a traced gather +
    chunk loop would recompile each step."""
    if shift_labels is not None:
        index, targets = aligned_supervised_positions(shift_labels)
        labels = shift_labels
    else:
        index, targets = supervised_positions(labels)
    if plan.path == "model":
        terms = terms_from_model_logits(out.logits, targets.to(out.logits.device), with_smooth=with_smooth)
    else:
        head = model.get_output_embeddings()
        hidden = out.last_hidden_state
        device = head.weight.device
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index.to(hidden.device)).to(device)
        terms = supervised_loss_terms(head, selected, targets.to(device), plan, impl=options.impl,
                                      chunk_size=options.chunk_size, with_smooth=with_smooth)
    router_logits = getattr(out, "router_logits", None)
    loss_sum = objective_sum(terms, loss_type=options.loss_type, label_smoothing=options.label_smoothing,
                             vocab_size=vocab_size)
    aux = None
    if with_router and router_logits is not None and len(router_logits) > 0:  # no MoE layer: no aux loss
        aux = router_aux_loss(model, router_logits, pf_real_tokens, labels.shape[-1])
    correct = terms.top1.sum() if options.impl != "liger" else torch.full((), -1, dtype=torch.int64)
    entropy_sum = None if terms.entropy is None else terms.entropy.detach().sum()
    return {"loss_sum": loss_sum, "num_tokens": targets.new_tensor(targets.numel()), "correct": correct,
            "entropy_sum": entropy_sum, "aux_loss": aux}


# ------------------------------------------------------------------------------------------- the trainer's divisor


def loss_divisor(trainer, num_items_in_batch, n_tok, device) -> torch.Tensor:
    """The loss divisor of a micro-batch: the step's supervised tokens (all ranks, divided by the world size since
    DDP averages gradients), or this micro-batch's when transformers passes none."""
    if num_items_in_batch is None:
        return n_tok.to(device).clamp(min=1)
    divisor = torch.as_tensor(num_items_in_batch, device=device).clamp(min=1)
    if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
        divisor = divisor / trainer.accelerator.num_processes
    return divisor


def custom_loss(trainer, model, inputs, return_outputs: bool, num_items_in_batch):
    """``compute_loss_func`` as TRL calls it: the model's own outputs (full logits of the packed ``[1, T]`` row,
    position_ids restarting per example) and the row's labels (-100 at each example's first token)."""
    labels = inputs["labels"]
    outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False)
    loss = trainer.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    args = trainer.args
    if args.average_tokens_across_devices and num_items_in_batch is not None and args.world_size > 1:
        loss = loss * trainer.accelerator.num_processes
    if not trainer.model.training:
        n_tok = int(count_targets(labels))
        trainer._pf_eval_add(loss.detach().float() * n_tok, n_tok)
    return (loss, outputs) if return_outputs else loss
