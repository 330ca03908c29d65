"""``enable_padding_free``: make a transformers causal LM attend packed rows as separate sequences.

Modes:

- ``"huggingface"``: keep the model's attention implementation and rely on transformers' native packed-sequence
  path (``position_ids`` restarting at 0, no ``attention_mask``; transformers >= 4.44). A self-check forward on a
  tiny packed input proves that the configured implementation really isolates the sequences, otherwise it raises.
  On transformers < 4.44 it switches to ``"internal"`` with a one-line notice.
- ``"internal"``: our own attention. With ``AttentionInterface`` (transformers >= 4.48) the model is switched to
  the registered ``pf_varlen`` implementation; without it (4.43-4.47) the attention modules are patched
  (:mod:`pf_trl.attention.legacy`). Both call :func:`pf_trl.attention.varlen_attention` with ``backend``.

In both modes a forward pre-hook closes the KV-cache hole: transformers skips its packed-sequence detection
whenever a cache exists, and most configs default to ``use_cache=True`` (train and eval alike), so a direct
``model(input_ids, position_ids=...)`` call silently lets the packed sequences see each other. On a packed
input the hook forces ``use_cache=False``, refuses a passed cache object, and refuses an ``attention_mask``.
``model.config`` is left untouched (so ``save_pretrained`` writes the user's config).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from pf_trl.attention import hf as _hf
from pf_trl.attention.dispatch import BACKENDS, backend_status
from pf_trl.attention.errors import (
    BackendUnavailableError,
    PackedAttentionMaskError,
    PaddingFreeError,
    UnsupportedModelError,
)

logger = logging.getLogger("pf_trl.attention")

MODES = ("huggingface", "internal")
# architectures covered by the model-level tests (padded vs packed loss and gradients)
VERIFIED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "granite")
# text decoders whose transformers code goes through AttentionInterface with standard rotary and plain causal /
# sliding-window masks; accepted on the registry path, guarded by the self-check
COMPATIBLE_MODEL_TYPES = (
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "granitemoe",
    "gemma",
    "gemma2",
    "phi3",
    "olmo",
    "olmo2",
    "starcoder2",
)
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
_STATE_ATTR = "_pf_padding_free"


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def native_packing_supported() -> bool:
    """transformers >= 4.44: packed ``position_ids`` are understood natively (flash-attn first)."""
    return _transformers_version() >= (4, 44)


# ------------------------------------------------------------------------------------------- model checks


def _find_key(obj: Any, needle: str, depth: int = 0) -> bool:
    if depth > 4:
        return False
    if isinstance(obj, dict):
        for key, value in obj.items():
            if needle in str(key).lower() or (isinstance(value, str) and needle in value.lower()):
                return True
            if _find_key(value, needle, depth + 1):
                return True
    return False


def _uses_mrope(config) -> bool:
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            configs.append(get_text())
        except Exception:
            pass
    for cfg in configs:
        for attr in ("rope_scaling", "rope_parameters"):
            if _find_key(getattr(cfg, attr, None), "mrope"):
                return True
    return False


def check_model_supported(model: torch.nn.Module, *, legacy: bool, allow_unverified: bool = False) -> str:
    """Raise :class:`UnsupportedModelError` unless pf-trl can make ``model`` padding-free; returns its model_type."""
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None:
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model (no .config)")
    cls_module = type(model).__module__
    if not cls_module.startswith("transformers."):
        raise UnsupportedModelError(
            f"{type(model).__name__} comes from custom code ({cls_module}); pf-trl only patches transformers' own "
            "model classes, whose attention it knows. Load the model without trust_remote_code if transformers "
            "ships the architecture."
        )
    model_type = getattr(config, "model_type", None)
    if _uses_mrope(config):
        raise UnsupportedModelError(
            f"{model_type} uses multimodal rotary position ids (mrope: 3 position streams per token); its positions "
            "do not restart per packed example, so pf-trl cannot make it padding-free. Train it padded."
        )
    if getattr(config, "vision_config", None) is not None or getattr(config, "audio_config", None) is not None:
        raise UnsupportedModelError(f"{model_type} is multimodal; pf-trl supports text-only causal LMs")
    allowed = LEGACY_TYPES() if legacy else VERIFIED_MODEL_TYPES + COMPATIBLE_MODEL_TYPES
    if model_type not in allowed:
        if legacy or not allow_unverified:
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({type(model).__name__}) is not an architecture pf-trl knows how to make "
                f"padding-free; supported: {', '.join(allowed)}."
                + ("" if legacy else " Pass allow_unverified=True to rely on the runtime self-check alone.")
            )
        logger.warning("pf-trl: %s is unverified; relying on the padding-free self-check", model_type)
    return model_type


def LEGACY_TYPES() -> tuple[str, ...]:
    from pf_trl.attention.legacy import LEGACY_MODEL_TYPES

    return LEGACY_MODEL_TYPES


# ---------------------------------------------------------------------------------------- forward pre-hook


def _is_packed(kwargs: dict) -> bool:
    cu = kwargs.get("cu_seq_lens_q")
    position_ids = kwargs.get("position_ids")
    mask = kwargs.get("attention_mask")
    if isinstance(cu, torch.Tensor):
        # flash kwargs come from a packing collator: decided without reading a value (a host sync, a graph break)
        return True
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return False
    valid = None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        valid = mask.to(torch.bool)[:, -position_ids.shape[-1] :]
    return _hf.rows_hold_several_segments(position_ids, valid)


def _cache_has_tokens(cache) -> bool:
    if cache is None:
        return False
    get_len = getattr(cache, "get_seq_length", None)
    if callable(get_len):
        try:
            return int(get_len()) > 0
        except Exception:
            return True
    return True


def _make_pre_hook(*, drop_flash_kwargs: bool):
    signatures: dict[type, inspect.Signature] = {}

    def hook(module, args, kwargs):
        if args:
            sig = signatures.get(type(module))
            if sig is None:
                sig = signatures[type(module)] = inspect.signature(module.forward)
            bound = sig.bind_partial(*args, **kwargs)
            kwargs = {}
            for name, value in bound.arguments.items():
                if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                    kwargs.update(value)
                else:
                    kwargs[name] = value
            args = ()
        # nothing to force or refuse (the common compiled call): skip the detection, which reads position_ids
        idle = kwargs.get("use_cache") is False and kwargs.get("attention_mask") is None and all(
            kwargs.get(name) is None for name in ("cache", "past_key_values"))
        packed = not idle and _is_packed(kwargs)
        if drop_flash_kwargs:  # transformers 4.43 forwards take no **kwargs: segments come from position_ids
            for name in FLASH_KWARGS:
                kwargs.pop(name, None)
        if packed:
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                raise PackedAttentionMaskError(
                    "attention_mask was passed together with packed position_ids (several sequences in one row): "
                    "transformers would let the packed sequences attend to each other. Padding-free batches carry "
                    "no attention_mask (PaddingFreeCollator emits none)."
                )
            for name in ("cache", "past_key_values"):
                if kwargs.get(name) is not None:
                    state = "holds past tokens" if _cache_has_tokens(kwargs[name]) else "was passed"
                    raise PaddingFreeError(
                        f"a KV cache ({name}) {state} with a packed batch; a cache cannot track packed sequences "
                        "and transformers skips its packed-sequence detection when one exists. Use use_cache=False."
                    )
            if kwargs.get("use_cache") is not False:
                kwargs["use_cache"] = False
        return args, kwargs

    return hook


# ------------------------------------------------------------------------------------------------ self-check


def _model_io_device(model: torch.nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None


def self_check(model: torch.nn.Module, *, lengths: tuple[int, int] = (6, 5), seed: int = 0) -> dict[str, float]:
    """Forward a tiny packed row and check that its second sequence is unaffected by the first.

    Compares the packed output of sequence B against B alone (``err``) and against B concatenated without a
    position restart (``leak``: what cross-example attention looks like). Raises :class:`PaddingFreeError` unless
    ``err <= 0.05 * leak`` (and ``leak`` is measurable).
    """
    device = _model_io_device(model)
    if device is None or device.type == "meta":
        logger.warning("pf-trl: padding-free self-check skipped (model has no materialized parameters)")
        return {}
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise UnsupportedModelError("cannot run the padding-free self-check: config has no vocab_size")
    la, lb = lengths
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (la + lb,), generator=g).to(device)
    pos_packed = torch.cat([torch.arange(la), torch.arange(lb)]).to(device)
    pos_joined = torch.arange(la + lb, device=device)

    def out(input_ids, position_ids):
        res = model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False)
        t = getattr(res, "logits", None)
        if t is None:
            t = res.last_hidden_state if hasattr(res, "last_hidden_state") else res[0]
        return t[0].float()

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            packed = out(ids, pos_packed)[la:]
            alone = out(ids[la:], pos_packed[la:])
            joined = out(ids, pos_joined)[la:]
    finally:
        model.train(was_training)
    err = float((packed - alone).abs().max())
    leak = float((joined - alone).abs().max())
    result = {"err": err, "leak": leak}
    if not torch.isfinite(packed).all():
        raise PaddingFreeError(f"padding-free self-check produced non-finite outputs ({result})")
    if leak < 1e-6:
        logger.warning("pf-trl: padding-free self-check inconclusive (model ignores context: %s)", result)
        return result
    if err > 0.05 * leak:
        impl = getattr(model.config, "_attn_implementation", None)
        raise PaddingFreeError(
            f"attention implementation {impl!r} does not isolate packed sequences on this model: the second of two "
            f"packed sequences differs from the same sequence alone by {err:.3g} (cross-example leak would be "
            f"{leak:.3g}). Use enable_padding_free(model, mode='internal')."
        )
    return result


# ------------------------------------------------------------------------------------------------ entry point


def _install_hooks(model: torch.nn.Module, *, drop_flash_kwargs: bool) -> None:
    state = getattr(model, _STATE_ATTR, None)
    if state:
        for handle in state.get("handles", ()):
            handle.remove()
    targets = [model]
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not model:
        targets.append(base)
    handles = [
        t.register_forward_pre_hook(_make_pre_hook(drop_flash_kwargs=drop_flash_kwargs), with_kwargs=True)
        for t in targets
    ]
    setattr(model, _STATE_ATTR, {"handles": handles})


def _check_backend(model: torch.nn.Module, backend: str) -> None:
    if backend == "auto":
        return
    if backend not in BACKENDS:
        raise ValueError(f"unknown varlen attention backend {backend!r}; choose one of {('auto', *BACKENDS)}")
    device = _model_io_device(model) or torch.device("cpu")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if device.type == "meta":
        return
    reason = backend_status(device, dtype)[backend]
    if reason is not None:
        from pf_trl.attention.dispatch import _module

        raise BackendUnavailableError(
            f"varlen attention backend {backend!r} is not available for this model ({device.type}/{dtype}): "
            f"{reason}. Install: {_module(backend).INSTALL_HINT}"
        )


def enable_padding_free(
    model: torch.nn.Module,
    mode: str = "huggingface",
    backend: str = "auto",
    *,
    allow_unverified: bool = False,
    check: bool = True,
) -> torch.nn.Module:
    """Make ``model`` attend packed rows (``position_ids`` restarting at 0) as separate sequences, in place.

    Args:
        model: a transformers causal LM (Llama, Mistral, Mixtral, Qwen2, Granite verified; see
            ``COMPATIBLE_MODEL_TYPES``).
        mode: ``"huggingface"`` (transformers' native path, self-checked) or ``"internal"`` (pf-trl's ``pf_varlen``).
        backend: varlen kernel for ``"internal"`` (``auto``, ``flash_attn``, ``torch_varlen``, ``flex``, ``sdpa``).
        allow_unverified: accept other transformers architectures that pass the self-check.
        check: run the self-check forward (two tiny sequences, eval mode, no grad). Always on in
            ``"huggingface"`` mode, where it is the only proof of isolation.

    Returns:
        the same model object.

    Raises:
        UnsupportedModelError, BackendUnavailableError, PaddingFreeError: instead of ever training with
        cross-example attention.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "huggingface" and backend != "auto":
        raise ValueError("backend selects pf-trl's own kernel and only applies to mode='internal'")
    legacy = not _hf.has_attention_interface()
    if mode == "huggingface" and not native_packing_supported():
        import transformers

        logger.warning(
            "pf-trl: transformers %s has no native padding-free attention (needs >= 4.44); using mode='internal'",
            transformers.__version__,
        )
        mode = "internal"
    check_model_supported(model, legacy=legacy and mode == "internal", allow_unverified=allow_unverified)

    if mode == "internal":
        _check_backend(model, backend)
        if legacy:
            from pf_trl.attention.legacy import patch_model

            if patch_model(model, backend) == 0:
                raise UnsupportedModelError(f"found no attention modules to patch in {type(model).__name__}")
        else:
            can_set = getattr(model, "_can_set_attn_implementation", None)
            if callable(can_set) and not can_set():
                raise UnsupportedModelError(
                    f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
                )
            _hf.register()
            model.set_attn_implementation(_hf.PF_VARLEN)
            if model.config._attn_implementation != _hf.PF_VARLEN:
                raise UnsupportedModelError(f"could not set attn_implementation='pf_varlen' on {type(model).__name__}")
            for module in model.modules():
                module._pf_varlen_backend = backend
            if not _hf.has_mask_interface():  # 4.48-4.52: models build their masks themselves
                from pf_trl.attention.legacy import _passthrough_causal_mask
                import types

                for module in model.modules():
                    if hasattr(type(module), "_update_causal_mask"):
                        module._update_causal_mask = types.MethodType(_passthrough_causal_mask, module)

    _install_hooks(model, drop_flash_kwargs=legacy)
    result = self_check(model) if (check or mode == "huggingface") else {}
    state = getattr(model, _STATE_ATTR)
    state.update(mode=mode, backend=backend, self_check=result)
    logger.info("pf-trl: padding-free enabled (mode=%s, backend=%s, self-check=%s)", mode, backend, result)
    return model
