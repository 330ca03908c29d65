"""PaddingFreeConfig: TRL's SFTConfig plus the padding-free options."""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from trl import SFTConfig

from pf_trl.data.truncation import POLICY_HELP, check_mode, normalize_policy
from pf_trl.errors import ConfigError
from pf_trl.trainer.loss import FUSED_LOSS_CHOICES
from pf_trl.trainer.modes import (
    DEFAULT_MODE,
    PADDING_FREE_MODES,
    legacy_mode,
    resolve_padding_free,
)

logger = logging.getLogger("pf_trl.trainer")


def _accelerator_present() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


@dataclass
class PaddingFreeConfig(SFTConfig):
    """:class:`trl.SFTConfig` plus padding-free training options.

    ``padding_free`` keeps TRL's meaning: ``True`` (or unset) trains padding-free in ``padding_free_mode``, ``False``
    trains padded (``padding_free_mode='none'``). ``padding_free_mode``: ``huggingface`` uses transformers' native
    packed attention (self-checked), ``internal`` pf-trl's ``pf_varlen`` kernels, ``none`` trains padded (TRL's
    collator and sampler) with pf-trl's honest metrics. The old spelling ``padding_free="internal"`` (a mode) is still
    accepted, with one ``FutureWarning``.
    """

    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "TRL's switch: True trains padding-free in --padding_free_mode, False trains padded (TRL's path, "
            "--padding_free_mode none). Unset: padding-free. A mode here (huggingface / internal / none) is the "
            "deprecated spelling of --padding_free_mode.",
            "nargs": "?",
            "const": True,
        },
    )
    padding_free_mode: str | None = field(
        default=None,
        metadata={
            "help": f"pf-trl's padding-free mode: 'huggingface' (transformers' native packed attention, self-checked), "
            "'internal' (pf-trl's varlen kernels) or 'none' (padded batches, TRL's path). Unset: "
            f"'{DEFAULT_MODE}', or 'none' with --padding_free False.",
            "choices": list(PADDING_FREE_MODES),
        },
    )
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one per-device micro-batch (one packed row). Default: "
            "per_device_train_batch_size x mean example length of the training set (at least the longest example), "
            "so that steps hold as many examples on average as a padded run with that batch size."
        },
    )
    max_eval_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": "Token budget of an eval micro-batch. Default: per_device_eval_batch_size x mean eval length."},
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "Varlen kernel for padding_free_mode='internal': auto, flash_attn, torch_varlen, flex, "
                  "sdpa."},
    )
    fused_loss: str = field(
        default="auto",
        metadata={
            "help": "Loss without full logits: 'auto' (Liger's fused CE with use_liger_kernel, else chunked), "
            "'chunked' (TRL's kernel on CUDA/XPU, checkpointed token chunks elsewhere), 'liger', or 'none' (plain "
            "logits of the supervised positions).",
            "choices": list(FUSED_LOSS_CHOICES),
        },
    )
    loss_chunk_size: int = field(default=1024, metadata={"help": "Supervised tokens per chunk of the checkpointed loss "
                                                          "(CPU, adapted heads, label smoothing)."})
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "Peak dense TFLOP/s of one device, for the MFU metric (known CUDA GPUs are detected)."},
    )
    include_tokens_per_second: bool = field(
        default=False,
        metadata={"help": "Seed-compatible flag: report train_tokens_per_second (real, non-padding tokens)."},
    )
    use_flash_attn: bool = field(
        default=False,
        metadata={"help": "Use flash-attn; without it installed pf-trl's varlen attention is used (one-line notice)."},
    )
    # TRL's config defaults the deprecated alias `gradient_checkpointing` to True, which makes transformers 5 warn on
    # every run. Default the current name instead (the same behaviour: checkpointing on, as in TRL); a user who
    # passes the old name still gets transformers' deprecation notice, rightly.
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing` (transformers 5).", "nargs": "?", "const": True},
    )
    activation_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Activation (gradient) checkpointing: less memory, about a fifth slower. Default: on, as in TRL.",
                  "nargs": "?", "const": True},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that holds checkpoints of an earlier run without resuming from them: "
                  "they are deleted at the start. Without it (and without resume_from_checkpoint) such a run is "
                  "refused, naming the latest checkpoint."},
    )
    eval_max_examples: int | None = field(
        default=None,
        metadata={"help": "Evaluate on this many examples of each eval set: a fixed random subset (seed 0), the same "
                  "examples at every evaluation and in every run. Default: the whole eval set. Alias --max_eval_samples."},
    )
    stream_buffer_size: int = field(
        default=1024,
        metadata={"help": "Streamed training data (an IterableDataset): examples read ahead and packed to the token "
                  "budget together. Memory is bounded by it; larger fills batches closer to the budget."},
    )
    # TRL's default False trains every token of a chat; unset, pf-trl trains the assistant turns (and says so)
    assistant_only_loss: bool | None = field(
        default=None,
        metadata={"help": "Chat data: loss on assistant turns only (True) or on every token (False, TRL's default). "
                  "Unset: assistant turns, said in one log line. Tokenized assistant_masks always apply."},
    )
    truncation: str = field(
        default="truncate",
        metadata={"help": POLICY_HELP},
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Ulysses sequence parallelism: ranks that share one packed row (consecutive ranks; each "
                  "keeps 1/N of the tokens and attends the whole row for 1/N of the heads). Needs N processes per "
                  "group (torchrun) and heads divisible by N; the token budget is per group. 1 = off."},
    )
    allow_unverified: bool = field(
        default=False,
        metadata={"help": "Accept a model type that pf-trl's coverage sweep has no evidence for (docs/models.md), "
                  "relying on the runtime self-check alone. Types the sweep found inexact stay refused."},
    )

    def __post_init__(self):
        self.padding_free, self.padding_free_mode = resolve_padding_free(self.padding_free, self.padding_free_mode,
                                                                         stacklevel=3)
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default, under the name transformers 5 reads
        if self.dataloader_pin_memory and (self.use_cpu or not _accelerator_present()):
            # pinned host memory only helps copies to an accelerator; without one torch warns on every dataloader
            self.dataloader_pin_memory = False
        if self.bf16 is None:
            # TRL defaults to bf16 autocast, which transformers refuses without a GPU: only default to it on CUDA
            import torch

            self.bf16 = (not self.fp16) and torch.cuda.is_available() and not self.use_cpu
        super().__post_init__()
        from pf_trl.parallel.checks import check_launch

        check_launch(self)  # before the model loads: ZeRO-3 partitions it at load with DeepSpeed's world size
        if self.max_tokens_per_batch is not None and self.max_tokens_per_batch <= 0:
            raise ConfigError(f"max_tokens_per_batch must be a positive integer, got {self.max_tokens_per_batch}")
        if self.max_eval_tokens_per_batch is not None and self.max_eval_tokens_per_batch <= 0:
            raise ConfigError(f"max_eval_tokens_per_batch must be positive, got {self.max_eval_tokens_per_batch}")
        if self.eval_max_examples is not None and self.eval_max_examples <= 0:
            raise ConfigError(f"eval_max_examples must be a positive integer, got {self.eval_max_examples}")
        if self.stream_buffer_size < 1:
            raise ConfigError(f"stream_buffer_size must be a positive integer, got {self.stream_buffer_size}")
        if self.fused_loss not in FUSED_LOSS_CHOICES:
            raise ConfigError(f"fused_loss must be one of {FUSED_LOSS_CHOICES}, got {self.fused_loss!r}")
        self.truncation = normalize_policy(self.truncation)
        check_mode(self.truncation_mode)
        if not isinstance(self.sequence_parallel_size, int) or self.sequence_parallel_size < 1:
            raise ConfigError(f"sequence_parallel_size must be a positive integer, got {self.sequence_parallel_size!r}")
        if self.loss_chunk_size < 1:
            raise ConfigError(f"loss_chunk_size must be >= 1, got {self.loss_chunk_size}")
        if self.padding_free_mode != "none" and self.packing:
            raise ConfigError(
                f"packing=True conflicts with padding_free_mode={self.padding_free_mode!r}: pf-trl batches whole "
                "examples under a token budget instead of packing fixed-length blocks. Use --packing False (or "
                "--padding_free False to let TRL pack)."
            )
        if self.padding_free_mode == "huggingface" and self.attention_backend not in ("auto", None):
            raise ConfigError(
                f"attention_backend={self.attention_backend!r} selects one of pf-trl's kernels and needs "
                "--padding_free_mode internal"
            )
        if self.include_tokens_per_second and self.include_num_input_tokens_seen == "no":
            self.include_num_input_tokens_seen = "non_padding"

    @property
    def is_padding_free(self) -> bool:
        return self.padding_free_mode != "none"

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (``training_args.bin``), also a config saved by pf-trl before ``padding_free_mode``: its
        ``padding_free`` held the mode (``"huggingface"``), which becomes ``padding_free_mode`` here."""
        state = dict(state)
        old = legacy_mode(state.get("padding_free"))
        if "padding_free_mode" not in state or old is not None:
            padded = state.get("padding_free") is False
            state["padding_free_mode"] = old or ("none" if padded else DEFAULT_MODE)
            state["padding_free"] = state["padding_free_mode"] != "none"
        self.__dict__.update(state)


def _plain_value(value: Any) -> Any:
    """A field value as its dataclass ``__post_init__`` accepts it again: enums by value, containers copied.

    Objects (``AcceleratorConfig``, a ``ParallelismConfig``, a quantization config inside ``model_init_kwargs``) are
    kept as objects, and strings as they are: ``TrainingArguments.to_dict()`` would mask every ``*_token`` field.
    """
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_plain_value(v) for v in value]
    try:
        return copy.deepcopy(value)
    except Exception:  # an object that cannot be copied (e.g. a device mesh) is shared, not lost
        return value


def to_padding_free_config(args: Any) -> PaddingFreeConfig:
    """Convert a ``TrainingArguments`` / ``SFTConfig`` (or subclass) into a :class:`PaddingFreeConfig`, field by field.

    Every init field the two classes share is copied with its value (``eos_token``, ``pad_token``, ``hub_token``
    included; ``to_dict()`` would replace them with ``'<EOS_TOKEN>'`` etc.). Fields that ``PaddingFreeConfig`` does
    not have (a user subclass's own) are named in a warning. The argument object is not modified.

    ``padding_free``: a plain ``SFTConfig`` carries TRL's bool, ``False`` by default, which cannot be told apart from a
    choice. Handed to the padding-free trainer it trains padding-free (``padding_free_mode='huggingface'``), said in a
    log line; padded training is ``padding_free_mode='none'`` (or ``PaddingFreeConfig(padding_free=False)``).
    """
    if isinstance(args, PaddingFreeConfig):
        return args
    ours = {f.name for f in dataclasses.fields(PaddingFreeConfig) if f.init}
    theirs = [f.name for f in dataclasses.fields(args) if f.init]
    values = {name: _plain_value(getattr(args, name)) for name in theirs if name in ours}
    dropped = sorted(set(theirs) - ours)
    if dropped:
        logger.warning("pf-trl: %s fields not in PaddingFreeConfig are ignored: %s", type(args).__name__, ", ".join(dropped))
    if values.get("padding_free") is False:
        del values["padding_free"]  # unset: pf-trl's default mode (with TRL's packing=True: refused, naming both)
        logger.warning(
            "pf-trl: args is a %s with padding_free=False (TRL's default); PaddingFreeSFTTrainer trains padding-free "
            "(padding_free_mode='huggingface'). For padded batches pass padding_free_mode='none'.", type(args).__name__)
    config = PaddingFreeConfig(**values)  # a mode string in padding_free (a subclass of the old spelling): warned
    logger.info("pf-trl: args is a %s; converted to PaddingFreeConfig (padding_free_mode=%r)", type(args).__name__,
                config.padding_free_mode)
    return config
