"""The packed forward of preference training: the backbone on one packed row, the LM head on the scored tokens only.

TRL's DPOTrainer scores its padded ``[2n, L]`` batch with ``model(..., labels=labels, fused_lm_head=True)``
(``trl.trainer.utils.add_fused_lm_head``: per-token log-probabilities computed in vocabulary tiles, never the full
logits). :func:`install_packed_preference_forward` wraps that forward: when the batch carries its packed row (a
:class:`~pf_trl.trainer.packed.PackedRow` under :data:`~pf_trl.trainer.preference.collate.PACKED_ROW_KEY`, from
:class:`~pf_trl.trainer.preference.collate.PackedRowCollator`), the backbone runs the ``[1, T]`` row instead (no pad
token, ``position_ids`` restarting per sequence, varlen attention through :func:`pf_trl.attention.enable_padding_free`),
and the head scores only the predictions whose label TRL keeps (the completion tokens):

- on CPU, with a plain linear head (:func:`~pf_trl.trainer.dpo_head.cpu_head_refusal`), pf-trl's head
  :func:`~pf_trl.trainer.dpo_head.preference_head` computes TRL's fields from those hidden states, in the dtype TRL's
  head would project in at that moment (autocast's, else the hidden states'), and TRL's head is handed no position;
- otherwise TRL's own head scores them.

Either way TRL's forward runs as it always does (inside whatever autocast wraps the model, with its router loss):
only the backbone's last hidden state is narrowed (a forward hook on the backbone, for the duration of the call),
and the head is given the matching pre-shifted ``shift_labels`` (its documented input for pre-shifted labels).
Every per-token output (``log_probs``, ``entropy``, ``mean_logits``, ``is_top1``, ``log_sum_sq_probs``,
``label_mask``) is then placed at its position in TRL's ``[2n, L - 1]`` layout, zero elsewhere, exactly as TRL's head
leaves unscored positions. TRL's own loss and metric code then reads the tensors it reads in a padded run: the loss
types, ``ld_alpha``, WPO weighting, ``sft`` and every metric are TRL's code, unchanged.

Why only the scored tokens: on devices without Triton (CPU) TRL's head projects *every* position through the
``[vocab, hidden]`` matrix, prompt and padding included (its outputs there are zeroed afterwards), and for small and
mid-size models that projection (forward, and twice in the backward) is most of a step's work. A prompt token's
prediction contributes nothing to the loss, the metrics or any gradient, so leaving it out changes no value beyond
float32 rounding.

The first label of every packed sequence is never scored: with the causal shift it would be predicted from the
previous sequence's last token (TRL's padded rows never score a row's first token either).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from pf_trl.attention.precision import autocast_dtype
from pf_trl.batching.packing import IGNORE_INDEX
from pf_trl.errors import ConfigError, ModelSupportError
from pf_trl.trainer.dpo_config import LM_HEAD_KERNELS as HEADS
from pf_trl.trainer.dpo_head import cpu_head_refusal, preference_head
from pf_trl.trainer.loss import head_transform_from_config
from pf_trl.trainer.packed import PackedRow
from pf_trl.trainer.preference.collate import PACKED_ROW_KEY

__all__ = ["HEADS", "check_head_against_trl", "install_packed_preference_forward", "scored_predictions",
           "unpack_outputs"]

_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
_ATTR = "_pf_packed_preference_forward"
_FIELDS_ATTR = "_pf_head_fields"
_HEAD_ATTR = "_pf_head"


def scored_predictions(labels: torch.Tensor, row: PackedRow) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next-token predictions TRL's head scores in the padded ``labels`` (``[2n, L]``, ``-100`` where TRL does
    not score): for each, its position in the packed row (the hidden state that predicts it), its position in TRL's
    shifted ``[2n, L - 1]`` outputs (flattened) and its target token id."""
    src, dst = row.shift_src, row.shift_dst
    # the target of packed position p is the token at p + 1 of the same sequence; token_index maps packed positions
    # to the flattened padded batch, where TRL's labels live
    targets = labels.reshape(-1).index_select(0, row.token_index.index_select(0, src + 1))
    keep = targets != IGNORE_INDEX
    return src[keep], dst[keep], targets[keep]


def unpack_outputs(outputs: Any, dst: torch.Tensor, rows: int, width: int) -> Any:
    """``outputs`` (a ``FusedCausalLMOutput`` whose per-token fields are ``[1, K]``, one per scored prediction) with
    every per-token field moved to TRL's ``[rows, width - 1]`` layout at the flattened positions ``dst`` (zeros
    elsewhere, as TRL's head leaves unscored positions)."""
    updates = {}
    for name in _PER_TOKEN:
        value = getattr(outputs, name, None)
        if value is None:
            continue
        target = value.new_zeros(rows * (width - 1))
        updates[name] = target.index_copy(0, dst, value.reshape(-1)).view(rows, width - 1)
    for name, value in updates.items():
        outputs[name] = value  # ModelOutput: sets the key and the attribute
    return outputs


def _trl_backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The module TRL's fused head calls for the last hidden state: ``base_model``, or ``model`` for a
    vision-language model on transformers < 5 (``add_fused_lm_head``'s rule)."""
    import transformers
    from packaging.version import Version

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = "base_model"
    if text is not config and Version(transformers.__version__) < Version("5.0.0"):
        name = "model"
    backbone = getattr(model, name, None)
    if not isinstance(backbone, torch.nn.Module) or backbone is model:
        # TRL's head would call the model itself for its hidden states: no packed (nor padded) run can work
        raise ModelSupportError(f"{type(model).__name__} has no separate backbone ({name} is the model itself), which "
                                "TRL's fused LM head needs; it cannot be trained with DPOTrainer")
    return backbone


@contextlib.contextmanager
def _narrowed(backbone: torch.nn.Module, positions: torch.Tensor, capture: dict[str, Any] | None) -> Iterator[None]:
    """While open, ``backbone``'s ``last_hidden_state`` ``[1, T, H]`` comes out narrowed for TRL's head: to the rows
    at ``positions`` (``[1, K, H]``, differentiable), or, with ``capture``, to no row at all, the ``K`` rows then
    stored in ``capture["hidden"]`` for pf-trl's head together with ``capture["matmul_dtype"]``, the dtype TRL's head
    would project in at that moment (autocast's, else the hidden states')."""

    def narrow(module, args, output):
        hidden = output.last_hidden_state
        if capture is None:
            output.last_hidden_state = hidden.index_select(1, positions)
            return output
        capture["hidden"] = hidden.index_select(1, positions)[0]
        capture["matmul_dtype"] = autocast_dtype(hidden.device.type) or hidden.dtype
        output.last_hidden_state = hidden[:, :0]
        return output

    handle = backbone.register_forward_hook(narrow)
    try:
        yield
    finally:
        handle.remove()


def _cpu_head_refusal(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why pf-trl's CPU head does not score this call (``None``: it does); TRL's own head scores it then."""
    if getattr(model, _HEAD_ATTR, "auto") == "trl":
        return "TRL's head was asked for"
    _, softcap = head_transform_from_config(model.config)
    if softcap == 0:
        return "final_logit_softcapping is 0 (TRL's kernel reads it as 1.0)"
    return cpu_head_refusal(model.get_output_embeddings(), device)


def _pf_head_outputs(model: torch.nn.Module, outputs: Any, capture: dict[str, Any], targets: torch.Tensor) -> Any:
    """TRL's head output of the call (it scored no position) with pf-trl's head's fields of the ``K`` scored
    predictions (``[1, K]``) in place of the empty ones; everything else (``aux_loss``) is TRL's."""
    head = model.get_output_embeddings()
    hidden = capture["hidden"].to(head.weight.device)
    scale, softcap = head_transform_from_config(model.config)
    values = preference_head(head, hidden, targets.to(hidden.device), scale=scale, softcap=softcap,
                             fields=getattr(model, _FIELDS_ATTR, ("log_probs",)), matmul_dtype=capture["matmul_dtype"])
    log_probs = values["log_probs"]
    for name, value in values.items():
        outputs[name] = value.unsqueeze(0)
    outputs["label_mask"] = torch.ones_like(log_probs, dtype=torch.bool).unsqueeze(0)
    # TRL's loss field: the mean negative log-likelihood of the scored tokens, plus its router loss if any
    loss = -log_probs.sum() / max(1, int(log_probs.numel()))
    if getattr(outputs, "aux_loss", None) is not None:
        loss = loss + getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) * outputs.aux_loss
    outputs["loss"] = loss
    return outputs


def _packed_call(model: torch.nn.Module, inner, kwargs: dict[str, Any], row: PackedRow):
    input_ids = kwargs.pop("input_ids")
    kwargs.pop("attention_mask", None)
    labels = kwargs.pop("labels")
    rows, width = input_ids.shape
    device = input_ids.device
    row = row.to(device)
    if row.input_ids is None:
        row = replace(row, input_ids=row.gather(input_ids).unsqueeze(0))
    src, dst, targets = scored_predictions(labels, row)
    # TRL's forward runs as always (under whatever autocast wraps it; its router loss) on the packed row; its head
    # sees the K scored positions, or none when pf-trl's head scores them
    capture = {} if _cpu_head_refusal(model, device) is None else None
    with _narrowed(_trl_backbone(model), src, capture):
        outputs = inner(shift_labels=(targets if capture is None else targets[:0]).unsqueeze(0), **row.model_kwargs(),
                        **kwargs)
    if capture is not None:
        outputs = _pf_head_outputs(model, outputs, capture, targets)
    return unpack_outputs(outputs, dst, rows, width)


def install_packed_preference_forward(model: torch.nn.Module, fields: tuple[str, ...] = ("log_probs",),
                                      head: str = "auto") -> torch.nn.Module:
    """Wrap ``model.forward`` (a transformers model TRL gave a fused LM head) so that a call with
    ``fused_lm_head=True`` and the packed row runs the row; any other call drops the row and runs the forward as it
    was (padded; e.g. the logits TRL recomputes for ``compute_metrics``).

    Args:
        fields: the per-token outputs TRL asked its head for (``add_fused_lm_head(outputs=...)``), which pf-trl's
            CPU head computes.
        head: ``"auto"``: pf-trl's CPU head (:mod:`pf_trl.trainer.dpo_head`) where it applies, else TRL's head;
            ``"trl"``: TRL's head always. Both score the completion tokens only.

    Idempotent (the latest ``fields`` and ``head`` count); returns ``model``."""
    if head not in HEADS:
        raise ConfigError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    setattr(model, _FIELDS_ATTR, tuple(fields))
    setattr(model, _HEAD_ATTR, head)
    if getattr(model, _ATTR, False):
        return model
    inner = model.forward

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        row = kwargs.pop(PACKED_ROW_KEY, None)
        if row is None or args or not kwargs.get("fused_lm_head") or kwargs.get("labels") is None:
            return inner(*args, **kwargs)
        return _packed_call(self, inner, kwargs, row)

    model.forward = types.MethodType(forward, model)
    setattr(model, _ATTR, True)
    return model


# relative tolerance of the head check: chunked float32 sums agree to ~1e-6; a lower-precision projection to its ulp
_CHECK_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}
_CHECKED_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits")


def check_head_against_trl(model: torch.nn.Module, *, positions: int = 8, seed: int = 0) -> float | None:
    """Check, once, that pf-trl's CPU head (:func:`~pf_trl.trainer.dpo_head.preference_head`, with the logit scale and
    soft-cap :func:`~pf_trl.trainer.loss.head_transform_from_config` reads) computes what TRL's fused head computes on
    this model: ``positions`` next-token predictions of a random sequence, TRL's forward (``fused_lm_head=True``)
    against pf-trl's head on the same backbone states, every float field the model's head was asked for.

    Returns the largest relative difference, or ``None`` when pf-trl's head does not score this model here (TRL's head
    does, so there is nothing to compare). Raises :class:`~pf_trl.errors.ModelSupportError` on a mismatch."""
    params = list(model.parameters())
    if not params or any(p.device.type == "meta" for p in params):
        return None
    device = params[0].device
    if _cpu_head_refusal(model, device) is not None:
        return None
    head = model.get_output_embeddings()
    # ids below 32000: the added tokens of vision-language models (image / video placeholders) sit above it
    vocab = min(int(head.weight.shape[0]), 32000)
    ids = torch.randint(0, vocab, (1, positions + 1), generator=torch.Generator().manual_seed(seed)).to(device)
    captured: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        hidden = output.last_hidden_state
        captured["hidden"] = hidden
        # the dtype TRL's head projects in here: autocast's where the model's forward runs under it (accelerate wraps
        # a prepared reference model's forward in the run's mixed precision), else the hidden states'
        captured["matmul_dtype"] = autocast_dtype(hidden.device.type) or hidden.dtype

    handle = _trl_backbone(model).register_forward_hook(keep)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            trl = model(input_ids=ids, labels=ids, fused_lm_head=True)  # no packed row: TRL's own forward and head
            scale, softcap = head_transform_from_config(model.config)
            mine = preference_head(head, captured["hidden"][0, :-1].to(head.weight.device), ids[0, 1:].to(
                head.weight.device), scale=scale, softcap=softcap, fields=getattr(model, _FIELDS_ATTR, ("log_probs",)),
                matmul_dtype=captured["matmul_dtype"])
    finally:
        handle.remove()
        model.train(was_training)
    rtol = _CHECK_RTOL.get(captured["matmul_dtype"], 2e-2)
    worst, field = 0.0, "log_probs"
    for name, value in mine.items():
        theirs = getattr(trl, name, None)
        if name not in _CHECKED_FIELDS or theirs is None:
            continue
        theirs = theirs[0].to(value.device, torch.float32)
        diff = float(((value - theirs).abs() / theirs.abs().clamp(min=1.0)).max())
        if diff > worst:
            worst, field = diff, name
    if worst > rtol:
        text = model.config.get_text_config()
        raise ModelSupportError(
            f"pf-trl's CPU LM head disagrees with TRL's fused head on model type "
            f"{getattr(text, 'model_type', type(model).__name__)!r} ({field}: relative difference {worst:.3g} > "
            f"{rtol:g}; pf-trl reads logit scale {scale:g}, soft-cap {softcap} from its config): set "
            "lm_head_kernel='trl' (--lm_head_kernel trl) to score with TRL's head, and report the model type to pf-trl")
    return worst
