"""The mixed-precision matrix: precision x padding-free mode x attention backend, through the trainers users run.

Each cell trains one optimizer step of a tiny model with ``PaddingFreeSFTTrainer`` and compares its loss and its
gradients (captured before the optimizer step) with TRL's padded ``SFTTrainer`` on the same rows, both measured
against TRL's padded float32 run of the same initial weights:

    err_pf  = |loss_pf(precision)  - loss_trl(float32)|      (gradients: the norm of the difference)
    err_trl = |loss_trl(precision) - loss_trl(float32)|
    pass:     err_pf <= 2 * err_trl + floor

so pf-trl may lose at most twice the precision TRL's own padded run loses in the same precision. ``floor`` is the
float32 exactness tolerance of the coverage sweep (``1e-5`` of the loss, ``1e-4`` of the gradient norm): two float32
runs that sum in another order differ by about that much, while one bfloat16 rounding is ``2**-8 = 3.9e-3``, so the
floor only keeps an exactly-equal padded run from making the bound zero; it cannot hide a bfloat16-sized error.

Precisions: ``float32``; ``bf16`` (``bf16=True``: autocast, float32 weights); ``bf16_weights`` (the model loaded in
bfloat16, no autocast: ``--torch_dtype bfloat16``); ``fp16`` (``fp16=True``, autocast and the grad scaler: CUDA
only); ``float64`` (the model in float64, the reference precision). Float32 and float64 cells are exact cells: the
bound is the floor alone.

``python -m pf_trl_dev.precision`` runs the whole matrix and prints the markdown table of docs/training.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import random
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# the families of the matrix: a plain Llama, soft-capped Gemma 2 (attention and final logits), sliding-window Mistral
# (window 4, shorter than every example), gpt-oss (attention sinks, windows), Qwen3.5 (gated delta net hybrid) and
# Qwen2-VL (mRoPE, images)
FAMILIES = ("llama", "gemma2", "mistral", "gpt_oss", "qwen3_5", "qwen2_vl")
PRECISIONS = ("float32", "bf16", "bf16_weights", "fp16", "float64")
FLOAT64_FAMILIES = ("llama", "mistral", "qwen3_5")
MODES = ("huggingface", "internal")
# internal mode's kernels; flash_attn, torch_varlen and flex (which has no backward uncompiled off CUDA) train on
# CUDA only
BACKENDS = {"huggingface": ("auto",), "internal": ("sdpa", "flex", "flash_attn", "torch_varlen")}
CUDA_BACKENDS = ("flash_attn", "torch_varlen", "flex")
LOSS_FLOOR = 1e-5  # relative to the float32 loss (see the module docstring)
GRAD_FLOOR = 1e-4  # relative to the float32 gradient norm
FACTOR = 2.0

LENGTHS = (37, 22, 45, 16, 30)
PROMPTS = (6, 4, 9, 3, 5)


def cell_skip_reason(family: str, precision: str, mode: str, backend: str) -> str | None:
    """Why a cell cannot run here (``None``: it runs)."""
    cuda = torch.cuda.is_available()
    if precision == "fp16" and not cuda:
        return "fp16=True (autocast + grad scaler) trains on CUDA only; the code path is the bf16 one with fp16"
    if family == "gemma2" and precision == "float64":
        return "transformers' own Gemma 2 (eager attention, soft-capped) returns NaN logits in float64: no reference"
    if family == "gpt_oss" and precision == "float64":
        return "transformers' gpt-oss experts run torch's grouped_mm, which takes no float64"
    if precision == "float64" and family not in FLOAT64_FAMILIES:
        return "float64, the reference precision, is checked on Llama, Mistral (windows) and Qwen3.5 (hybrid)"
    if backend in CUDA_BACKENDS and not cuda:
        return f"the {backend} kernel trains on CUDA only"
    if backend in ("flash_attn", "torch_varlen") and precision in ("float32", "float64"):
        return f"the {backend} kernel takes float16/bfloat16 only"
    return None


# ------------------------------------------------------------------------------------------------- data, models


def _no_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for config in (model.config, model.config.get_text_config()):
        for name in ("attention_dropout", "hidden_dropout", "dropout"):
            if isinstance(getattr(config, name, None), float):
                setattr(config, name, 0.0)
    return model


def text_rows(vocab: int, *, seed: int = 0) -> list[dict[str, list[int]]]:
    """Tokenized rows (``input_ids`` + ``labels``, a prompt prefix at -100) of :data:`LENGTHS`."""
    rng = random.Random(seed)
    rows = []
    for n, p in zip(LENGTHS, PROMPTS):
        ids = [1] + [rng.randrange(3, vocab) for _ in range(n - 1)]
        rows.append({"input_ids": ids, "labels": [-100] * p + ids[p:]})
    return rows


@dataclass
class Family:
    """One model family of the matrix: its initial float32 model, its rows and its processing class."""

    name: str
    model: torch.nn.Module
    rows: list[dict[str, Any]]
    processing_class: Any
    vision: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def build_family(name: str) -> Family:
    """The tiny model of ``name`` (float32, dropout off) with its rows: built once, copied for every run."""
    from pf_trl.data.tokenizer import load_tokenizer

    if name == "qwen2_vl":
        from pf_trl_dev.tiny_vlm import random_images, tiny_vlm

        model, processor = tiny_vlm(name)
        imgs = random_images(3, seed=1)
        rows = [
            {"messages": [{"role": "user", "content": "What is it?"},
                          {"role": "assistant", "content": "A cat on a mat."}], "images": [imgs[0]]},
            {"messages": [{"role": "user", "content": "Hi there, how are you"},
                          {"role": "assistant", "content": "Hello there."}], "images": []},
            {"messages": [{"role": "user", "content": "Compare"},
                          {"role": "assistant", "content": "They differ a lot."}], "images": [imgs[1], imgs[2]]},
        ]
        return Family(name, _no_dropout(model), rows, processor, vision=True,
                      extra={"assistant_only_loss": True, "max_length": None})
    from pf_trl_dev.tiny import tiny_model

    model = _no_dropout(tiny_model(name))
    vocab = int(model.config.get_text_config().vocab_size)
    return Family(name, model, text_rows(vocab), load_tokenizer())


def _cast(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    model = copy.deepcopy(model)
    if precision == "bf16_weights":
        return model.to(torch.bfloat16)
    if precision == "float64":
        return model.to(torch.float64)
    return model


def _precision_fields(precision: str) -> dict[str, Any]:
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


# ------------------------------------------------------------------------------------------------- one run


@dataclass
class Run:
    """Loss of the one step and the gradients (float64, flattened in parameter-name order) it applied."""

    loss: float
    grads: torch.Tensor


def _grad_callback(store: dict):
    from transformers import TrainerCallback

    class CaptureGradients(TrainerCallback):
        """The gradients the optimizer is about to apply (after the unscale of fp16's grad scaler)."""

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            named = sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)
            store["grads"] = torch.cat([
                (p.grad.detach().double().reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=torch.float64)).cpu() for _, p in named
            ])

    return CaptureGradients()


def _common_fields(family: Family, out: str, precision: str) -> dict[str, Any]:
    n = len(family.rows)
    return dict(output_dir=out, report_to=[], save_strategy="no", use_cpu=not torch.cuda.is_available(), seed=0,
                dataloader_num_workers=0, disable_tqdm=True, logging_strategy="no", learning_rate=1e-3, max_steps=1,
                per_device_train_batch_size=n, max_grad_norm=1e9, **_precision_fields(precision), **family.extra)


def run_trl(family: Family, precision: str) -> Run:
    """TRL's padded ``SFTTrainer``: one step on all rows in one padded batch."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    store: dict = {}
    args = SFTConfig(**_common_fields(family, tempfile.mkdtemp(prefix="pf-trl-prec-"), precision))
    trainer = SFTTrainer(_cast(family.model, precision), args=args,
                         train_dataset=datasets.Dataset.from_list(family.rows),
                         processing_class=family.processing_class, callbacks=[_grad_callback(store)])
    loss = trainer.train().training_loss
    return Run(float(loss), store["grads"])


def run_model_padded(family: Family, precision: str) -> Run:
    """The model's own padded forward and loss (``labels=``: transformers' token-mean cross-entropy in float32), one
    batch of all rows, under the autocast ``bf16=True`` / ``fp16=True`` would apply: the reference for a head that
    TRL's fused LM head cannot run (it multiplies the last hidden state by the output embeddings directly)."""
    model = _cast(family.model, precision).train()
    width = max(len(r["input_ids"]) for r in family.rows)
    ids = torch.zeros(len(family.rows), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(family.rows):
        n = len(row["input_ids"])
        ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(row["input_ids"]), torch.tensor(row["labels"]), 1
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    with torch.autocast(device, dtype=half or torch.float32, enabled=half is not None):
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device),
                     use_cache=False).loss
    loss.backward()
    named = sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)
    grads = torch.cat([(p.grad.double().reshape(-1) if p.grad is not None
                        else torch.zeros(p.numel(), dtype=torch.float64)).cpu() for _, p in named])
    return Run(float(loss.detach()), grads)


def pf_trainer(family: Family, precision: str, mode: str, backend: str = "auto", **config):
    """``PaddingFreeSFTTrainer`` for one cell: all rows in one packed row (one step), gradients captured."""
    import datasets

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    store: dict = {}
    fields = _common_fields(family, tempfile.mkdtemp(prefix="pf-trl-prec-"), precision)
    fields.pop("per_device_train_batch_size")
    args = PaddingFreeConfig(**fields, padding_free_mode=mode, attention_backend=backend,
                             max_tokens_per_batch=100_000, **config)
    trainer = PaddingFreeSFTTrainer(_cast(family.model, precision), args=args,
                                    train_dataset=datasets.Dataset.from_list(family.rows),
                                    processing_class=family.processing_class, callbacks=[_grad_callback(store)])
    trainer.pf_captured = store
    return trainer


def run_pf(family: Family, precision: str, mode: str, backend: str = "auto", *, corrupt=None) -> Run:
    """One step of pf-trl; ``corrupt(batch) -> batch`` alters each collated batch (the negative controls)."""
    trainer = pf_trainer(family, precision, mode, backend)
    if corrupt is not None:  # wrap the collator the packed dataloader calls
        collate = trainer._pf_collator

        def corrupted(features):
            return corrupt(collate(features))

        trainer._pf_collator = corrupted
    loss = trainer.train().training_loss
    return Run(float(loss), trainer.pf_captured["grads"])


# ------------------------------------------------------------------------------------------------- the criterion


@dataclass
class Cell:
    """One cell's errors against TRL's float32 run and its verdict."""

    family: str
    precision: str
    mode: str
    backend: str
    loss_err_pf: float
    loss_err_trl: float
    grad_err_pf: float
    grad_err_trl: float
    loss_bound: float
    grad_bound: float

    @property
    def loss_ratio(self) -> float:
        """pf-trl's loss error over TRL's (``inf`` when TRL's is 0 and pf-trl's is not)."""
        return _ratio(self.loss_err_pf, self.loss_err_trl)

    @property
    def grad_ratio(self) -> float:
        return _ratio(self.grad_err_pf, self.grad_err_trl)

    @property
    def ok(self) -> bool:
        return self.loss_err_pf <= self.loss_bound and self.grad_err_pf <= self.grad_bound

    def line(self) -> str:
        return (f"{self.family:9s} {self.precision:12s} {self.mode:11s} {self.backend:5s} "
                f"loss err pf {self.loss_err_pf:.3g} trl {self.loss_err_trl:.3g} ratio {self.loss_ratio:.3g} | "
                f"grad err pf {self.grad_err_pf:.3g} trl {self.grad_err_trl:.3g} ratio {self.grad_ratio:.3g} | "
                f"{'ok' if self.ok else 'FAIL'}")


def _ratio(a: float, b: float) -> float:
    if b > 0:
        return a / b
    return 0.0 if a == 0 else math.inf


def judge(family: str, precision: str, mode: str, backend: str, pf: Run, trl: Run, ref: Run) -> Cell:
    """The cell's verdict: pf-trl's error at most :data:`FACTOR` x TRL's in the same precision, plus the floor
    (float32 / float64 cells: the floor alone, both runs being exact)."""
    loss_floor = LOSS_FLOOR * abs(ref.loss)
    grad_floor = GRAD_FLOOR * float(ref.grads.norm())
    loss_pf, loss_trl = abs(pf.loss - ref.loss), abs(trl.loss - ref.loss)
    grad_pf, grad_trl = float((pf.grads - ref.grads).norm()), float((trl.grads - ref.grads).norm())
    exact = precision in ("float32", "float64")
    return Cell(family, precision, mode, backend, loss_pf, loss_trl, grad_pf, grad_trl,
                loss_bound=loss_floor + (0.0 if exact else FACTOR * loss_trl),
                grad_bound=grad_floor + (0.0 if exact else FACTOR * grad_trl))


# ------------------------------------------------------------------------------------------------- the matrix


class Matrix:
    """Builds each family once and TRL's padded runs once per (family, precision)."""

    def __init__(self) -> None:
        self.families: dict[str, Family] = {}
        self.trl: dict[tuple[str, str], Run] = {}

    def family(self, name: str) -> Family:
        if name not in self.families:
            self.families[name] = build_family(name)
        return self.families[name]

    def trl_run(self, name: str, precision: str) -> Run:
        key = (name, precision)
        if key not in self.trl:
            self.trl[key] = run_trl(self.family(name), precision)
        return self.trl[key]

    def cell(self, name: str, precision: str, mode: str, backend: str = "auto", *, corrupt=None) -> Cell:
        family = self.family(name)
        pf = run_pf(family, precision, mode, backend, corrupt=corrupt)
        # float32 cells are judged against TRL's float32 run itself; float64 ones against TRL's float64 run
        reference = self.trl_run(name, "float64" if precision == "float64" else "float32")
        return judge(name, precision, mode, backend, pf, self.trl_run(name, precision), reference)


def all_cells() -> list[tuple[str, str, str, str]]:
    return [(f, p, m, b) for f in FAMILIES for p in PRECISIONS for m in MODES for b in BACKENDS[m]]


def markdown(cells: list[Cell]) -> str:
    """The table of docs/training.md: each cell's errors against float32 and the ratio pf-trl / TRL padded."""
    lines = ["| model | precision | mode | backend | loss err pf-trl | loss err TRL | ratio | grad err pf-trl | "
             "grad err TRL | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        if c.precision in ("float32", "float64"):  # exact cells: the reference is TRL's run in that precision
            trl_loss = trl_grad = loss_ratio = grad_ratio = "ref."
        else:
            trl_loss, trl_grad = f"{c.loss_err_trl:.2g}", f"{c.grad_err_trl:.2g}"
            loss_ratio, grad_ratio = f"{c.loss_ratio:.2f}", f"{c.grad_ratio:.2f}"
        lines.append(f"| {c.family} | {c.precision} | {c.mode} | {c.backend} | {c.loss_err_pf:.2g} | {trl_loss} | "
                     f"{loss_ratio} | {c.grad_err_pf:.2g} | {trl_grad} | {grad_ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pf_trl_dev.precision", description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=PRECISIONS)
    parser.add_argument("--json", help="also write the cells to this JSON file")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    matrix, cells, failed = Matrix(), [], 0
    for family, precision, mode, backend in all_cells():
        if family not in args.families or precision not in args.precisions:
            continue
        reason = cell_skip_reason(family, precision, mode, backend)
        if reason:
            print(f"{family} {precision} {mode} {backend}: skipped ({reason})", flush=True)
            continue
        cell = matrix.cell(family, precision, mode, backend)
        failed += not cell.ok
        cells.append(cell)
        print(cell.line(), flush=True)
    print(markdown(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(c), "loss_ratio": c.loss_ratio, "grad_ratio": c.grad_ratio, "ok": c.ok}
                       for c in cells], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
