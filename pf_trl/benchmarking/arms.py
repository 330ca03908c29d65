"""The arms of the end-to-end GPU bench: one trainer each, the same model shape, data and seed.

=====================  ==========================================================================================
arm                    what runs
=====================  ==========================================================================================
trl-padded             stock TRL ``SFTTrainer``, batches padded to their longest row (sdpa)
trl-pf-sdpa            stock TRL ``padding_free=True`` as a TRL user runs it: sdpa, transformers' packed-sequence
                       mask from ``position_ids``
trl-pf-best            stock TRL ``padding_free=True`` with the best attention transformers offers here:
                       ``flash_attention_4`` / ``_3`` / ``_2`` when its package is installed, else
                       ``flex_attention``
pf-trl                 ``PaddingFreeSFTTrainer``, ``padding_free_mode=internal``, varlen backend ``auto``
pf-trl-hf              ``PaddingFreeSFTTrainer``, ``padding_free_mode=huggingface`` with the same attention as
                       ``trl-pf-best``
pf-trl-compile         ``pf-trl`` + ``torch_compile=True``
pf-trl-liger           ``pf-trl`` + Liger's fused linear cross-entropy (``fused_loss=liger``)
pf-trl-same-batches    ``pf-trl`` on the padded arm's batches: step i holds the same ``batch_size`` rows as
                       ``trl-padded``'s step i (the seed experiment's like-for-like arm: padding removed, nothing
                       else changed)
=====================  ==========================================================================================

The TRL arms take ``batch_size`` rows per step (in dataset order with ``BenchSetup.sequential``); the pf-trl arms
but ``pf-trl-same-batches`` take a token budget of ``batch_size`` x the mean
row length (so a step holds about as many real tokens). Every arm is measured by the same code
(:class:`~pf_trl.trainer.accounting.TokenAccountingMixin` counts, :class:`~pf_trl.benchmarking.steady.StepTimer`
times).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

# in order of priority: a run cut short by its deadline loses the last ones
ARMS = ("trl-padded", "pf-trl", "trl-pf-sdpa", "trl-pf-best", "pf-trl-hf", "pf-trl-compile", "pf-trl-liger")
# the seed experiment: padded, padding removed with nothing else changed, then our token budget
SEED_ARMS = ("trl-padded", "pf-trl-same-batches", "pf-trl")
KNOWN_ARMS = ARMS + ("pf-trl-same-batches",)


@dataclass
class BenchSetup:
    model: str
    dtype: str = "bfloat16"
    batch_size: int = 8
    learning_rate: float = 1e-5
    activation_checkpointing: bool = False
    optim: str = "adamw_torch"
    seed: int = 0
    model_overrides: dict[str, Any] = field(default_factory=dict)
    compile_backend: str | None = None  # torch.compile backend of pf-trl-compile (None: inductor)
    sequential: bool = False  # TRL arms take the rows in dataset order (pf-trl-same-batches then matches them)


class FixedBatchSampler:
    """Consecutive groups of ``batch_size`` dataset indices in dataset order: the batches of a padded run with a
    sequential sampler, for ``PaddingFreeSFTTrainer``'s batch-sampler hook (one packed row per batch)."""

    def __init__(self, lengths, batch_size: int) -> None:
        n = len(lengths)
        self.batches = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
        self.max_tokens = int(max(sum(int(lengths[i]) for i in b) for b in self.batches)) if n else 0

    def __iter__(self):
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:  # the same batches every epoch
        pass


def best_transformers_attention(cuda: bool) -> tuple[str, str]:
    """(attn_implementation, why): the flash implementation whose package is installed, else flex_attention."""
    from pf_trl.attention.flash_packages import transformers_flash_implementation

    if not cuda:
        return "sdpa", "sdpa (on CPU: no flash-attention, and flex_attention has no CPU backward)"
    import torch

    major = torch.cuda.get_device_capability()[0]
    impl, why = transformers_flash_implementation(major)
    return (impl, why) if impl else ("flex_attention", f"flex_attention ({why})")


def pad_only_tokenizer():
    """A tokenizer that only names the special tokens of the embedded models (bos 1, eos 2, pad = eos, as Mistral
    fine-tunes commonly set it): TRL's collators need a pad id; the rows are already token ids, so nothing is
    tokenized (``skip_prepare_dataset``), and the GPU machine needs no tokenizer files."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


def skip_reason(arm: str, cuda: bool) -> str | None:
    """Why an arm cannot run here (None: it can)."""
    if arm == "pf-trl-liger":
        try:
            import liger_kernel  # noqa: F401
        except Exception:
            return "liger-kernel is not installed"
        if not cuda:
            return "Liger's kernels are Triton (CUDA)"
    return None


def build_model(setup: BenchSetup, attn: str, cuda: bool):
    """The embedded model, random init, built on the device in its dtype (a 7B never passes through host memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pf_trl.models import embedded_config

    config = embedded_config(setup.model, **setup.model_overrides)
    dtype = getattr(torch, setup.dtype)
    torch.manual_seed(setup.seed)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    model.pf_trl_base = setup.model
    return model


def build_trainer(arm: str, setup: BenchSetup, rows: list[dict], *, budget: int, max_steps: int, cuda: bool,
                  output_dir: str, callbacks: list) -> tuple[Any, dict[str, Any]]:
    """(trainer, description) for one arm (:data:`KNOWN_ARMS`; another name raises ValueError)."""
    if arm not in KNOWN_ARMS:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(KNOWN_ARMS)}")
    from datasets import Dataset
    from trl import SFTConfig

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.trainer.accounting import MeasuredSFTTrainer

    best, best_why = best_transformers_attention(cuda)
    attn = {"trl-pf-best": best, "pf-trl-hf": best}.get(arm, "sdpa")
    model = build_model(setup, attn, cuda)
    common = dict(
        output_dir=output_dir, max_steps=max_steps, num_train_epochs=1, learning_rate=setup.learning_rate,
        seed=setup.seed,
        report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True, use_cpu=not cuda,
        bf16=cuda and setup.dtype == "bfloat16", dataloader_num_workers=0, optim=setup.optim,
        gradient_checkpointing=setup.activation_checkpointing, lr_scheduler_type="constant",
        train_sampling_strategy="sequential" if setup.sequential else "random",
    )
    ds = Dataset.from_list(rows)
    described: dict[str, Any] = {"arm": arm, "attn_implementation": attn}
    if arm.startswith("trl-"):
        # both spellings: TRL defaults the deprecated `gradient_checkpointing` to True
        args = SFTConfig(per_device_train_batch_size=setup.batch_size, max_length=None,
                         activation_checkpointing=setup.activation_checkpointing,
                         padding_free=arm != "trl-padded", dataset_kwargs={"skip_prepare_dataset": True}, **common)
        trainer = MeasuredSFTTrainer(model, args=args, train_dataset=ds, callbacks=callbacks,
                                     processing_class=pad_only_tokenizer())
        described["batch"] = f"{setup.batch_size} rows"
        if arm == "trl-pf-best":
            described["attention_choice"] = best_why
        return trainer, described
    mode = "huggingface" if arm == "pf-trl-hf" else "internal"
    args = PaddingFreeConfig(
        padding_free_mode=mode, per_device_train_batch_size=setup.batch_size, max_tokens_per_batch=int(budget),
        max_length=None, torch_compile=arm == "pf-trl-compile", fused_loss="liger" if arm == "pf-trl-liger" else "auto",
        activation_checkpointing=setup.activation_checkpointing, **{k: v for k, v in common.items()
                                                                     if k != "gradient_checkpointing"})
    if args.torch_compile and setup.compile_backend:
        args.torch_compile_backend = setup.compile_backend
    if arm == "pf-trl-same-batches":
        trainer = same_batches_trainer_class()(model, args=args, train_dataset=ds, callbacks=callbacks)
        described["batch"] = f"{setup.batch_size} rows (the padded arm's batches, one packed row each)"
    else:
        trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=ds, callbacks=callbacks)
        described["batch"] = f"budget {budget} tokens"
    if mode == "internal":
        import torch

        from pf_trl.attention.dispatch import resolve_backend

        dev = torch.device("cuda" if cuda else "cpu")
        described["varlen_backend"] = resolve_backend("auto", device=dev, dtype=getattr(torch, setup.dtype),
                                                      head_dim=model.config.hidden_size
                                                      // model.config.num_attention_heads, gqa=True,
                                                      requires_grad=True)
        if "flash_attn" == described["varlen_backend"]:
            from pf_trl.attention.backends.flash_attn import kernel_for

            described["varlen_kernel"] = kernel_for(dev)[0]
    return trainer, described


@functools.cache
def same_batches_trainer_class():
    """``PaddingFreeSFTTrainer`` subclass that trains on :class:`FixedBatchSampler` batches (its sampler hook)."""
    from pf_trl.data.prepare import dataset_lengths
    from pf_trl.trainer import PaddingFreeSFTTrainer

    class SameBatchesTrainer(PaddingFreeSFTTrainer):
        """``PaddingFreeSFTTrainer`` whose training batches are the padded run's (:class:`FixedBatchSampler`)."""

        def _pf_sampler(self, dataset, budget, batch_size, *, shuffle, ordered=False):
            return FixedBatchSampler(dataset_lengths(dataset), batch_size)

    return SameBatchesTrainer

