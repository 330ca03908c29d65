"""Every field of TRL's ``SFTConfig`` and transformers' ``TrainingArguments``: what the padding-free trainer does
with it.

Each field is classified once, here:

- ``honoured``: it means what it means in TRL's padded ``SFTTrainer`` (transformers' ``Trainer`` applies it
  unchanged, or pf-trl reproduces it on packed rows). Where pf-trl does the work itself and the field changes
  the data or the loss, ``evidence`` names the test that checks it against TRL's padded run.
- ``refused``: some values cannot be reproduced on packed rows; ``refuse_if`` says which, and
  :func:`check_config` raises at construction with a message naming the field.
- ``not applicable``: the field has nothing to act on in a padding-free run (e.g. fixed-length packing);
  where a user could expect an effect, ``warn_if`` says so in one warning (ignoring it cannot change what is trained).

``python -m pf_trl.trainer.parity --write`` renders the table for the *installed* TRL and transformers into
``docs/parity.md``; ``tests/test_parity.py`` fails when an installed field is not classified here (an upgrade
cannot slip one in silently) and when the page is out of date.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pf_trl.errors import PfTrlError

logger = logging.getLogger("pf_trl.trainer")

HONOURED, REFUSED, NOT_APPLICABLE = "honoured", "refused", "not applicable"
STATUSES = (HONOURED, REFUSED, NOT_APPLICABLE)
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "parity.md"


@dataclass(frozen=True)
class FieldParity:
    """How pf-trl treats one configuration field.

    Attributes:
        status: ``honoured`` | ``refused`` | ``not applicable``.
        how: what pf-trl does with it and why (one or two sentences; rendered in the docs table).
        refuse_if: value -> True when that value is refused at construction (``refused`` fields, and honoured ones
            with a value that cannot be reproduced).
        warn_if: value -> True when setting it deserves one warning (it has no effect in a padding-free run).
        evidence: ``tests/file.py::test_name`` checking the field against TRL's padded run, where pf-trl implements
            it itself and it changes what is trained.
        example: a value that is refused or warned about (the tests use it).
    """

    status: str
    how: str
    refuse_if: Callable[[Any], bool] | None = None
    warn_if: Callable[[Any], bool] | None = None
    evidence: str | None = None
    example: Any = None


def _trainer(how: str = "transformers' Trainer applies it unchanged.") -> FieldParity:
    return FieldParity(HONOURED, how)


def _is_true(value: Any) -> bool:
    return bool(value)


def _set(value: Any) -> bool:
    return value not in (None, "", [], {})


_T = _trainer()
_LOG = _trainer("Logging, reporting and progress: transformers' Trainer, unchanged (pf-trl adds its own token metrics).")
_SAVE = _trainer("Checkpointing: transformers' Trainer, unchanged; pf-trl adds its sampler state to each checkpoint.")
_HUB = _trainer("Hub upload: transformers' Trainer, unchanged.")
_OPT = _trainer("Optimizer and schedule: transformers' Trainer, unchanged (the gradients are the padded run's).")
_PREC = _trainer("Precision: transformers' Trainer, unchanged. PaddingFreeConfig defaults bf16 on only with CUDA "
                 "(TRL's default, which transformers refuses on CPU).")
_PRECISION_EVIDENCE = "tests/test_precision.py::test_precision_cell"
_AUTOCAST = FieldParity(
    HONOURED, "Autocast, as in TRL (transformers' Trainer); pf-trl's attention kernels cast their inputs to the "
    "autocast dtype as sdpa does and keep softmax statistics and the loss in float32. One step's loss and gradient "
    "errors against float32 are within twice TRL's padded run's, both modes, on CPU: Llama, Gemma 2, Mistral, "
    "gpt-oss, Qwen3.5, Qwen2-VL (docs/training.md, Mixed precision). PaddingFreeConfig defaults bf16 on only with "
    "CUDA (TRL's default, which transformers refuses on CPU).", evidence=_PRECISION_EVIDENCE)
_FP16 = FieldParity(
    HONOURED, "Autocast in float16 with the grad scaler (transformers' Trainer, CUDA only): the bf16 path in float16 "
    "(the same kernel entry and float32 statistics); the float16 cells of the precision matrix run on CUDA only.",
    evidence=_PRECISION_EVIDENCE)
_FULL_EVAL = FieldParity(
    HONOURED, "transformers' Trainer casts the model for evaluation; half-precision weights without autocast are "
    "the precision matrix's bf16_weights cells.", evidence=_PRECISION_EVIDENCE)
_DIST = _trainer("Passed to accelerate / torch.distributed as in TRL; pf-trl's sampler gives every rank the same "
                 "number of token-balanced batches.")
_EVAL = _trainer("Evaluation schedule and loop: transformers' Trainer, unchanged; predictions and labels come one row "
                 "per example, as in a padded run (predict(): in dataset order; evaluate(): in the order the eval "
                 "batches were packed).")
_SCRIPT = FieldParity(NOT_APPLICABLE, "Read by training scripts, not by the Trainer.")


FIELDS: dict[str, FieldParity] = {
    # ---------------------------------------------------------------- what is trained: data
    "max_length": FieldParity(
        HONOURED, "Rows longer than max_length are cut as TRL cuts them (train and eval, tokenized rows and shards "
        "alike), then rows left without a supervised label are dropped; the `truncation` policy may drop or refuse "
        "them instead and the count is logged. None: no limit.",
        evidence="tests/test_trl_parity.py::test_max_length_trains_what_trl_trains"),
    "truncation_mode": FieldParity(
        HONOURED, "keep_start keeps the first max_length tokens, keep_end the last, as in TRL.",
        evidence="tests/test_trl_parity.py::test_max_length_trains_what_trl_trains"),
    "completion_only_loss": FieldParity(
        HONOURED, "True/False as TRL. Unset (None): prompt-completion data trains the completion (TRL's rule), and a "
        "tokenized `completion_mask` column is applied too (TRL would train the full sequence): one log line says "
        "so at construction; pass False for TRL's full-sequence loss.",
        evidence="tests/test_trl_parity.py::test_completion_mask_unset_is_applied_and_said_false_follows_trl"),
    "assistant_only_loss": FieldParity(
        HONOURED, "False: chat rows train every token (TRL's default), True: assistant turns only. PaddingFreeConfig "
        "leaves it unset (None): assistant turns, said in one log line; a converted SFTConfig keeps its value. "
        "`assistant_masks` columns always apply, as in TRL.",
        evidence="tests/test_trl_parity.py::test_assistant_only_loss_false_trains_every_token"),
    "dataset_text_field": FieldParity(
        HONOURED, "The text column pf-trl tokenizes. Plain text without a response template is refused at "
        "construction (pf-trl does not train prompts by accident): name it with PretokenizeConfig(response_template="
        "...) (loss after its last occurrence), or give prompt-completion rows."),
    "dataset_kwargs": FieldParity(
        HONOURED, "skip_prepare_dataset=True: rows are used as given (no truncation, as TRL); mask columns are still "
        "folded into labels (TRL refuses them without labels)."),
    "dataset_num_proc": FieldParity(HONOURED, "Tokenizer processes when pf-trl tokenizes raw rows (same shards)."),
    "shuffle_dataset": FieldParity(
        HONOURED, "The prepared dataset is shuffled once with `seed`, as TRL does (before the token-budget sampler, "
        "which shuffles each epoch itself unless train_sampling_strategy='sequential').",
        evidence="tests/test_trl_parity.py::test_sequential_sampling_trains_trls_batches"),
    "eos_token": FieldParity(
        HONOURED, "Becomes the tokenizer's EOS before pf-trl tokenizes raw rows (TRL sets it in its own __init__), so "
        "text and prompt-completion rows end with it, as in TRL.",
        evidence="tests/test_trl_parity.py::test_prompt_completion_rows_and_eos_token_as_trl"),
    "chat_template_path": FieldParity(
        HONOURED, "A .jinja / .j2 file becomes the tokenizer's chat template before pf-trl tokenizes chat rows (on "
        "pf-trl train: the same setting as --chat_template FILE). A tokenizer folder is refused: cloning its template "
        "adds tokens and resizes the model.",
        refuse_if=lambda v: _set(v) and not str(v).endswith((".jinja", ".j2")), example="some/tokenizer-folder",
        evidence="tests/test_trl_parity.py::test_chat_template_path_jinja_file_as_trl"),
    "packing": FieldParity(
        REFUSED, "pf-trl batches whole examples under a token budget instead of packing fixed-length blocks (which "
        "cut examples); padding_free=False lets TRL pack.",
        refuse_if=_is_true, example=True),
    "packing_strategy": FieldParity(NOT_APPLICABLE, "Only used with packing, which is refused."),
    "eval_packing": FieldParity(
        NOT_APPLICABLE, "Eval batches are token budgets of whole examples already: the eval loss over the same "
        "tokens is the same.", warn_if=_is_true, example=True),
    "padding_free": FieldParity(
        HONOURED, "TRL's bool: True trains padding-free in padding_free_mode (default 'huggingface'), False trains "
        "padded, TRL's own path (padding_free_mode='none'; a converted SFTConfig keeps its value). PaddingFreeConfig "
        "leaves it unset: padding-free. A mode here ('internal', ...) is the deprecated spelling of "
        "padding_free_mode (one FutureWarning).",
        evidence="tests/test_padding_free_mode.py::test_padding_free_false_trains_trls_padded_batches"),
    "pad_to_multiple_of": FieldParity(
        HONOURED, "Appends one dummy segment (labels -100, positions from 0) to the packed row.",
        evidence="tests/test_collator.py::test_pad_to_multiple_of_adds_one_dummy_segment_without_loss"),
    "pad_token": FieldParity(NOT_APPLICABLE, "Deprecated in TRL; a packed row has no padding (the pad id only fills "
                             "the pad_to_multiple_of segment, which carries no loss)."),
    "remove_unused_columns": FieldParity(NOT_APPLICABLE, "The padding-free loader keeps input_ids and labels only "
                                         "(mask columns are folded into labels first)."),
    "label_names": FieldParity(
        REFUSED, "The padding-free loss reads `labels`; other label columns are refused.",
        refuse_if=lambda v: _set(v) and list(v) != ["labels"], example=["target"]),
    "length_column_name": FieldParity(NOT_APPLICABLE, "Read only by group_by_length / batch_rebalance sampling (not "
                                      "applicable); pf-trl's sampler reads the shards' `length` column."),
    # ---------------------------------------------------------------- what is trained: batches and order
    "per_device_train_batch_size": FieldParity(
        HONOURED, "Sets the default token budget: per_device_train_batch_size x mean example length (at least the "
        "longest), so a step holds as many examples on average as a padded batch; max_tokens_per_batch overrides."),
    "per_device_eval_batch_size": FieldParity(HONOURED, "Sets the default eval token budget the same way "
                                              "(max_eval_tokens_per_batch overrides)."),
    "train_sampling_strategy": FieldParity(
        HONOURED, "random (default): examples shuffled each epoch from seed/data_seed; sequential: dataset order, no "
        "shuffle, batches in that order. group_by_length and batch_rebalance only reduce padding, which a packed row "
        "does not have: warned, pf-trl's token-budget packing is used.",
        warn_if=lambda v: v in ("group_by_length", "batch_rebalance"), example="group_by_length",
        evidence="tests/test_trl_parity.py::test_sequential_sampling_trains_trls_batches"),
    "dataloader_drop_last": FieldParity(
        REFUSED, "Token-budget batches have no fixed example count, hence no partial last batch to drop; pf-trl gives "
        "every rank the same number of batches without dropping or repeating an example. Unset it, or use "
        "padding_free=False.",
        refuse_if=_is_true, example=True),
    "seed": FieldParity(HONOURED, "Model init (embedded models), Trainer's RNG, and the sampler's shuffle when "
                        "data_seed is unset."),
    "data_seed": FieldParity(HONOURED, "The sampler's shuffle (batches of every epoch), as the data sampler's seed "
                             "in transformers."),
    "num_train_epochs": FieldParity(
        HONOURED, "Every epoch has the same number of batches and trains every example once.",
        evidence="tests/test_epochs.py::test_three_epochs_each_example_once_and_resume_mid_epoch_two"),
    "max_steps": _trainer(),
    "gradient_accumulation_steps": FieldParity(
        HONOURED, "The loss of a step is divided by the supervised tokens of the whole accumulation window, as TRL's.",
        evidence="tests/test_trainer.py::test_loss_and_weights_equal_padded"),
    "average_tokens_across_devices": FieldParity(
        HONOURED, "The divisor is summed over data-parallel ranks.",
        evidence="tests/test_distributed.py::test_torchrun_two_ranks_match_single_process"),
    "auto_find_batch_size": FieldParity(
        REFUSED, "Its out-of-memory retries shrink per_device_train_batch_size; pf-trl's batches are a token budget "
        "fixed from the data. Set max_tokens_per_batch lower instead.", refuse_if=_is_true, example=True),
    "resume_from_checkpoint": FieldParity(
        HONOURED, "Resumes at the exact batch; refused, naming what changed, when the data (content, not only "
        "lengths), the budget, the seed or the world size differ. \"auto\" (pf-trl's addition): the latest complete "
        "checkpoint (its marker written last), or a fresh start when there is none.",
        evidence="tests/test_trl_parity.py::test_resume_refuses_other_examples_with_the_same_lengths"),
    "ignore_data_skip": _trainer("Trainer's meaning: the resumed epoch starts again from its first batch."),
    "dataloader_num_workers": _trainer("Passed to the padding-free DataLoader."),
    "dataloader_pin_memory": _trainer("Passed to the padding-free DataLoader (off without an accelerator)."),
    "dataloader_persistent_workers": _trainer("Passed to the padding-free DataLoader."),
    "dataloader_prefetch_factor": _trainer("Passed to the padding-free DataLoader."),
    "dataloader_multiprocessing_context": _trainer("Passed to the padding-free DataLoader."),
    "dataloader_in_order": _trainer("Passed to the padding-free DataLoader."),
    # ---------------------------------------------------------------- what is trained: loss
    "loss_type": FieldParity(
        HONOURED, "nll and dft on the supervised positions (chunked_nll: TRL's alias of nll).",
        evidence="tests/test_objective.py::test_dft_equals_padded"),
    "label_smoothing_factor": FieldParity(
        HONOURED, "Smoothed over the supervised positions as transformers' label smoother (refused with dft, where "
        "TRL ignores it).", evidence="tests/test_objective.py::test_label_smoothing_equals_padded"),
    "router_aux_loss_coef": FieldParity(
        HONOURED, "MoE load-balancing loss over the real tokens of the packed row, added as TRL adds it.",
        evidence="tests/test_objective.py::test_moe_aux_loss_equals_padded"),
    "neftune_noise_alpha": FieldParity(
        REFUSED, "NEFTune scales its noise by the row length; a packed row holds many examples, so the noise would "
        "differ from the padded run's.", refuse_if=_set, example=5.0),
    "use_liger_kernel": FieldParity(HONOURED, "Liger's fused cross-entropy on the supervised positions "
                                    "(fused_loss='liger')."),
    "liger_kernel_config": FieldParity(
        HONOURED, "Passed to Liger; fused_linear_cross_entropy (which replaces the model forward) is refused: use "
        "fused_loss='liger'.", refuse_if=lambda v: bool((v or {}).get("fused_linear_cross_entropy")),
        example={"fused_linear_cross_entropy": True}),
    "use_cache": FieldParity(NOT_APPLICABLE, "Training and eval forwards of packed rows always run without a KV cache "
                             "(a cache would let packed examples attend to each other)."),
    # ---------------------------------------------------------------- model
    "model_init_kwargs": FieldParity(
        HONOURED, "When `model` is a name, folder or Hub id (always on pf-trl train, which builds the model): dtype / "
        "torch_dtype, attn_implementation, revision (of a Hub id) and trust_remote_code are used, other keys refused.",
        refuse_if=lambda v: bool(set(v or {}) - {"dtype", "torch_dtype", "attn_implementation", "revision",
                                                 "trust_remote_code"}),
        example={"device_map": "auto"}),
    "trust_remote_code": FieldParity(
        HONOURED, "As in TRL, passed to the config, tokenizer, processor and model loading (model_init_kwargs' "
        "trust_remote_code wins, as TRL's setdefault): a model whose config.json auto_map needs the repository's own "
        "code (a model_type transformers does not ship) is refused without it, in one line before any weights are "
        "downloaded; with it the custom class loads. pf-trl's support matrix covers transformers' own classes, so a "
        "custom class is treated as a model type the matrix does not list: the runtime self-check decides, with a "
        "warning.", evidence="tests/test_hub.py::test_custom_code_model_needs_trust_remote_code_and_is_self_checked"),
    "activation_offloading": _trainer("TRL's offloading context around the training step, unchanged."),
    "activation_checkpointing": _trainer("Trainer's checkpointing; on by default as in TRL."),
    "activation_checkpointing_kwargs": _T,
    "gradient_checkpointing": _trainer("Deprecated alias of activation_checkpointing (transformers 5)."),
    "gradient_checkpointing_kwargs": _T,
    "torch_compile": FieldParity(
        HONOURED, "Packed lengths are marked dynamic: at most two compilations over an epoch.",
        evidence="tests/test_compile.py::test_compiled_trainer_loss_equals_eager"),
    "torch_compile_backend": _T,
    "torch_compile_mode": _T,
    "optim_target_modules": _OPT,
    # ---------------------------------------------------------------- optimizer, precision
    "learning_rate": _OPT, "lr_scheduler_type": _OPT, "lr_scheduler_kwargs": _OPT, "warmup_steps": _OPT,
    "optim": _OPT, "optim_args": _OPT, "weight_decay": _OPT, "adam_beta1": _OPT, "adam_beta2": _OPT,
    "adam_epsilon": _OPT, "max_grad_norm": _OPT,
    "bf16": _AUTOCAST, "fp16": _FP16, "bf16_full_eval": _FULL_EVAL, "fp16_full_eval": _FULL_EVAL, "tf32": _PREC,
    "torch_empty_cache_steps": _T, "full_determinism": _T, "use_cpu": _T,
    # ---------------------------------------------------------------- evaluation
    "eval_strategy": _EVAL, "eval_steps": _EVAL, "eval_delay": _EVAL, "eval_on_start": _EVAL,
    "prediction_loss_only": _EVAL, "eval_do_concat_batches": _EVAL, "eval_use_gather_object": _EVAL,
    "eval_accumulation_steps": _EVAL, "include_for_metrics": _EVAL, "batch_eval_metrics": _EVAL,
    "load_best_model_at_end": _EVAL, "metric_for_best_model": _EVAL, "greater_is_better": _EVAL,
    # ---------------------------------------------------------------- logging, saving, hub
    "output_dir": _T,
    "logging_strategy": _LOG, "logging_steps": _LOG, "logging_first_step": _LOG, "log_on_each_node": _LOG,
    "logging_nan_inf_filter": _LOG, "log_level": _LOG, "log_level_replica": _LOG, "disable_tqdm": _LOG,
    "report_to": _LOG, "run_name": _LOG, "project": _LOG, "trackio_space_id": _LOG, "trackio_bucket_id": _LOG,
    "trackio_static_space_id": _LOG, "skip_memory_metrics": _LOG,
    "include_num_input_tokens_seen": _trainer("Counts real tokens (a packed row has no padding to leave out)."),
    "save_strategy": _SAVE, "save_steps": _SAVE, "save_total_limit": _SAVE, "save_only_model": _SAVE,
    "save_on_each_node": _SAVE, "enable_jit_checkpoint": _SAVE, "restore_callback_states_from_checkpoint": _SAVE,
    "push_to_hub": _HUB, "hub_token": _HUB, "hub_private_repo": _HUB, "hub_model_id": _HUB, "hub_strategy": _HUB,
    "hub_always_push": _HUB, "hub_revision": _HUB,
    # ---------------------------------------------------------------- distributed
    "accelerator_config": _DIST, "parallelism_config": _DIST, "ddp_find_unused_parameters": _DIST,
    "ddp_bucket_cap_mb": _DIST, "ddp_broadcast_buffers": _DIST, "ddp_static_graph": _DIST, "ddp_backend": _DIST,
    "ddp_timeout": _DIST, "fsdp": _DIST, "fsdp_config": _DIST, "deepspeed": _DIST, "local_rank": _DIST,
    "debug": _T,
    "do_train": _SCRIPT, "do_eval": _SCRIPT, "do_predict": _SCRIPT,
}


class ParityError(PfTrlError, ValueError):
    """A configuration field pf-trl cannot reproduce; the message names it and what to do."""


def installed_fields(classes: tuple[type, ...] | None = None) -> list[str]:
    """Init fields of the installed ``SFTConfig`` (which holds every ``TrainingArguments`` field), in order."""
    if classes is None:
        from transformers import TrainingArguments
        from trl import SFTConfig

        classes = (SFTConfig, TrainingArguments)
    names: list[str] = []
    for cls in classes:
        names += [f.name for f in dataclasses.fields(cls) if f.init and f.name not in names]
    return names


def unclassified(classes: tuple[type, ...] | None = None) -> list[str]:
    """Installed fields this table does not classify (an upgrade added them): each needs a decision here."""
    return [name for name in installed_fields(classes) if name not in FIELDS]


def check_config(args: Any) -> None:
    """Raise :class:`ParityError` for the first refused value in ``args``; one warning per field set to no effect.

    Called by :class:`~pf_trl.trainer.PaddingFreeSFTTrainer` at construction in the padding-free modes.
    """
    mode = getattr(args, "padding_free_mode", None)
    for name, entry in FIELDS.items():
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        if entry.refuse_if is not None and entry.refuse_if(value):
            raise ParityError(f"{name}={value!r} is not supported with padding_free_mode={mode!r}: {entry.how}")
        if entry.warn_if is not None and entry.warn_if(value):
            logger.warning("pf-trl: %s=%r has no effect with padding_free_mode=%r: %s", name, value, mode, entry.how)


# ---------------------------------------------------------------------------------------------- the docs page


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
    else:
        return ""
    text = repr(value.value if hasattr(value, "value") and not isinstance(value, (str, int, float)) else value)
    return f"`{text}`" if len(text) <= 24 else f"`{text[:21]}...`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_markdown() -> str:
    """``docs/parity.md`` for the installed TRL / transformers (deterministic: a test compares it to the file)."""
    from transformers import TrainingArguments
    from trl import SFTConfig

    from pf_trl.trainer.config import PaddingFreeConfig

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    sft_fields = {f.name: f for f in dataclasses.fields(SFTConfig)}
    counts = {s: sum(1 for n in sft_fields if FIELDS.get(n, FieldParity("?", "")).status == s) for s in STATUSES}
    lines = [
        "# TRL parity, field by field",
        "",
        "<!-- generated by `python -m pf_trl.trainer.parity --write`; do not edit by hand -->",
        "",
        "Every field of TRL's `SFTConfig` (which holds every field of transformers' `TrainingArguments`), for the "
        "versions pinned in `constraints/cpu.txt`, and what `PaddingFreeSFTTrainer` does with it: "
        f"**{counts[HONOURED]} honoured**, **{counts[REFUSED]} refused** (for the values named), "
        f"**{counts[NOT_APPLICABLE]} not applicable**. A refused value raises when the trainer is built, with a "
        "message naming the field; a field with no effect that you set is named in one warning. Evidence: the test "
        "that checks the field against TRL's padded `SFTTrainer` where pf-trl implements it itself.",
        "",
        "Every field is also a command-line flag of `trl sft` (`--name value`) and of `pf-trl train`, and a key of a "
        "`--config FILE.yaml` (TRL's format: the command line overrides the file, `env:` sets environment "
        "variables first); the flags `trl sft` takes beside `SFTConfig` are listed [below](#trl-sfts-other-flags-"
        "scriptarguments-modelconfig-datasetmixtureconfig).",
        "",
        "The table lives in `pf_trl/trainer/parity.py`; a test fails when an installed TRL or transformers has a "
        "field it does not classify. With `padding_free=False` (`padding_free_mode='none'`) TRL's own behaviour "
        "applies to every field.",
        "",
    ]
    for title, names in (
        ("SFTConfig (TRL)", [n for n in sft_fields if n not in base]),
        ("TrainingArguments (transformers)", [n for n in sft_fields if n in base]),
    ):
        lines += [f"## {title}", "", "| field | default | pf-trl | how | evidence |", "|---|---|---|---|---|"]
        for name in names:
            entry = FIELDS.get(name)
            if entry is None:
                lines.append(f"| `{name}` | {_default(sft_fields[name])} | **unclassified** | | |")
                continue
            status = entry.status
            if entry.refuse_if is not None and entry.status != REFUSED:
                status += f" (refused: `{entry.example!r}`)"
            evidence = f"`{entry.evidence.split('::')[-1]}`" if entry.evidence else ""
            lines.append(f"| `{name}` | {_default(sft_fields[name])} | {status} | {_cell(entry.how)} | {evidence} |")
        lines.append("")
    from pf_trl.trainer.script_parity import render_markdown as script_section

    lines += script_section()
    own = [f for f in dataclasses.fields(PaddingFreeConfig) if f.name not in sft_fields]
    lines += ["## pf-trl's own fields (PaddingFreeConfig)", "", "| field | default | meaning |", "|---|---|---|"]
    for f in own:
        lines.append(f"| `{f.name}` | {_default(f)} | {_cell(str(f.metadata.get('help', '')))} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pf_trl.trainer.parity", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOCS_PAGE}")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is out of date or a field is "
                        "unclassified")
    args = parser.parse_args(argv)
    from pf_trl.trainer import script_parity

    missing = unclassified() + script_parity.unclassified()
    page = render_markdown()
    if args.write:
        DOCS_PAGE.write_text(page, encoding="utf-8")
        print(f"wrote {DOCS_PAGE}")
    elif args.check:
        stale = not DOCS_PAGE.is_file() or DOCS_PAGE.read_text(encoding="utf-8") != page
        if stale:
            print(f"{DOCS_PAGE} is out of date: run python -m pf_trl.trainer.parity --write", file=sys.stderr)
        if missing:
            print(f"unclassified fields: {', '.join(missing)}", file=sys.stderr)
        return int(stale or bool(missing))
    else:
        print(page)
    if missing:
        print(f"unclassified fields (classify them in pf_trl/trainer/parity.py): {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
