"""LoRA adapters for ``pf-trl train`` (fms-hf-tuning's flags), and saving them merged.

The trainer itself takes a ``peft_config=`` or a ``PeftModel`` as TRL does; this module only maps the command-line
flags onto a ``peft.LoraConfig`` and writes the merged model when asked. Needs ``pip install 'pf-trl[peft]'``.
"""

from __future__ import annotations

import os

from pf_trl.errors import ConfigError

PEFT_METHODS = ("none", "lora")


def lora_config(peft_method: str, *, r: int, lora_alpha: int, lora_dropout: float, target_modules: list[str] | None,
                use_rslora: bool = False, use_dora: bool = False, modules_to_save: list[str] | None = None,
                target_parameters: list[str] | None = None):
    """A ``peft.LoraConfig`` for ``peft_method="lora"`` (``None`` for ``"none"``), with the fields of TRL's
    ``get_peft_config`` (bias ``none``); ``ValueError`` on bad input."""
    if peft_method not in PEFT_METHODS:
        raise ConfigError(f"--peft_method must be one of {', '.join(PEFT_METHODS)}, got {peft_method!r}")
    if peft_method == "none":
        return None
    if r < 1:
        raise ConfigError(f"--r must be a positive integer, got {r}")
    if not 0.0 <= lora_dropout < 1.0:
        raise ConfigError(f"--lora_dropout must be in [0, 1), got {lora_dropout}")
    try:
        from peft import LoraConfig
    except ImportError as exc:
        raise ConfigError("--peft_method lora needs peft: pip install 'pf-trl[peft]'") from exc
    targets: list[str] | str | None = list(target_modules) if target_modules else None
    if targets == ["all-linear"]:
        targets = "all-linear"
    extra = {"target_parameters": list(target_parameters)} if target_parameters else {}  # peft >= 0.17 only
    return LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=targets,
                      task_type="CAUSAL_LM", bias="none", use_rslora=use_rslora, use_dora=use_dora,
                      modules_to_save=list(modules_to_save) if modules_to_save else None, **extra)


def save_merged(trainer, directory: str) -> str:
    """Merge the trained adapter into the base weights (in place: call after saving the adapter) and save model +
    tokenizer to ``directory``."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not hasattr(model, "merge_and_unload"):
        raise ConfigError("--merge_adapter needs a model trained with an adapter (--peft_method lora)")
    merged = model.merge_and_unload()
    os.makedirs(directory, exist_ok=True)
    merged.save_pretrained(directory)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(directory)
    return directory


def refuse_prompt_learning(model, peft_config) -> None:
    """Refuse prompt-learning PEFT (prefix / prompt tuning) on packed rows, given as ``peft_config`` or as a
    ``PeftModel`` passed in: it prepends virtual tokens (or past keys) to every sequence of a padded batch."""
    configs = [peft_config] if peft_config is not None else list((getattr(model, "peft_config", None) or {}).values())
    for config in configs:
        if getattr(config, "is_prompt_learning", False):
            raise ConfigError(f"{type(config).__name__} (prompt learning) prepends virtual tokens to every sequence, "
                              "which a packed row cannot hold; use LoRA or another adapter")


def transformers_model(model):
    """The transformers model inside a PEFT wrapper (adapters are injected into its modules), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model
