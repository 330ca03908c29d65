"""The flags of ``pf-trl train``, declared: the model and data argument dataclasses and the full parser over them
and :class:`~pf_trl.trainer.config.PaddingFreeConfig` (transformers' ``HfArgumentParser``, the authority on the
flags).

Both the command (:mod:`pf_trl.cli.train`) and the flag table (:mod:`pf_trl.cli.flag_table`, written from the full
parser) import this module; it imports neither. Its bytes enter the flag table's stamp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pf_trl.data.options import train_data_fields
from pf_trl.errors import PfTrlError

DTYPES = ("auto", "float32", "float16", "bfloat16")
SERVICE_WAIT_S = 600.0


class TrainCLIError(PfTrlError, ValueError):
    """A bad flag or data path; the message says what to change."""


@dataclass
class PeftArguments:
    """fms-hf-tuning's adapter flags (part of ModelArguments)."""

    peft_method: str = field(default="none", metadata={"help": "none (full fine-tuning) or lora.",
                                                        "choices": ["none", "lora"]})
    r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Modules to adapt, e.g. q_proj v_proj (add lm_head to adapt the head), or all-linear. "
                  "Default: peft's choice for the architecture."},
    )
    merge_adapter: bool = field(
        default=False,
        metadata={"help": "After training, also save the adapter merged into the base weights, in "
                          "<output_dir>/merged."},
    )


@dataclass
class ModelArguments(PeftArguments):
    model_name_or_path: str = field(
        default="pf-trl/tiny-llama",
        metadata={"help": "Embedded model name (pf-trl/tiny-llama, ...: random init from a config) or a local folder. "
                  "Never downloaded."},
    )
    torch_dtype: str = field(
        default="auto",
        metadata={"help": "Model weights dtype: auto, float32, float16, bfloat16. On CPU float16 becomes float32 "
                  "(CPU fp16 training is slow and unstable; a notice is printed).", "choices": list(DTYPES)},
    )
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder. Default: the model folder's own tokenizer (the embedded Mistral "
                  "tokenizer for embedded models)."},
    )
    model_overrides: str | None = field(
        default=None,
        metadata={"help": "Config overrides for embedded models, e.g. 'num_hidden_layers=2,hidden_size=64'."},
    )


# one limit with TRL's --max_length: unset, the trainer config's max_length (TRL's default 1024) decides
_MAX_SEQ_LEN = ("max_seq_len", int | None, field(default=None, metadata={
    "help": "Longest example in tokens: TRL's --max_length under pf-trl's name (pass one of the two). Default 1024 "
            "(TRL's); a shards directory keeps the limit it was made with. Longer examples follow --truncation."}))


def _data_arguments() -> type:
    """``DataArguments``: where the data comes from, plus the data options of
    :class:`~pf_trl.data.options.PretokenizeConfig` (declared there once; ``--dataset_text_field`` and
    ``--completion_only_loss`` are TRL's own flags and come from the trainer config)."""
    where = [
        ("training_data_path", str | None, field(default=None, metadata={"help": "Shards dir, a data file or a "
                                                                          "save_to_disk dir."})),
        ("data_config", str | None, field(default=None, metadata={
            "help": "A data config (YAML/JSON, fms-hf-tuning's schema): several datasets, each with its format, mixed "
                    "by `sampling` weights or concatenated; `streaming: true` streams them. Alias "
                    "--data_config_path."})),
        ("validation_data_path", str | None, field(default=None, metadata={"help": "Same kinds as "
                                                                            "--training_data_path."})),
    ]
    service = [
        ("pretokenize_num_proc", int, field(default=1, metadata={"help": "Tokenizer processes for the cache build."})),
        ("dataset_service_url", str | None, field(default=None, metadata={"help": "Preprocessing service base URL."})),
        ("dataset_id", str | None, field(default=None, metadata={"help": "Dataset id at the service."})),
        ("dataset_service_token", str | None, field(default=None, metadata={"help": "Bearer token (or "
                                                                             "$PF_SERVICE_TOKEN)."})),
        ("dataset_service_timeout_s", float, field(default=SERVICE_WAIT_S, metadata={
            "help": "Wait at most this long (seconds) for the service's dataset."})),
    ]
    data = [_MAX_SEQ_LEN if name == "max_seq_len" else (name, typ, spec) for name, typ, spec in train_data_fields()]
    return dataclasses.make_dataclass("DataArguments", [*where, *data, *service],
                                      namespace={"__module__": __name__, "__doc__": _data_arguments.__doc__})


DataArguments = _data_arguments()


def full_parser():
    """transformers' HfArgumentParser over (ModelArguments, DataArguments, PaddingFreeConfig): the authority on the
    flags (it imports transformers, TRL and torch). Flags are never abbreviated."""
    from transformers import HfArgumentParser

    from pf_trl.cli.trl_fields import extended_arguments
    from pf_trl.trainer.config import PaddingFreeConfig

    # + the fields of trl sft's ModelConfig, ScriptArguments and DatasetMixtureConfig
    model_args, data_args = extended_arguments(ModelArguments, DataArguments)
    parser = HfArgumentParser((model_args, data_args, PaddingFreeConfig), allow_abbrev=False)
    parser.exit_on_error = False

    def error(message: str):  # argparse would print usage and exit; a user error is one line here
        raise TrainCLIError(f"{message} (see `pf-trl train --help`)")

    parser.error = error
    return parser
