"""TRL's ``ModelConfig`` flags on ``pf-trl train``, resolved with pf-trl's own model flags into one model setting.

Two spellings meet here: fms-hf-tuning's (``--peft_method lora --r 8 --target_modules ...``, ``--torch_dtype``,
``--use_flash_attn``) and TRL's (``--use_peft --lora_r 16 --lora_target_modules ...``, ``--dtype``,
``--attn_implementation``, ``SFTConfig.model_init_kwargs``). Each setting ends up with one value: two different values
for the same setting are refused, a LoRA setting without a switch that trains an adapter is refused (TRL would
train the full model without a word), and a change pf-trl makes on its own (float16 on a CPU, flash-attn missing) is
said in one warning line. :func:`check_model_flags` runs before anything heavy (the flags as typed, through
``get``); :func:`model_settings` and :func:`peft_config` build what the trainer gets.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pf_trl.cli.train_args import TrainCLIError

logger = logging.getLogger("pf_trl.cli.train")

Get = Callable[..., Any]

# LoRA settings that shape an adapter; given without --use_peft / --peft_method lora they would change nothing
LORA_FLAGS = ("r", "lora_r", "lora_alpha", "lora_dropout", "target_modules", "lora_target_modules",
              "lora_target_parameters", "lora_modules_to_save", "use_rslora", "use_dora", "lora_task_type")
BNB_4BIT_FLAGS = ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
HF_ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")
# attn_implementation -> pf-trl's varlen kernel of that family (padding_free_mode internal)
INTERNAL_BACKEND = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn",
                    "flash_attention_4": "flash_attn", "flex_attention": "flex", "sdpa": "sdpa"}


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0


def warn_once(message: str) -> None:
    """One warning line, on rank 0 only (a change pf-trl makes on its own, said once per run)."""
    if is_rank_zero():
        print(f"pf-trl: warning: {message}", flush=True)


def given_flags(argv: list[str]) -> frozenset[str]:
    """The flag names (without ``--``) of a normalized command line."""
    return frozenset(a.split("=", 1)[0][2:] for a in argv if a.startswith("--") and a != "--")


def _as_bool(value: Any) -> bool:
    from pf_trl.trainer.modes import as_bool

    return bool(as_bool(value)) if value is not None else False


# flags whose default is a value (not None): only the command line tells whether they were given
_VALUED_DEFAULTS = ("r", "lora_r", "torch_dtype")


def _set(name: str, get: Get, given: frozenset[str]) -> bool:
    return name in given or (name not in _VALUED_DEFAULTS and get(name) not in (None, "", []))


def _one(get: Get, given: frozenset[str], names: tuple[str, str], what: str) -> Any:
    """The value of a setting with two names; both set to different values is refused."""
    values = {n: get(n) for n in names if _set(n, get, given)}
    if len(values) == 2:
        a, b = (values[n] if not isinstance(values[n], list) else " ".join(values[n]) for n in names)
        if str(a) != str(b):
            raise TrainCLIError(f"--{names[0]} {a} and --{names[1]} {b} both set {what}, to different values; pass "
                                "one of them")
    return next(iter(values.values()), None)


def model_init_kwargs(get: Get) -> dict[str, Any]:
    """``--model_init_kwargs`` as a dict (JSON on the command line); keys pf-trl cannot apply are refused."""
    value = get("model_init_kwargs")
    if value in (None, ""):
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise TrainCLIError(f"--model_init_kwargs must be a JSON object, e.g. '{{\"dtype\": \"bfloat16\"}}', got "
                                f"{value!r}") from None
    if not isinstance(value, dict):
        raise TrainCLIError(f"--model_init_kwargs must be a JSON object, got {value!r}")
    extra = sorted(set(value) - {"dtype", "torch_dtype", "attn_implementation", "trust_remote_code"})
    if extra:
        raise TrainCLIError(f"--model_init_kwargs keys {extra} are not applied by pf-trl train (it builds the model "
                            "itself); use dtype, torch_dtype, attn_implementation and trust_remote_code only "
                            "(--model_revision for a Hub revision)")
    return value


def requested_trust(get: Get, given: frozenset[str]) -> bool:
    """``--trust_remote_code`` / ``model_init_kwargs["trust_remote_code"]`` (TRL: the kwargs' value wins, by
    ``setdefault``); two different values are refused, as for the dtype."""
    flag = _as_bool(get("trust_remote_code"))
    kwargs = model_init_kwargs(get)
    if "trust_remote_code" not in kwargs:
        return flag
    value = _as_bool(kwargs["trust_remote_code"])
    if "trust_remote_code" in given and value != flag:
        raise TrainCLIError(f"--trust_remote_code {flag} and --model_init_kwargs trust_remote_code {value} disagree; "
                            "pass one")
    return value


def requested_dtype(get: Get, given: frozenset[str]) -> str:
    """The dtype asked for under any of its names (``--torch_dtype``, ``--dtype``, ``model_init_kwargs``)."""
    asked = {f"--{n}": get(n) for n in ("torch_dtype", "dtype") if _set(n, get, given) and get(n) is not None}
    kwargs = model_init_kwargs(get)
    for key in ("dtype", "torch_dtype"):
        if kwargs.get(key) is not None:
            asked[f"--model_init_kwargs {key}"] = str(kwargs[key]).removeprefix("torch.")
    if len(set(map(str, asked.values()))) > 1:
        raise TrainCLIError(f"{' and '.join(f'{k} {v}' for k, v in asked.items())} set the model dtype to different "
                            "values; pass one")
    return str(next(iter(asked.values()), get("torch_dtype") or "auto"))


def requested_attention(get: Get, given: frozenset[str]) -> str | None:
    """``--attn_implementation`` / ``model_init_kwargs["attn_implementation"]`` (one value), or None."""
    asked = {}
    if get("attn_implementation"):
        asked["--attn_implementation"] = get("attn_implementation")
    kwargs = model_init_kwargs(get)
    if kwargs.get("attn_implementation"):
        asked["--model_init_kwargs attn_implementation"] = kwargs["attn_implementation"]
    if len(set(asked.values())) > 1:
        raise TrainCLIError(f"{' and '.join(f'{k} {v}' for k, v in asked.items())} set the attention to different "
                            "values; pass one")
    return next(iter(asked.values()), None)


def flash_attn_usable(attn: str) -> bool:
    """The package behind transformers' ``attn`` (``flash_attention_2`` / ``_3`` / ``_4``) really installed (its
    ``flash_attn_varlen_func`` imports: a namespace ``flash_attn`` left by flash-attn-4 does not count) and a CUDA
    device present."""
    # no flash distribution at all (the top-level names of flash-attn 2/4 and flash-attn-3): answered without importing
    # pf_trl.attention (torch), so the refusal stays fast
    if not any(importlib.util.find_spec(top) for top in ("flash_attn", "flash_attn_interface")):
        return False
    from pf_trl.attention.flash_packages import FLASH_KERNELS, installed_flash_kernels

    name = next((n for n, _, impl, _ in FLASH_KERNELS if impl == attn), None)
    if name is None or not installed_flash_kernels()[name]:
        return False
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def check_attention(attn: str | None, mode: str, backend: str | None) -> None:
    """Refuse an ``attn_implementation`` pf-trl cannot honour here, naming the way out."""
    if attn is None:
        return
    if "/" in attn:
        raise TrainCLIError(f"--attn_implementation {attn}: a Hub kernel (the kernels package), which pf-trl's "
                            f"padding-free attention does not route; use {', '.join(HF_ATTENTION)}, or "
                            "--padding_free_mode internal (pf-trl's varlen kernels)")
    if attn not in HF_ATTENTION:
        raise TrainCLIError(f"--attn_implementation {attn!r} is unknown; use one of {', '.join(HF_ATTENTION)}")
    if mode == "internal":
        mapped = INTERNAL_BACKEND.get(attn)
        if mapped is None:
            raise TrainCLIError(f"--attn_implementation {attn} with --padding_free_mode internal: pf-trl's varlen "
                                "kernels have no eager variant; use --padding_free_mode huggingface for eager")
        if backend not in (None, "auto", mapped):
            raise TrainCLIError(f"--attn_implementation {attn} (pf-trl backend {mapped}) and --attention_backend "
                                f"{backend} disagree; pass one")
        return
    if attn.startswith("flash_attention") and not flash_attn_usable(attn):
        raise TrainCLIError(f"--attn_implementation {attn} needs the flash-attn package and a CUDA device, not both "
                            "here; use sdpa, or --padding_free_mode internal (pf-trl's varlen kernels)")


def _refuse_script_values(get: Get, given: frozenset[str]) -> None:
    from pf_trl.trainer.script_parity import refusal

    for name in sorted(given):
        message = refusal(name, get(name))
        if message:
            raise TrainCLIError(message)


def check_model_flags(get: Get, given: frozenset[str], *, model_name: str | None = None) -> None:
    """Every model flag's combination, from the values as parsed (``get(name)``) and the flags given; raises
    TrainCLIError in one line. Imports torch only for quantization (to ask for CUDA)."""
    from pf_trl.trainer.modes import resolve_padding_free

    _refuse_script_values(get, given)
    requested_trust(get, given)  # two different values refused now; the model's own code is checked with its config
    use_peft = _as_bool(get("use_peft"))
    lora = use_peft or (get("peft_method") or "none") == "lora"
    shaping = [f"--{n}" for n in LORA_FLAGS if n in given]  # as typed: their defaults are no request
    if shaping and not lora:
        raise TrainCLIError(f"{' '.join(shaping)} {'is a LoRA setting' if len(shaping) == 1 else 'are LoRA settings'} "
                            "but no adapter is trained; add --use_peft (TRL) or --peft_method lora to train a LoRA "
                            f"adapter, or drop {'it' if len(shaping) == 1 else 'them'} for a full fine-tune")
    _one(get, given, ("lora_r", "r"), "the LoRA rank")
    _one(get, given, ("lora_target_modules", "target_modules"), "the LoRA target modules")
    requested_dtype(get, given)
    bits = [n for n in ("load_in_4bit", "load_in_8bit") if _as_bool(get(n))]
    if len(bits) == 2:
        raise TrainCLIError("--load_in_4bit and --load_in_8bit: pass one")
    stray = [f"--{n}" for n in BNB_4BIT_FLAGS if n in given]
    if stray and "load_in_4bit" not in bits:
        raise TrainCLIError(f"{' '.join(stray)} only {'applies' if len(stray) == 1 else 'apply'} with --load_in_4bit; "
                            "add it or drop them")
    if bits:
        check_quantization(bits[0], lora=lora, model_name=model_name)
    try:
        _, mode = resolve_padding_free(get("padding_free"), get("padding_free_mode"))
    except ValueError:
        return  # refused with its own message by check_combinations
    attn = requested_attention(get, given)
    if _as_bool(get("use_flash_attn")) and attn is not None and not attn.startswith("flash_attention"):
        raise TrainCLIError(f"--use_flash_attn True and --attn_implementation {attn} disagree (flash attention or "
                            f"{attn}?); pass one: drop --use_flash_attn for {attn}, or drop --attn_implementation")
    check_attention(attn, mode, get("attention_backend"))


def check_quantization(flag: str, *, lora: bool, model_name: str | None) -> None:
    """QLoRA needs an adapter, a model folder, CUDA and bitsandbytes; refused in one line otherwise."""
    from pf_trl.models import is_embedded_model

    if not lora:
        raise TrainCLIError(f"--{flag} quantizes the base model, which then cannot be trained without an adapter; add "
                            "--use_peft (QLoRA)")
    if model_name is not None and is_embedded_model(model_name):
        raise TrainCLIError(f"--{flag} quantizes pretrained weights; {model_name} is built from a config: pass a model "
                            "folder")
    import torch

    if not torch.cuda.is_available():
        raise TrainCLIError(f"--{flag} needs a CUDA device (bitsandbytes quantizes on the GPU); none is available "
                            "here: drop it to train LoRA in full precision")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise TrainCLIError(f"--{flag} needs bitsandbytes: pip install 'pf-trl[qlora]'")


@dataclass
class ModelSettings:
    """What the model is built with: dtype (a ``torch.dtype`` or None for auto), attention, quantization."""

    dtype: Any
    attn_implementation: str | None
    quantization_config: Any = None


def resolve_dtype(name: str, *, cuda: bool):
    """The torch dtype for a dtype name (None: auto); float16 without CUDA becomes float32, said once."""
    import torch

    if name in ("auto", None):
        return None
    dtype = getattr(torch, name)
    if dtype == torch.float16 and not cuda:
        warn_once("dtype float16 on CPU: training in float32 instead (fp16 on CPU is slow and has no loss scaling)")
        return torch.float32
    return dtype


def model_settings(model_args, config, given: frozenset[str], *, cuda: bool,
                   flash_choice: Callable[[], tuple[str | None, str]], quiet: bool = False):
    """The model's dtype, attention and quantization from every flag that sets them; may switch ``config`` to
    ``padding_free_mode='internal'`` (``--use_flash_attn`` without flash-attn), said once."""
    def get(name, default=None):
        for group in (model_args, config):
            if hasattr(group, name):
                return getattr(group, name)
        return default

    dtype = resolve_dtype(requested_dtype(get, given), cuda=cuda)
    attn = requested_attention(get, given)
    check_attention(attn, config.padding_free_mode, config.attention_backend)
    if attn is not None and config.padding_free_mode == "internal":
        config.attention_backend = INTERNAL_BACKEND[attn]  # pf-trl's kernel of the family asked for
        attn = None
    if config.use_flash_attn and attn is None:
        # the flash package really installed (flash-attn 2, 3 or 4) decides which implementation transformers gets
        attn, why = flash_choice()
        if attn is not None:
            if not quiet:
                print(f"pf-trl: --use_flash_attn: {why}", flush=True)
        else:
            switched = config.padding_free_mode == "huggingface"
            if switched:
                config.padding_free_mode = "internal"
            warn_once(f"--use_flash_attn True but flash-attention is not usable here ({why}): using pf-trl's varlen "
                      f"attention ({'padding_free_mode huggingface -> internal, ' if switched else ''}"
                      f"backend={config.attention_backend})")
    quantization = None
    bits = next((n for n in ("load_in_4bit", "load_in_8bit") if _as_bool(getattr(model_args, n, False))), None)
    if bits is not None:
        from transformers import BitsAndBytesConfig

        if bits == "load_in_4bit":  # TRL's get_quantization_config
            quantization = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
                bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
                bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage)
        else:
            quantization = BitsAndBytesConfig(load_in_8bit=True)
    return ModelSettings(dtype=dtype, attn_implementation=attn, quantization_config=quantization)


def peft_config(model_args, given: frozenset[str]):
    """One ``peft.LoraConfig`` from TRL's flags and pf-trl's (TRL's ``get_peft_config`` fields), or None."""
    from pf_trl.trainer.adapters import lora_config

    use_peft = _as_bool(getattr(model_args, "use_peft", False))
    method = "lora" if use_peft else model_args.peft_method

    def get(name, default=None):
        return getattr(model_args, name, default)

    rank = _one(get, given, ("lora_r", "r"), "the LoRA rank")
    if rank is None:
        rank = get("lora_r", 16) if use_peft else model_args.r  # each switch keeps its own default rank
    targets = _one(get, given, ("lora_target_modules", "target_modules"), "the LoRA target modules")
    if isinstance(targets, str):
        targets = [targets]
    try:
        return lora_config(method, r=int(rank), lora_alpha=model_args.lora_alpha, lora_dropout=model_args.lora_dropout,
                           target_modules=targets, use_rslora=bool(get("use_rslora", False)),
                           use_dora=bool(get("use_dora", False)), modules_to_save=get("lora_modules_to_save"),
                           target_parameters=get("lora_target_parameters"))
    except ValueError as exc:
        raise TrainCLIError(str(exc)) from exc
