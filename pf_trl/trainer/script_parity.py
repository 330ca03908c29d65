"""The flags ``trl sft`` takes beside ``SFTConfig``: every field of TRL's ``ScriptArguments``, ``ModelConfig`` and
``DatasetMixtureConfig``, and what ``pf-trl train`` does with it.

Each field is classified once, here (``SFTConfig`` / ``TrainingArguments`` fields: :mod:`pf_trl.trainer.parity`):

- ``honoured``: the flag means what it means to ``trl sft``;
- ``mapped``: TRL's flag is carried onto pf-trl's own setting for the same thing (named in ``how``);
- ``refused``: the values ``refuse_if`` names are refused in one line, before any data is read, naming the flag and
  the way out.

``pf-trl train`` declares its flags from TRL's own dataclasses (:mod:`pf_trl.cli.trl_fields`), so a field a new TRL
adds is a flag at once; ``tests/test_parity.py`` fails until it is classified here. Imports nothing of TRL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HONOURED, MAPPED, REFUSED = "honoured", "mapped", "refused"
# (module, class) of the TRL dataclasses `trl sft` parses beside SFTConfig (trl/scripts/sft.py: make_parser)
TRL_SCRIPT_CLASSES = (("trl.scripts.utils", "ScriptArguments"), ("trl.trainer.model_config", "ModelConfig"),
                      ("trl.scripts.utils", "DatasetMixtureConfig"))


@dataclass(frozen=True)
class ScriptField:
    """How ``pf-trl train`` treats one flag of ``trl sft`` outside ``SFTConfig``.

    Attributes:
        status: ``honoured`` | ``mapped`` | ``refused``.
        how: what pf-trl does with it (rendered in docs/parity.md).
        refuse_if: value (as parsed) -> True when refused; the refusal names the flag and ``fix``.
        fix: the way out, for the refusal's message.
        example: a refused value (the tests use it).
    """

    status: str
    how: str
    refuse_if: Callable[[Any], bool] | None = None
    fix: str = ""
    example: Any = None


def _true(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "1", "yes", "y", "t", "on")


def _lora(how: str) -> ScriptField:
    return ScriptField(HONOURED, how + " With --use_peft (or --peft_method lora); given without either, refused (no "
                       "adapter would be trained).")


FIELDS: dict[str, ScriptField] = {
    # ------------------------------------------------------------------------------------ ScriptArguments
    "dataset_name": ScriptField(
        HONOURED, "A Hub dataset id (ORG/NAME; downloaded by huggingface_hub with HF_TOKEN, HF_ENDPOINT, HF_HOME and "
        "HF_HUB_OFFLINE as they are, its splits and README configs read as datasets reads them) or a local dataset: a "
        "JSON / JSONL / Parquet / CSV file, a folder of such files (split names from the file names, as datasets reads "
        "a folder), a save_to_disk folder (Dataset or DatasetDict), a pf-trl shards directory, or a folder of shards "
        "directories named by split. A local path wins over a Hub id of the same spelling."),
    "dataset_config": ScriptField(
        HONOURED, "A configuration of a Hub dataset or a folder of files, declared in its README.md (`configs:`), as "
        "datasets reads it; refused for a single file, a save_to_disk folder or shards (they have none)."),
    "dataset_train_split": ScriptField(HONOURED, "The split trained on; a split the dataset lacks is refused, naming "
                                       "the splits it has."),
    "dataset_test_split": ScriptField(
        HONOURED, "The split evaluated on when eval_strategy is not `no` (as trl sft); a missing split is then "
        "refused, naming the splits it has."),
    "dataset_streaming": ScriptField(
        MAPPED, "The --dataset_name split trained on goes through pf-trl's streaming path (as a data config with "
        "`dataprocessor.streaming: true`): read as a datasets stream, tokenized while training, packed to the token "
        "budget from a look-ahead buffer, nothing written to the tokenized cache. Needs --max_steps (a stream has no "
        "length; refused in one line without it); a Hub dataset's split files are downloaded first (those alone), then "
        "streamed; the evaluation split is read whole (eval_max_examples rows); padded training "
        "(--padding_free false) reads the split whole. Given without --dataset_name, refused."),
    "ignore_bias_buffers": ScriptField(
        REFUSED, "A DDP workaround for bool buffers that trl sft's script does not read either.", refuse_if=_true,
        fix="drop it", example=True),
    # ---------------------------------------------------------------------------------------- ModelConfig
    "model_name_or_path": ScriptField(
        HONOURED, "A Hub model id (ORG/NAME; its config, weights and tokenizer downloaded by huggingface_hub into its "
        "cache), a local model folder (which wins over an id of the same spelling) or an embedded pf-trl/ model."),
    "model_revision": ScriptField(
        HONOURED, "The branch, tag or commit of a Hub model id (the tokenizer comes from the same commit unless "
        "--tokenizer_name_or_path names another); the commit it resolves to enters the pretokenize cache key."),
    "dtype": ScriptField(
        HONOURED, "The dtype the model is loaded in (auto, bfloat16, float16, float32): the same setting as pf-trl's "
        "--torch_dtype (two different values are refused). Unset, --torch_dtype decides (default auto: the folder's "
        "own dtype; trl sft's default is float32). float16 on a CPU trains in float32, said in one warning."),
    "attn_implementation": ScriptField(
        MAPPED, "padding_free_mode huggingface (default) and none: the model's attention (sdpa, eager, "
        "flash_attention_2/3, flex_attention), checked to be usable here; internal: pf-trl's varlen kernel of that "
        "family (flash_attention_* -> attention_backend flash_attn, flex_attention -> flex, sdpa -> sdpa; eager "
        "refused). A Hub kernel id (the kernels package) is refused: pf-trl's padding-free attention does not "
        "route it."),
    "use_peft": ScriptField(MAPPED, "Trains a LoRA adapter, as --peft_method lora, with TRL's LoraConfig (bias none, "
                            "the lora_* flags; rank 16 unless --lora_r / --r)."),
    "lora_r": _lora("The LoRA rank (TRL's default 16 with --use_peft; --r, pf-trl's name, is the same setting, "
                    "default 8 with --peft_method lora)."),
    "lora_alpha": _lora("LoRA alpha (the same flag as pf-trl's)."),
    "lora_dropout": _lora("LoRA dropout (the same flag as pf-trl's)."),
    "lora_target_modules": _lora("Modules to adapt (--target_modules is the same setting; `all-linear` works); "
                                 "unset: peft's default for the architecture."),
    "lora_target_parameters": _lora("Parameters to adapt (peft's target_parameters, e.g. MoE experts)."),
    "lora_modules_to_save": _lora("Modules trained in full beside the adapter (peft's modules_to_save)."),
    "lora_task_type": ScriptField(
        HONOURED, "CAUSAL_LM (the default) only: pf-trl trains causal language models.",
        refuse_if=lambda v: v not in (None, "CAUSAL_LM"), fix="drop it (CAUSAL_LM)", example="SEQ_CLS"),
    "use_rslora": _lora("Rank-stabilized LoRA scaling (alpha / sqrt(r))."),
    "use_dora": _lora("DoRA adapters."),
    "load_in_8bit": ScriptField(
        HONOURED, "QLoRA: the base model loaded in 8 bits by bitsandbytes, with an adapter. Needs CUDA and "
        "bitsandbytes, a model folder and --use_peft; elsewhere refused in one line before any data is read."),
    "load_in_4bit": ScriptField(
        HONOURED, "QLoRA: the base model loaded in 4 bits by bitsandbytes (compute dtype: --dtype), with an adapter. "
        "Needs CUDA and bitsandbytes, a model folder and --use_peft; elsewhere refused in one line before any data "
        "is read."),
    "bnb_4bit_quant_type": ScriptField(HONOURED, "fp4 or nf4, with --load_in_4bit (refused without it)."),
    "use_bnb_nested_quant": ScriptField(HONOURED, "Nested quantization, with --load_in_4bit (refused without it)."),
    "bnb_4bit_quant_storage": ScriptField(HONOURED, "The 4-bit storage dtype, with --load_in_4bit (refused without "
                                          "it)."),
    # ------------------------------------------------------------------------------- DatasetMixtureConfig
    "datasets": ScriptField(
        MAPPED, "A config file's `datasets:` list (or --datasets PATH ...) becomes a pf-trl data config: the "
        "datasets concatenated in order, as trl sft does; each entry's path (local, as --dataset_name), name, "
        "data_dir, data_files, split and columns (kept columns) are read. `fraction` is refused (trl keeps the first "
        "rows of each dataset; pf-trl mixes by weight: a --data_config with sampling weights)."),
    "streaming": ScriptField(
        MAPPED, "A `datasets:` mixture (--datasets) streamed through pf-trl's streaming path, as --dataset_streaming "
        "streams --dataset_name (the entries concatenated in order); needs --max_steps. Given without --datasets, "
        "refused (trl sft would ignore it)."),
    "test_split_size": ScriptField(
        REFUSED, "trl sft splits the mixture at random without a seed; pf-trl evaluates on data you name.",
        refuse_if=lambda v: v not in (None, "None", "none"),
        fix="evaluate on a split (--dataset_test_split) or a file (--validation_data_path)", example=0.1),
}


def trl_script_fields() -> dict[str, list[str]]:
    """The installed TRL's field names per class of :data:`TRL_SCRIPT_CLASSES` (imports those TRL modules only)."""
    import dataclasses
    import importlib

    return {name: [f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name)) if f.init]
            for module, name in TRL_SCRIPT_CLASSES}


def unclassified() -> list[str]:
    """Installed fields of those classes this table does not classify (a TRL upgrade added them)."""
    return [n for names in trl_script_fields().values() for n in names if n not in FIELDS]


def refusal(name: str, value: Any) -> str | None:
    """The one-line refusal of ``--name value``, or None when the value is accepted."""
    entry = FIELDS.get(name)
    if entry is None or entry.refuse_if is None or value is None or not entry.refuse_if(value):
        return None
    return f"--{name} {value}: {entry.how} Way out: {entry.fix}"


def render_markdown() -> list[str]:
    """The docs section listing these flags (for docs/parity.md)."""
    lines = ["## trl sft's other flags (ScriptArguments, ModelConfig, DatasetMixtureConfig)", "",
             "`trl sft` parses these beside `SFTConfig`; `pf-trl train` takes each of them, also as a key of a "
             "`--config` file (TRL's YAML format; the command line overrides the file, `env:` is applied):", "",
             "| class | flag | pf-trl | how |", "|---|---|---|---|",
             "| TrlParser | `--config` | honoured | A YAML file of these flags and SFTConfig's (keys: the flag names; "
             "lists and mappings as YAML); its `env:` mapping is set in the environment first; the command line "
             "overrides the file; a key that is no flag is refused by name (trl sft hands it to accelerate launch). |"]
    for cls, names in trl_script_fields().items():
        for name in names:
            entry = FIELDS.get(name)
            status = entry.status if entry else "**unclassified**"
            if entry and entry.refuse_if is not None and entry.status != REFUSED:
                status += f" (refused: `{entry.example!r}`)"
            how = " ".join((entry.how if entry else "").split()).replace("|", "\\|")
            lines.append(f"| {cls} | `--{name}` | {status} | {how} |")
    lines.append("")
    return lines
