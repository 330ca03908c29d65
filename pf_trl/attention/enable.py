"""``enable_padding_free``: make a transformers causal LM attend packed rows as separate sequences.

Modes:

- ``"huggingface"``: keep the model's attention implementation and rely on transformers' native packed-sequence
  path (``position_ids`` restarting at 0, no ``attention_mask``; transformers >= 4.44). A self-check forward on a
  tiny packed input proves that the configured implementation really isolates the sequences, otherwise it raises.
  With ``sdpa``, where transformers would build a dense ``T x T`` mask, packed rows are attended per segment
  instead (:mod:`pf_trl.attention.hf_sdpa`: memory linear in the row). On transformers < 4.44 it switches to
  ``"internal"`` with a one-line notice.
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

from pf_trl._compat import attn_implementation, can_set_attn_implementation, replace_causal_mask_builder

# siblings by their module path, never through the package's public face (pf_trl.attention re-exports this module)
import pf_trl.attention.hf as _hf
import pf_trl.attention.mrope as mrope
import pf_trl.attention.multimodal as multimodal
import pf_trl.attention.support as support
from pf_trl.attention.dispatch import BACKENDS, backend_status
from pf_trl.attention.stateful import prepare_stateful_layers
from pf_trl.attention.errors import (
    BackendUnavailableError,
    PackedAttentionMaskError,
    PaddingFreeError,
    UnsupportedModelError,
)
from pf_trl.sharding import gathered_forward

logger = logging.getLogger("pf_trl.attention")

MODES = ("huggingface", "internal")
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


def _with_text_config(config) -> list:
    """``config`` and, for a multimodal one, its text config (a config that cannot give one: itself only)."""
    configs = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            configs.append(get_text())
        except Exception:
            pass
    return configs


def _uses_mrope(config) -> bool:
    for cfg in _with_text_config(config):
        for attr in ("rope_scaling", "rope_parameters"):
            if _find_key(getattr(cfg, attr, None), "mrope"):
                return True
    return False


def check_model_supported(
    model: torch.nn.Module, *, legacy: bool, allow_unverified: bool = False, mode: str = "huggingface"
) -> str:
    """Raise :class:`UnsupportedModelError` unless pf-trl can make ``model`` padding-free; returns its model_type
    (see :func:`admit`)."""
    return admit(model, legacy=legacy, allow_unverified=allow_unverified, mode=mode)[0]


def admit(
    model: torch.nn.Module, *, legacy: bool, allow_unverified: bool = False, mode: str = "huggingface"
) -> tuple[str, str]:
    """Raise :class:`UnsupportedModelError` unless pf-trl can make ``model`` padding-free; returns its model_type
    and the decision (``"exact"``, or ``"unverified"``: no sweep evidence, the runtime self-check decides).

    Structural refusals first (custom code, multimodal, mrope, known layers: :mod:`pf_trl.attention.refusals`),
    then the coverage sweep's evidence (:func:`pf_trl.attention.support.decide`); the transformers < 4.48 patch
    keeps its own list.
    """
    config = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or config is None:
        raise UnsupportedModelError(f"{type(model).__name__} is not a transformers model (no .config)")
    cls_module = type(model).__module__
    custom = not cls_module.startswith("transformers.")
    if custom and legacy:  # the transformers < 4.48 patch knows its own list of transformers classes only
        raise UnsupportedModelError(
            f"{type(model).__name__} comes from custom code ({cls_module}); on this transformers pf-trl patches its "
            "own model classes only. Load the model without trust_remote_code if transformers ships the architecture."
        )
    model_type = getattr(config, "model_type", None)
    refusal = multimodal.structural_refusal(model, _uses_mrope(config))  # mRoPE and vision-language families
    if refusal is not None:
        raise UnsupportedModelError(refusal)
    from pf_trl.attention.refusals import mode_refusal

    refusal = None if legacy else mode_refusal(model, mode)
    if refusal is not None:
        raise UnsupportedModelError(refusal + ".")
    if custom:  # a repository's own code (trust_remote_code): no sweep evidence can speak for it
        logger.warning(
            "pf-trl: %s comes from custom code (%s, trust_remote_code): pf-trl's support matrix covers transformers' "
            "own classes only, so, as for a model type it does not list, the runtime self-check decides whether it "
            "trains padding-free (mode %s)", type(model).__name__, cls_module, mode)
        return model_type, "unverified"
    if legacy:
        if model_type not in LEGACY_TYPES():
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({type(model).__name__}) is not an architecture pf-trl knows how to make "
                f"padding-free on this transformers; supported: {', '.join(LEGACY_TYPES())}."
            )
        return model_type, "exact"
    return model_type, support.decide(model_type, type(model).__name__, mode, allow_unverified=allow_unverified)


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
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 3 and position_ids.shape[0] == 4:
        position_ids = position_ids[0]  # mRoPE: per-example text positions on top of the rotary streams
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


def _check_row_limit(model: torch.nn.Module, kwargs: dict, packed: bool) -> None:
    """Refuse a packed row longer than the model keeps exact (:mod:`pf_trl.attention.row_limits`); shapes only,
    unless the row is over the limit and its packing is not known yet."""
    limit = getattr(model, "_pf_row_limit", ())
    if limit == ():
        from pf_trl.attention.row_limits import packed_row_limit

        limit = packed_row_limit(model)
        model._pf_row_limit = limit
    if limit is None:
        return
    x = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[1] <= limit[0]:
        return
    cu = kwargs.get("cu_seq_lens_q")
    several = cu.numel() - 1 > x.shape[0] if isinstance(cu, torch.Tensor) else (packed or _is_packed(kwargs))
    if several:
        from pf_trl.attention.row_limits import check_packed_rows

        check_packed_rows(model, int(x.shape[1]))


def _make_pre_hook(*, drop_flash_kwargs: bool, mode: str = "huggingface"):
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
        # (a vision-language forward always goes on: its positions / image masks may need completing)
        idle = kwargs.get("use_cache") is False and kwargs.get("attention_mask") is None and all(
            kwargs.get(name) is None for name in ("cache", "past_key_values")) and not multimodal.needs_preparing(
            module, kwargs)
        packed = not idle and _is_packed(kwargs)
        _check_row_limit(module, kwargs, packed)
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
            multimodal.prepare_packed(module, kwargs, mode)  # mRoPE positions, Gemma 3 image masks (no-op for text)
        return args, kwargs

    return hook


# ------------------------------------------------------------------------------------------------ self-check


def _model_io_device(model: torch.nn.Module) -> torch.device | None:
    for p in model.parameters():
        return p.device
    return None


# largest difference between a packed example and the same example alone that is numerical noise, relative to the
# largest output magnitude (float32: ~170 ulp; half precisions: their rounding of a different reduction order)
SELF_CHECK_RTOL = {torch.float32: 2e-5, torch.float64: 1e-9, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def special_token_ids(config) -> set[int]:
    """Ids a random example must avoid (pad/bos/eos/image... tokens change what some models compute)."""
    ids: set[int] = set()
    for cfg in _with_text_config(config):
        for key, value in cfg.to_dict().items():
            if key.endswith(("_token_id", "_token_index", "token_id", "_index", "padding_idx")):
                if _is_token_id(value):
                    ids.add(value)
                elif isinstance(value, list):
                    ids.update(x for x in value if _is_token_id(x))
    return ids


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _safe_token_ids(config, vocab: int) -> torch.Tensor:
    avoid = special_token_ids(config)
    return torch.tensor([i for i in range(3, min(vocab, 4096)) if i not in avoid])


def self_check(model: torch.nn.Module, *, lengths: tuple[int, int] = (6, 5), seed: int = 0) -> dict[str, float]:
    """Forward two examples packed in one row and check each against the same example run alone.

    The packed row is what :class:`~pf_trl.batching.collator.PaddingFreeCollator` emits (``position_ids`` restarting at 0,
    ``cu_seq_lens``, no ``attention_mask``, no ``use_cache``: the forward pre-hook must close the KV-cache hole).
    Each example alone is run *without* ``position_ids``, i.e. with the model's own position convention, so a model
    that numbers positions differently (``padding_idx + 1``) fails. ``err`` (largest output difference) must stay
    within the noise of the parameters' dtype (:data:`SELF_CHECK_RTOL` x the output scale); ``leak`` (the second
    example with positions running on from the first) is reported for comparison. Raises
    :class:`PaddingFreeError` (a failure) or :class:`UnsupportedModelError` (the model fails on a packed row).
    """
    device = _model_io_device(model)
    if device is None or device.type == "meta":
        logger.warning("pf-trl: padding-free self-check skipped (model has no materialized parameters)")
        return {}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(getattr(text, "vocab_size", 0) or getattr(model.config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise UnsupportedModelError("cannot run the padding-free self-check: config has no vocab_size")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    la, lb = lengths
    pool = _safe_token_ids(model.config, vocab)
    g = torch.Generator().manual_seed(seed)
    ids = pool[torch.randint(0, len(pool), (la + lb,), generator=g)].to(device)
    pos_packed = torch.cat([torch.arange(la), torch.arange(lb)])[None].to(device)
    cu = torch.tensor([0, la, la + lb], dtype=torch.int32, device=device)
    packed_kwargs = dict(position_ids=pos_packed, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(),
                         max_length_q=max(la, lb), max_length_k=max(la, lb))

    def out(input_ids, **kwargs):
        res = model(input_ids=input_ids[None], **kwargs)
        t = getattr(res, "logits", None)
        if t is None:
            t = res.last_hidden_state if hasattr(res, "last_hidden_state") else res[0]
        return t[0].float()

    was_training = model.training
    model.eval()
    try:
        # under DeepSpeed ZeRO-3 (a model loaded after the config) each module gathers its partitions for its forward
        with torch.no_grad(), gathered_forward(model):
            packed = out(ids, **packed_kwargs)
            alone_a = out(ids[:la], use_cache=False)
            alone_b = out(ids[la:], use_cache=False)
            joined = out(ids, position_ids=torch.arange(la + lb, device=device)[None], use_cache=False)
    except PaddingFreeError:
        raise
    except Exception as exc:  # the packed forward itself fails: a refusal with its reason, never a crash later
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UnsupportedModelError(
            f"{type(model).__name__} fails on a packed row in pf-trl's self-check ({type(exc).__name__}: {first[:200]}); "
            "it cannot be trained padding-free. Train it padded (padding_free='none')."
        ) from exc
    finally:
        model.train(was_training)
    err = max(float((packed[:la] - alone_a).abs().max()), float((packed[la:] - alone_b).abs().max()))
    leak = float((joined[la:] - alone_b).abs().max())
    scale = max(1.0, float(alone_a.abs().max()), float(alone_b.abs().max()))
    tol = SELF_CHECK_RTOL.get(dtype, 2e-2) * scale
    result = {"err": err, "leak": leak, "tol": tol}
    if not torch.isfinite(packed).all():
        raise PaddingFreeError(f"padding-free self-check produced non-finite outputs ({result})")
    if err > tol:
        impl = attn_implementation(model.config)
        raise PaddingFreeError(
            f"padding-free self-check failed on {type(model).__name__} (attention {impl!r}): an example packed with "
            f"another differs from the same example alone by {err:.3g}, beyond the {dtype} noise ({tol:.2g}; "
            f"cross-example attention would give {leak:.3g}). {support.diagnose(model)}Train it padded "
            "(padding_free='none')."
        )
    if leak <= tol:
        logger.warning("pf-trl: padding-free self-check inconclusive (model ignores context: %s)", result)
    return result


# ------------------------------------------------------------------------------------------------ entry point


def _install_hooks(model: torch.nn.Module, *, drop_flash_kwargs: bool, mode: str = "huggingface") -> None:
    state = getattr(model, _STATE_ATTR, None)
    if state:
        for handle in state.get("handles", ()):
            handle.remove()
    targets = [model]
    base = getattr(model, "base_model", None)
    if isinstance(base, torch.nn.Module) and base is not model:
        targets.append(base)
    rope_index = mrope.rope_index_function(model)
    for t in targets:
        t._pf_rope_index = rope_index  # read by the pre-hook (multimodal.prepare_packed); None without mRoPE
    handles = [
        t.register_forward_pre_hook(_make_pre_hook(drop_flash_kwargs=drop_flash_kwargs, mode=mode), with_kwargs=True)
        for t in targets
    ]
    setattr(model, _STATE_ATTR, {"handles": handles})
    # recurrent / convolutional mixers (Mamba, gated delta nets, short convs...) restart their state per example
    prepare_stateful_layers(model, hook_targets=targets)


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


def _self_check_rerouted(model: torch.nn.Module) -> dict[str, float]:
    """``huggingface`` mode: sdpa models attend packed rows per segment (:mod:`pf_trl.attention.hf_sdpa`) instead of
    through transformers' dense ``T x T`` mask, when the self-check passes that way; else transformers' own path."""
    import pf_trl.attention.hf_sdpa as hf_sdpa

    reason = hf_sdpa.reroute_refusal(model)
    if reason is None and hf_sdpa.reroute(model):
        try:
            return self_check(model)
        except PaddingFreeError as exc:
            hf_sdpa.restore(model)
            reason = f"the per-segment path failed the self-check ({str(exc).splitlines()[0][:200]})"
    impl = attn_implementation(model.config)
    if impl in ("sdpa", "eager"):
        # sdpa that could not be rerouted deserves a warning; eager is the user's (or the model's only) choice
        (logger.warning if impl == "sdpa" else logger.info)(
            "pf-trl: %s keeps transformers' dense packed mask in huggingface mode (%s): attention memory grows with "
            "the square of the packed row; padding_free='internal' is memory-linear", type(model).__name__, reason)
    return self_check(model)


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
        model: a transformers causal LM whose type the coverage sweep found exact in ``mode`` (docs/models.md).
        mode: ``"huggingface"`` (transformers' native path, self-checked) or ``"internal"`` (pf-trl's ``pf_varlen``).
        backend: varlen kernel for ``"internal"`` (``auto``, ``flash_attn``, ``torch_varlen``, ``flex``, ``sdpa``).
        allow_unverified: accept a type the sweep has no evidence for (unknown, unbuilt), on the self-check alone.
        check: run the self-check forward (two tiny sequences, eval mode, no grad). Always on in
            ``"huggingface"`` mode, where it is the only proof of isolation.

    Returns:
        the same model object.

    Raises:
        PaddingFreeError: (``UnsupportedModelError``, ``BackendUnavailableError``, ...) instead of ever training
            with cross-example attention.
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
    _, decision = admit(model, legacy=legacy and mode == "internal", allow_unverified=allow_unverified, mode=mode)
    check = check or decision == "unverified"  # no sweep evidence: the self-check is the only evidence

    if mode == "internal":
        _check_backend(model, backend)
        if legacy:
            from pf_trl.attention.legacy import patch_model

            if patch_model(model, backend) == 0:
                raise UnsupportedModelError(f"found no attention modules to patch in {type(model).__name__}")
        else:
            if can_set_attn_implementation(model) is False:
                raise UnsupportedModelError(
                    f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
                )
            _hf.register()
            # a vision-language model: the language model only; the vision tower keeps its own per-image attention
            vlm = multimodal.is_multimodal(model.config)
            try:
                model.set_attn_implementation({"text_config": _hf.PF_VARLEN} if vlm else _hf.PF_VARLEN)
            except (ValueError, NotImplementedError, AttributeError) as exc:
                raise UnsupportedModelError(
                    f"{type(model).__name__} cannot switch to attn_implementation='pf_varlen' ({exc}); "
                    "try mode='huggingface' or train it padded"
                ) from exc
            switched = model.config.get_text_config() if vlm else model.config
            if attn_implementation(switched) != _hf.PF_VARLEN:
                raise UnsupportedModelError(f"could not set attn_implementation='pf_varlen' on {type(model).__name__}")
            for module in model.modules():
                module._pf_varlen_backend = backend
            if not _hf.has_mask_interface():  # 4.48-4.52: models build their masks themselves
                from pf_trl.attention.legacy import _passthrough_causal_mask

                for module in model.modules():
                    replace_causal_mask_builder(module, _passthrough_causal_mask)

    if mode == "huggingface":
        import pf_trl.attention.packed_masks as packed_masks

        fixed = packed_masks.install(model)  # models whose own mask builder is not given position_ids
        if fixed:
            logger.info("pf-trl: %s builds its masks without position_ids; pf-trl passes them", ", ".join(fixed))
        import pf_trl.attention.compressed_kv as compressed_kv

        compressed_kv.install(model)  # DeepSeek-V4: compressed key/value entries per packed example
    _install_hooks(model, drop_flash_kwargs=legacy, mode=mode)
    if mode == "huggingface":
        result = _self_check_rerouted(model)
    else:
        result = self_check(model) if check else {}
    state = getattr(model, _STATE_ATTR)
    state.update(mode=mode, backend=backend, self_check=result)
    logger.info("pf-trl: padding-free enabled (mode=%s, backend=%s, self-check=%s)", mode, backend, result)
    return model
