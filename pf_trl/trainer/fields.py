"""The SFTConfig fields PaddingFreeSFTTrainer applies itself, before TRL sees the data (see ``parity.py``).

pf-trl tokenizes raw rows and prepares tokenized rows before ``SFTTrainer.__init__`` runs (TRL is then told to skip
its own preparation), so the fields TRL reads during preparation are applied here, the way TRL applies them:
``chat_template_path`` (a Jinja file), ``eos_token``, ``model_init_kwargs`` (for a model given by name); and the
fields and checks of TRL's ``__init__`` that would act on what pf-trl has already done are hidden for its duration
(:func:`hidden_from_trl`, :func:`admit_head_adapters`). ``shuffle_dataset`` and the loss-mask decisions are data
preparation (:mod:`pf_trl.data.prepare`).
"""

from __future__ import annotations

import contextlib
from typing import Any

from pf_trl.errors import ConfigError


def apply_chat_template_path(args, processing_class) -> None:
    """``chat_template_path`` pointing to a ``.jinja`` / ``.j2`` file becomes the tokenizer's chat template (TRL does
    the same in its ``__init__``, which runs after pf-trl has tokenized). A tokenizer folder is refused by
    :func:`pf_trl.trainer.parity.check_config`."""
    path = getattr(args, "chat_template_path", None)
    if path and str(path).endswith((".jinja", ".j2")) and processing_class is not None:
        with open(path, encoding="utf-8") as f:
            processing_class.chat_template = f.read()


def apply_eos_token(args, processing_class) -> None:
    """``eos_token`` becomes the tokenizer's EOS before pf-trl tokenizes (TRL sets it in its ``__init__``, after pf-trl
    has tokenized): the EOS appended to text and prompt-completion rows is that token, as in TRL."""
    token = getattr(args, "eos_token", None)
    if token is None or processing_class is None or not hasattr(processing_class, "get_vocab"):
        return
    if token not in processing_class.get_vocab():
        raise ConfigError(f"eos_token={token!r} is not in the tokenizer's vocabulary; pass a token it has")
    processing_class.eos_token = token


def model_build_kwargs(args) -> dict[str, Any]:
    """``model_init_kwargs`` for :func:`pf_trl.models.build_model` when ``model`` is a name or a folder; its
    ``trust_remote_code`` defaults to the config's field, as TRL's ``setdefault`` does."""
    given = dict(args.model_init_kwargs or {})
    out: dict[str, Any] = {"trust_remote_code": bool(given.get("trust_remote_code",
                                                               getattr(args, "trust_remote_code", False)))}
    dtype = given.get("dtype", given.get("torch_dtype"))
    if dtype not in (None, "auto"):
        import torch

        out["torch_dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if given.get("attn_implementation"):
        out["attn_implementation"] = given["attn_implementation"]
    if given.get("revision"):
        out["revision"] = given["revision"]
    return out


@contextlib.contextmanager
def hidden_from_trl(args, active: bool, skip_prepare: bool = False):
    """Fields TRL's ``__init__`` reads as its own while pf-trl has already acted on them, hidden for its duration:

    - ``padding_free`` (a bool, TRL's meaning), in pf-trl's padding-free modes only (``padding_free_mode`` not
      ``'none'``). There it is ``True``, and TRL's ``SFTTrainer.__init__`` would refuse pf-trl's
      ``PaddingFreeCollator`` ("Passing a custom data collator is not supported when using padding-free"), refuse
      ``max_length`` without packing (pf-trl has cut the rows to it already) and warn at batch size 1; without a
      collator it would build its own flattening ``DataCollatorForLanguageModeling``. pf-trl's collator, sampler and
      attention are in charge, so TRL sees ``False``. With ``padding_free=False`` (mode ``'none'``) nothing is hidden:
      TRL's padded path is the one trained.
    - ``assistant_only_loss`` with ``active`` (TRL checks the rows are conversational; pf-trl's are tokenized by then).
    - with ``skip_prepare``, ``dataset_kwargs["skip_prepare_dataset"]`` (TRL must not cut or shuffle the prepared rows
      again).

    Restored afterwards, so the same config object builds the next trainer alike."""
    saved = {"padding_free": args.padding_free, "assistant_only_loss": args.assistant_only_loss,
             "dataset_kwargs": args.dataset_kwargs}
    if getattr(args, "padding_free_mode", "none") != "none":
        args.padding_free = False
    if active:
        args.assistant_only_loss = False
    if skip_prepare:
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)


@contextlib.contextmanager
def admit_head_adapters(active: bool):
    """Let SFTTrainer accept a PEFT adapter on ``lm_head`` while it initializes (pf-trl modes only).

    TRL refuses one because its fused head reads ``lm_head.weight`` and would bypass the adapter; pf-trl's loss calls
    the adapted head module itself (the ``module`` path), so the adapter trains. TRL's check is an ``isinstance``
    against ``BaseTunerLayer`` in its module: it is pointed at a class nothing is an instance of, for the duration of
    ``SFTTrainer.__init__`` only. The padded mode (``padding_free=False``) keeps TRL's refusal.
    """
    import trl.trainer.sft_trainer as sft_module

    if not active or not hasattr(sft_module, "BaseTunerLayer"):
        yield
        return
    original = sft_module.BaseTunerLayer
    sft_module.BaseTunerLayer = type("_NoHeadAdapterCheck", (), {})
    try:
        yield
    finally:
        sft_module.BaseTunerLayer = original
