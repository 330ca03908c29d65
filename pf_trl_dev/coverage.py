"""The coverage sweep: every causal-LM type of the installed transformers, padded vs one packed row, both modes.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` a tiny model is built from the type's own defaults
(:mod:`pf_trl_dev.tiny`) and five examples (one of a single token) are run:

- reference: right-padded batch with ``attention_mask``, no ``position_ids`` (the model's own position convention):
  per-example loss from the logits, and the model's own ``loss`` with its gradients;
- negative control: the same examples in one row *without* per-example positions (what cross-example attention
  looks like); if it does not move the per-example loss by more than ``LEAK_MIN``, the comparison could not see a
  leak and the type is ``inconclusive``;
- per mode (``huggingface``, ``internal``), with no evidence consulted (admission by pf-trl's structural checks and
  its self-check alone, as ``allow_unverified=True`` does for an unknown type):
  - model path: ``model(**PaddingFreeCollator()(examples))`` as a user would call it (config default
    ``use_cache=True``: the KV-cache hole), per-example loss vs the reference;
  - trainer path: ``PaddingFreeSFTTrainer.compute_loss`` on the collated batch, loss and gradients vs the model's
    own padded loss (the self-check of its ``enable_padding_free``, on another copy of the same model in the same
    mode, is the model path's, replayed rather than run twice).

Status per type and mode: ``exact``, ``refused`` (pf-trl refused it before training, with its reason), ``mismatch``
(admitted but not equal: the matrix then refuses it), ``crash`` (an error that is not a refusal), ``unbuilt`` (no
tiny config could be built: no evidence), ``inconclusive``.

``python -m pf_trl_dev.coverage --write`` sweeps the installed transformers and puts its results into
``pf_trl/attention/support.json`` (read at run time by :mod:`pf_trl.attention.support`), next to those of the other
releases swept before (:mod:`pf_trl.attention.evidence`), and regenerates ``docs/models.md``; ``--check`` exits 1
when the committed files are stale for the installed transformers. Run it once per release (CI sweeps the pinned
one and the newest, ``scripts/test_newest.sh``). Runs one type at a time in this process (a few minutes on 2 CPU
cores); nothing is cached between runs.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from pf_trl.attention import evidence, support
from pf_trl.attention.errors import PaddingFreeError

MODES = ("huggingface", "internal")
LENGTHS = (9, 1, 14, 5, 11)  # uneven, one single-token example, longer than the tiny sliding window (4)
LOSS_ATOL = 1e-5  # per-example mean loss, float32
GRAD_RTOL = 1e-4  # per-parameter relative gradient error, float32
LEAK_MIN = 1e-3  # the negative control must move some example's loss by at least this much

# the attention is exact (model path) but the trainer's loss is not: pf-trl's loss path computes cross-entropy on
# hidden states x output embeddings and misses what the model's head does on top
TRAINER_ONLY = (
    "the packed attention is exact, but pf-trl's loss path (hidden states x output embeddings) does not reproduce this "
    "model's head (logit scaling or softcapping, a head transform, an auxiliary loss)"
)

DOCS_PATH = Path(__file__).resolve().parents[1] / "docs" / "models.md"


# ------------------------------------------------------------------------------------------------- helpers


def _examples(config, n_vocab: int, seed: int = 0, lengths=LENGTHS) -> list[torch.Tensor]:
    from pf_trl.attention.enable import special_token_ids

    avoid = special_token_ids(config)
    allowed = torch.tensor([i for i in range(min(n_vocab, 256)) if i not in avoid and i >= 3])
    g = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, len(allowed), (n,), generator=g)] for n in lengths]


def _vocab(config) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", 0) or 0)


def _no_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def _per_example_nll(logits: torch.Tensor, exs, starts) -> list[float | None]:
    out: list[float | None] = []
    for e, (row, start) in zip(exs, starts):
        if len(e) < 2:
            out.append(None)
            continue
        lg = logits[row, start : start + len(e) - 1].float()
        out.append(float(torch.nn.functional.cross_entropy(lg, e[1:].to(lg.device))))
    return out


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b) if x is not None and y is not None)


def _first_error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]


def _padded(exs, pad_id: int):
    n = max(len(e) for e in exs)
    ids = torch.full((len(exs), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(exs), n, dtype=torch.long)
    labels = torch.full((len(exs), n), -100, dtype=torch.long)
    for i, e in enumerate(exs):
        ids[i, : len(e)] = e
        mask[i, : len(e)] = 1
        labels[i, : len(e)] = e
    return ids, mask, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_error(test: dict, ref: dict) -> float:
    worst = 0.0
    for name, g in ref.items():
        other = test.get(name)
        denom = float(g.norm())
        if other is None:
            if denom > 1e-8:
                return float("inf")
            continue
        if denom < 1e-8:
            worst = max(worst, float(other.norm()))
            continue
        worst = max(worst, float((other - g).norm()) / denom)
    extra = set(test) - set(ref)
    if any(float(test[n].norm()) > 1e-8 for n in extra):
        return float("inf")
    return worst


@contextlib.contextmanager
def _quiet():
    """The sweep builds ~200 models: keep transformers' per-model warnings out of the output."""
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    pf_logger = logging.getLogger("pf_trl")
    pf_level = pf_logger.level
    pf_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)
        pf_logger.setLevel(pf_level)


@contextlib.contextmanager
def _package_checks_cached():
    """accelerate answers ``is_peft_available`` / ``is_deepspeed_available`` by parsing the package's metadata on
    every call, several times per trainer built (~0.1 s each on these CPUs): the sweep builds ~400 trainers in one
    process whose installed packages do not change, so each answer is read once."""
    import functools

    from accelerate.utils import imports

    original = imports._is_package_available
    if isinstance(original, functools._lru_cache_wrapper):  # already cached by an enclosing sweep
        yield
        return
    imports._is_package_available = functools.cache(original)
    try:
        yield
    finally:
        imports._is_package_available = original


def _self_check_key(model) -> tuple[str, Any]:
    from pf_trl._compat import attn_implementation

    return type(model).__name__, attn_implementation(model.config)


@contextlib.contextmanager
def _self_checks_recorded(outcomes: list):
    """Run pf-trl's self-checks as they are, appending each outcome (its key, its result or its error) to
    ``outcomes``, in call order."""
    from pf_trl.attention import enable

    real = enable.self_check

    def recorded(model, **kwargs):
        key = _self_check_key(model)
        try:
            result = real(model, **kwargs)
        except Exception as exc:
            outcomes.append((key, kwargs, None, exc))
            raise
        outcomes.append((key, kwargs, result, None))
        return result

    enable.self_check = recorded
    try:
        yield
    finally:
        enable.self_check = real


@contextlib.contextmanager
def _self_checks_replayed(outcomes: list):
    """The trainer path's ``enable_padding_free`` runs on another copy of the same model, in the same mode, as the
    model path just did: its self-checks (same inputs, eval mode, no gradient) are that run's, replayed in order
    instead of computed twice. A call that does not match the next recorded one (another class or attention
    implementation, other arguments) and every call after it run for real."""
    from pf_trl.attention import enable

    real = enable.self_check
    pending = list(outcomes)

    def replayed(model, **kwargs):
        if pending and pending[0][:2] == (_self_check_key(model), kwargs):
            _, _, result, error = pending.pop(0)
            if error is not None:
                raise error
            return dict(result)
        pending.clear()
        return real(model, **kwargs)

    enable.self_check = replayed
    try:
        yield
    finally:
        enable.self_check = real


# --------------------------------------------------------------------------------------------- one type


class _Sweep:
    """State shared across types (the tokenizer and a one-row dataset the trainer's constructor wants)."""

    def __init__(self) -> None:
        import datasets

        from pf_trl.data.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer()
        self.dataset = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7]], "labels": [[5, 6, 7]]})
        self.tmp = tempfile.mkdtemp(prefix="pf-trl-coverage-")

    def trainer(self, model, mode: str):
        from pf_trl.trainer.config import PaddingFreeConfig
        from pf_trl.trainer.trainer import PaddingFreeSFTTrainer

        args = PaddingFreeConfig(
            output_dir=self.tmp, padding_free_mode=mode, report_to=[], use_cpu=True, save_strategy="no",
            logging_strategy="no", disable_tqdm=True, allow_unverified=True,
        )
        return PaddingFreeSFTTrainer(model=model, args=args, processing_class=self.tokenizer, train_dataset=self.dataset)


def _trl_router_kwargs(model) -> dict[str, bool]:
    """TRL's SFTTrainer trains a MoE model with its load-balancing loss (``output_router_logits`` on) whenever the
    config has a non-zero ``router_aux_loss_coef``; the padded reference does the same, so the model adds
    ``coef * aux`` (computed with the padding mask) to its loss."""
    text = model.config.get_text_config()
    if hasattr(text, "output_router_logits") and getattr(text, "router_aux_loss_coef", 0.0):
        return {"output_router_logits": True}
    return {}


def _reference(base, exs, pad_id: int) -> dict[str, Any]:
    """The padded run on a copy of ``base``; ``"model"`` is that copy (the leak control reuses it)."""
    model = copy.deepcopy(base)
    ids, mask, labels = _padded(exs, pad_id)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False, **_trl_router_kwargs(model))
    per_example = _per_example_nll(out.logits.detach(), exs, [(i, 0) for i in range(len(exs))])
    out.loss.backward()
    return {"per_example": per_example, "loss": float(out.loss), "grads": _grads(model), "model": model}


def _packed_batch(exs):
    from pf_trl.batching.collator import PaddingFreeCollator

    return PaddingFreeCollator()([{"input_ids": e} for e in exs])


def _starts(exs):
    starts, pos = [], 0
    for e in exs:
        starts.append((0, pos))
        pos += len(e)
    return starts


def _leak(exs, ref) -> float:
    """Negative control: one row, positions running on across examples (cross-example attention).

    A gradient-free forward on the reference's copy of the model (not a fresh one): pf-trl never touched it, and
    its gradients do not enter a forward."""
    model = ref.pop("model")
    ids = torch.cat(exs)[None]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    return _max_diff(_per_example_nll(logits, exs, _starts(exs)), ref["per_example"])


def _run_mode(sweep: _Sweep, base, exs, ref, mode: str, *, consume: bool = False) -> dict[str, Any]:
    """One mode on copies of ``base``; ``consume``: the trainer path takes ``base`` itself (its last use)."""
    from pf_trl.attention import enable_padding_free

    batch = _packed_batch(exs)
    # model path: admission (structural checks + self-check, no evidence), then a direct call with config defaults
    model = copy.deepcopy(base)
    self_checks: list = []
    try:
        with _self_checks_recorded(self_checks):
            enable_padding_free(model, mode=mode, allow_unverified=True)
    except PaddingFreeError as exc:
        return {"status": "refused", "reason": str(exc)}
    except Exception as exc:  # anything else is a crash, recorded as such
        return {"status": "crash", "reason": f"enable_padding_free: {_first_error_line(exc)}"}
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    except PaddingFreeError as exc:
        return {"status": "refused", "reason": f"late (on the first batch): {exc}"}
    except Exception as exc:
        return {"status": "crash", "reason": f"packed forward: {_first_error_line(exc)}"}
    model_err = _max_diff(_per_example_nll(logits, exs, _starts(exs)), ref["per_example"])
    result: dict[str, Any] = {"model_err": model_err}
    # read from the untouched model, before the trainer path may take it
    diagnosis = support.diagnose(base).strip() if model_err > LOSS_ATOL else ""
    # trainer path: PaddingFreeSFTTrainer.compute_loss on the collated batch, loss and gradients
    model = base if consume else copy.deepcopy(base)
    try:
        with _self_checks_replayed(self_checks):
            trainer = sweep.trainer(model, mode)
        loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
    except PaddingFreeError as exc:
        return {**result, "status": "refused", "reason": f"trainer: {exc}"}
    except Exception as exc:
        return {**result, "status": "crash", "reason": f"trainer: {_first_error_line(exc)}"}
    result["loss_err"] = abs(float(loss) - ref["loss"])
    result["grad_err"] = _grad_error(_grads(trainer.model), ref["grads"])
    bad = []
    if model_err > LOSS_ATOL:
        bad.append(f"model path: per-example loss off by {model_err:.2g}")
    if result["loss_err"] > LOSS_ATOL:
        bad.append(f"trainer path: loss off by {result['loss_err']:.2g}")
    if result["grad_err"] > GRAD_RTOL:
        bad.append(f"trainer path: gradients off by {result['grad_err']:.2g} (relative)")
    if bad:
        if model_err <= LOSS_ATOL:
            bad.append(TRAINER_ONLY)
        else:
            bad.append(diagnosis)
        return {**result, "status": "mismatch", "reason": "; ".join(b for b in bad if b)}
    return {**result, "status": "exact"}


def sweep_type(sweep: _Sweep, model_type: str) -> dict[str, Any]:
    """Both modes of one ``model_type``: ``{"class", "leak", "huggingface": {...}, "internal": {...}}``.

    The type's defaults, then each layer-kind variant its config can switch on (``tiny.TYPE_VARIANTS``: attention
    layers in a Mamba hybrid, dense layers in a MoE...): a mode is exact only if it is exact on every variant; the
    first variant that is not gives the mode's status, its reason prefixed with the variant's name."""
    from pf_trl_dev.tiny import TYPE_VARIANTS

    entry = _sweep_variant(sweep, model_type, None)
    for variant in TYPE_VARIANTS.get(model_type, {}):
        other = _sweep_variant(sweep, model_type, variant)
        for mode in MODES:
            if entry[mode]["status"] == "exact" and other[mode]["status"] != "exact":
                entry[mode] = {**other[mode], "reason": f"variant {variant!r}: {other[mode].get('reason', '')}"}
    return entry


def _sweep_variant(sweep: _Sweep, model_type: str, variant: str | None) -> dict[str, Any]:
    from pf_trl_dev.tiny import causal_lm_class, tiny_model

    entry: dict[str, Any] = {"class": causal_lm_class(model_type).__name__}
    try:
        base = tiny_model(model_type, variant=variant)
    except Exception as exc:
        reason = f"the sweep could not build a tiny {model_type}: {_first_error_line(exc)}"
        return {**entry, **{m: {"status": "unbuilt", "reason": reason} for m in MODES}}
    return sweep_model(sweep, base, model_type, consume=True)  # base was built for this call alone


def sweep_model(sweep: _Sweep, base, model_type: str | None = None, *, lengths=LENGTHS,
                consume: bool = False) -> dict[str, Any]:
    """Both modes of one built model (a type's defaults, or a variant a test builds): the sweep's entry for it.

    ``base`` is only copied, unless ``consume`` (the caller drops it afterwards): the last trainer path then takes
    it instead of a copy."""
    with _package_checks_cached():
        return _sweep_model(sweep, base, model_type, lengths=lengths, consume=consume)


def _sweep_model(sweep: _Sweep, base, model_type: str | None, *, lengths, consume: bool) -> dict[str, Any]:
    model_type = model_type or base.config.model_type
    entry: dict[str, Any] = {"class": type(base).__name__}
    base.train()
    _no_dropout(base)
    exs = _examples(base.config, _vocab(base.config), lengths=lengths)
    pad_id = int(exs[0][0])  # any id: padded positions are masked and unlabelled
    try:
        ref = _reference(base, exs, pad_id)
        entry["leak"] = _leak(exs, ref)
    except Exception as exc:  # the model itself fails padded: no reference, no evidence
        reason = f"the padded reference fails on a tiny {model_type}: {_first_error_line(exc)}"
        return {**entry, **{m: {"status": "unbuilt", "reason": reason} for m in MODES}}
    for mode in MODES:
        res = _run_mode(sweep, base, exs, ref, mode, consume=consume and mode == MODES[-1])
        if res["status"] == "exact" and entry["leak"] < LEAK_MIN:
            res = {**res, "status": "inconclusive",
                   "reason": f"the negative control moved the loss by only {entry['leak']:.2g}: a leak would not show"}
        entry[mode] = res
    return entry


def run_sweep(model_types: list[str] | None = None, *, progress: bool = True) -> dict[str, Any]:
    """Sweep ``model_types`` (default: every causal-LM type of the installed transformers); returns the matrix."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pf_trl.attention.multimodal import VISION_TYPES

    types = sorted(model_types or {*MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, *VISION_TYPES})  # + the mRoPE VLMs, on text
    entries: dict[str, Any] = {}
    started = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only spin against each other on a shared machine
    with _quiet(), _package_checks_cached(), support.use_matrix({}), contextlib.redirect_stdout(io.StringIO()) if not progress else contextlib.nullcontext():
        sweep = _Sweep()
        for i, model_type in enumerate(types):
            t0 = time.time()
            torch.manual_seed(0)
            entries[model_type] = sweep_type(sweep, model_type)
            if progress:
                states = " ".join(f"{m}={entries[model_type][m]['status']}" for m in MODES)
                print(f"[{i + 1}/{len(types)}] {model_type}: {states} ({time.time() - t0:.1f}s)", file=sys.stderr)
    torch.set_num_threads(threads)
    return {
        "transformers": transformers.__version__,
        "generated_by": "python -m pf_trl_dev.coverage --write",
        "tolerances": {"loss_atol": LOSS_ATOL, "grad_rtol": GRAD_RTOL, "leak_min": LEAK_MIN},
        "seconds": round(time.time() - started, 1),
        "models": entries,
    }


# ---------------------------------------------------------------------------------------------- outputs


def counts(matrix: dict[str, Any], mode: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for entry in matrix["models"].values():
        status = entry[mode]["status"]
        out[status] = out.get(status, 0) + 1
    return dict(sorted(out.items()))


NOTES = [
    "Notes:",
    "",
    "- *Trainer path only* mismatches (\"the packed attention is exact, but pf-trl's loss path ... does not "
    "reproduce this model's head\"): logit scaling / softcapping (Cohere, Cohere2, MiniCPM3, nanochat, VaultGemma), "
    "head transforms (BERT-style LM heads), auxiliary losses. They are refused until pf-trl's loss path reproduces "
    "them; regenerate this file then.",
    "- Recurrent / linear-attention / convolutional hybrids (Mamba, Mamba2, Jamba, Bamba, Falcon-H1, Nemotron-H, "
    "Granite 4.0-H, Qwen3.5, Qwen3-Next, OLMo-Hybrid, Kimi Linear, LFM2, MiniMax, RecurrentGemma...) carry state along "
    "the row: pf-trl restarts every layer it knows at each packed example (`pf_trl.attention.stateful`, see "
    "[stateful layers](models_stateful.md)); the sweep also builds the layer kinds their configs can switch on "
    "(attention layers in a Mamba hybrid, dense MLPs in a MoE) and a type is exact only if every variant is. Layers "
    "it does not know (xLSTM, RWKV, Zamba...) stay refused.",
    "- Vision-language types: `qwen2_vl`, `qwen2_5_vl`, `qwen3_vl` (not causal-LM types of transformers; swept "
    "here too) get per-example multimodal rotary positions from their own `get_rope_index`; this table is their "
    "text-only evidence. With images, these three and `gemma3` are checked by pf-trl's tests against TRL's padded "
    "vision-language run (see vlm.md); `gemma3` with images is refused in `internal` mode (bidirectional "
    "attention inside an image).",
    "- The sweep builds each type from its config class's defaults (shrunk). A checkpoint whose config enables "
    "something the defaults leave off (ALiBi in Falcon, other layer types) is still guarded by the runtime "
    "self-check, which runs on the user's own model.",
    "- Phi-3 LongRoPE picks its short or long rotary factor from the largest position in the batch. A long neighbour "
    "(beyond `original_max_position_embeddings`) switches a short example to the long factor in a padded batch and in "
    "a packed row alike: padding-free equals padded exactly (checked), and neither equals the example run alone.",
    "- Attention sinks (gpt-oss, Flint, Granite SWA, MiMo-V2, DeepSeek-V4 `s_aux`) are exact on every pf_varlen "
    "backend. gpt-oss, AFMoE and OPT build their masks without `position_ids`; in `huggingface` mode pf-trl hands "
    "them the masks transformers' own builders make with the packed positions.",
    "- Llama 4: chunked attention is exact in both modes; its attention temperature tuning reads the row position, so "
    "packed rows longer than `floor_scale - 1` tokens (8,191) are refused before training. DeepSeek-V4's compressed "
    "layers (CSA / HCA) pool windows of the sequence: pf-trl computes them per packed example, which needs "
    "transformers' dense mask (`huggingface` mode); so does DeepSeek sparse attention (V3.2, GLM-MoE-DSA, AXK2, HY-V4).",
    "- modernbert-decoder and hy_v4 are swept with `initializer_range=0.1`: with the default initialisation at this "
    "width a cross-example leak would move the loss by less than the negative-control floor.",
]


def both_exact(models: dict[str, Any]) -> int:
    """Types exact by default in both modes."""
    return sum(all(e[m]["status"] == "exact" for m in MODES) for e in models.values())


def render_markdown(matrix: dict[str, Any]) -> str:
    """docs/models.md: the generated support table of a (merged, multi-release) matrix."""
    swept = evidence.swept_versions(matrix)
    per_version = {v: evidence.entries(matrix, v) for v in swept}
    lines = [
        "# Supported models",
        "",
        "<!-- generated by `python -m pf_trl_dev.coverage --write`; do not edit by hand -->",
        "",
        f"Every causal-LM type of transformers {', '.join(swept)} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, and the "
        "mRoPE vision-language types), swept "
        "with a tiny model built from the type's own config defaults: five examples padded vs one packed row, the "
        "model path (a direct `model(...)` call with the config's `use_cache`) and the trainer path "
        "(`PaddingFreeSFTTrainer.compute_loss`: loss and gradients), in both modes. A negative control (the same "
        "row without per-example positions) proves each comparison would see a leak.",
        "",
        f"The results hold for transformers `{matrix.get('valid') or evidence.declared_range(swept)}`: each for the "
        "patch releases of the release it was measured on. `exact`: supported by default. Everything else is "
        "refused before training with the reason below (`unbuilt` / `inconclusive`: pass `allow_unverified=True` to "
        "rely on the runtime self-check). A type or a transformers release the sweep has not seen is admitted on "
        "the runtime self-check alone, with a warning (a failure the nearest swept release measured is still "
        "refused unless `allow_unverified=True`).",
        "",
        f"Tolerances: per-example loss {LOSS_ATOL:g} (float32), gradients {GRAD_RTOL:g} relative, negative control "
        f">= {LEAK_MIN:g}.",
        "",
    ]
    statuses = sorted({e[m]["status"] for entries in per_version.values() for e in entries.values() for m in MODES})
    lines.append("| transformers | mode | " + " | ".join(statuses) + " |")
    lines.append("|---|---|" + "---|" * len(statuses))
    for version, entries in per_version.items():
        for mode in MODES:
            c = counts({"models": entries}, mode)
            lines.append(f"| {version} | {mode} | " + " | ".join(str(c.get(s, 0)) for s in statuses) + " |")
    lines += ["", "Exact in both modes: " + ", ".join(f"{both_exact(e)} of {len(e)} types on {v}"
                                                     for v, e in per_version.items()) + "."]
    lines += ["", *NOTES]
    lines += ["", "| model_type | class | huggingface | internal | transformers | reason (when not exact) |",
              "|---|---|---|---|---|---|"]
    for model_type, records in sorted(matrix["models"].items()):
        for rec in records:
            reasons = []
            for mode in MODES:
                res = rec[mode]
                if res["status"] != "exact":
                    reasons.append(f"{mode}: {res.get('reason', '')}")
            reason = " / ".join(dict.fromkeys(reasons)).replace("|", "\\|").replace("\n", " ")
            versions = "all" if rec["transformers"] == swept else ", ".join(rec["transformers"])
            lines.append(
                f"| `{model_type}` | `{rec['class']}` | {rec['huggingface']['status']} | "
                f"{rec['internal']['status']} | {versions} | {reason} |"
            )
    return "\n".join(lines) + "\n"


def _stable(matrix: dict[str, Any]) -> dict[str, Any]:
    """What the committed files hold: statuses and reasons, not timings or float noise."""
    out = {k: v for k, v in matrix.items() if k != "seconds"}
    models = {}
    for model_type, entry in matrix["models"].items():
        e = {"class": entry["class"]}
        if "leak" in entry:
            e["leak"] = float(f"{entry['leak']:.1g}")
        for mode in MODES:
            res = entry[mode]
            e[mode] = {"status": res["status"]}
            if res.get("reason"):
                e[mode]["reason"] = res["reason"]
        models[model_type] = e
    out["models"] = models
    return out


def comparable(text: str) -> str:
    """A generated file with its measured numbers masked: fresh vs committed must not hinge on float noise."""
    return evidence.comparable(text)


HEADER = {
    "generated_by": "python -m pf_trl_dev.coverage --write",
    "tolerances": {"loss_atol": LOSS_ATOL, "grad_rtol": GRAD_RTOL, "leak_min": LEAK_MIN},
}


def committed_matrix() -> dict[str, Any] | None:
    """The support matrix on disk (None if there is none)."""
    import json

    if not support.SUPPORT_PATH.is_file():
        return None
    return json.loads(support.SUPPORT_PATH.read_text())


def merged_matrix(stable: dict[str, Any], committed: dict[str, Any] | None) -> dict[str, Any]:
    """``committed`` with the fresh sweep ``stable`` (one transformers release) in place of that release's results."""
    return evidence.merge(committed, stable["transformers"], stable["models"], HEADER)


def fingerprint(matrix: dict[str, Any]) -> dict[str, Any]:
    """Statuses and reasons per type, per swept release, numbers masked: what "fresh" compares."""
    import json

    return {
        model_type: sorted((comparable(json.dumps({k: v for k, v in r.items() if k not in ("leak", "transformers")},
                                                  sort_keys=True)), tuple(r["transformers"])) for r in records)
        for model_type, records in matrix.get("models", {}).items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pf_trl_dev.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate support.json and docs/models.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed files differ from a fresh sweep")
    parser.add_argument("--types", nargs="*", help="only these model types (print, never write)")
    args = parser.parse_args(argv)
    if argv is None and os.environ.get("PYTHONHASHSEED") != "0":  # the command line, not a call from Python
        # a few architectures build differently with Python's string-hash order (hy_v4's verdict flapped between
        # exact and inconclusive from one process to the next): sweep under one fixed order, as the tests do
        os.execve(sys.executable, [sys.executable, "-m", "pf_trl_dev.coverage", *sys.argv[1:]],
                  {**os.environ, "PYTHONHASHSEED": "0"})
    import json

    matrix = run_sweep(args.types)
    for mode in MODES:
        print(f"{mode}: {counts(matrix, mode)}", file=sys.stderr)
    print(f"exact in both modes: {both_exact(matrix['models'])} of {len(matrix['models'])}", file=sys.stderr)
    stable = _stable(matrix)
    if args.types:
        print(json.dumps(stable, indent=1, sort_keys=True))
        return 0
    committed = committed_matrix()
    merged = merged_matrix(stable, committed)
    docs = render_markdown(merged)
    if args.write:
        support.SUPPORT_PATH.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        DOCS_PATH.parent.mkdir(parents=True, exist_ok=True)
        DOCS_PATH.write_text(docs)
        print(f"wrote {support.SUPPORT_PATH} and {DOCS_PATH} (transformers {stable['transformers']} among "
              f"{merged['swept']}; {matrix['seconds']} s)", file=sys.stderr)
        return 0
    if args.check:
        stale = []
        if committed is None or fingerprint(committed) != fingerprint(merged):
            stale.append(str(support.SUPPORT_PATH))
        if not DOCS_PATH.is_file() or comparable(DOCS_PATH.read_text()) != comparable(docs):
            stale.append(str(DOCS_PATH))
        if stale:
            print(f"stale for transformers {stable['transformers']}: {', '.join(stale)}; run "
                  "`python -m pf_trl_dev.coverage --write` with it", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
