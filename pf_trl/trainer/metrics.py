"""Honest training metrics: real (non-padding) tokens, supervised tokens, padding share, memory, MFU.

Everything is measured, nothing is inferred from the batch size: every micro-batch that reaches ``compute_loss`` is
counted, all ranks are summed at each logging step, and the throughput denominators are wall-clock times
(``train_runtime`` for the final dict, the time since the previous log for the per-step logs).

Keys (per logging step, next to ``loss`` / ``learning_rate``; and in the final dict with a ``train_`` prefix):

- ``real_tokens_per_second``: tokens of real examples (no padding, no dummy pad segment) / second, all ranks;
- ``supervised_tokens_per_second``: tokens whose (shifted) label is not -100 / second;
- ``padding_share``: padding tokens / processed tokens (0.0 for pf-trl batches, measured for padded batches);
- ``tokens_per_step_mean`` / ``tokens_per_step_max``: real tokens per optimizer step (all ranks, all
  accumulation micro-batches);
- ``micro_batch_tokens_max``: processed tokens (with padding) of the largest micro-batch of one device: the memory
  driver;
- ``tflops`` and ``mfu`` (when the device peak is known or ``--peak_tflops`` is given), see :func:`train_flops`;
- final only: ``train_samples_per_second`` is replaced by examples really seen / ``train_runtime`` (transformers
  assumes ``batch_size`` examples per micro-batch); ``train_examples``, ``train_real_tokens`` / ``train_supervised_tokens`` / ``train_processed_tokens`` (totals),
  ``train_mem_cpu_peak`` (peak RSS during training, bytes), ``train_mem_cpu_peak_delta`` (that peak minus RSS at the
  start of training), ``train_mem_gpu_peak`` (``torch.cuda.max_memory_allocated``, CUDA only). With
  ``--skip_memory_metrics False`` transformers' own ``*_mem_*_delta`` keys are there too (measured by a lighter
  poller, see :class:`LightMemoryTracker`). With ``include_tokens_per_second`` / ``include_num_input_tokens_seen``,
  ``train_tokens_per_second`` counts real tokens only.

FLOPs (forward + backward), model FLOPs (the work the model needs; what MFU divides):

    flops = 6 * P_body * T_real + 6 * P_head * T_head + 6 * n_layers * hidden * sum_i L_i^2

``P_body`` = parameters without the input embedding and the LM head, ``P_head`` = the LM head's (vocab x hidden;
tied or not), ``T_real`` = real tokens, ``T_head`` = the positions the head is computed at, ``L_i`` = length of
example i. 6 FLOPs per parameter and token touched (forward 2, backward 4). The head runs only at the supervised
positions in pf-trl (its loss) and in TRL 1.16's ``SFTTrainer`` (its fused LM head): ``T_head`` = supervised tokens.
Causal attention: ``QK^T`` and ``AV`` are 2 x 2 x L^2 x hidden FLOPs per layer forward, halved by the causal mask
(2 x L^2 x hidden), and backward = 2 x forward, as for the matmuls: 6 x layers x hidden x L^2. This is PaLM's
appendix B (and nanoGPT's ``estimate_mfu``): 12 x layers x hidden x T per token, i.e. 12 x layers x hidden x T^2
per sequence, without the causal halving, which counts the masked half as well; we count the computed half.
Padding is not counted (it is waste, not work), so a padded run gets a lower MFU for the same wall time.

Hardware FLOPs (HFU: what the GPU really executes) add the recomputation: activation checkpointing runs each decoder
layer's forward again (+ 2 x P_body x T_real + 2 x layers x hidden x sum L^2), and FlashAttention-style kernels
recompute the scores ``QK^T`` in the backward (+ 1 x layers x hidden x sum L^2: its backward is 2.5 x its forward).
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from transformers.trainer_utils import TrainerMemoryTracker

from pf_trl.batching.packing import count_targets, cu_seqlens_from_starts, segment_lengths
from pf_trl.errors import ConfigError

REAL_TOKENS_KEY = "_pf_real_tokens"
# causal attention, forward + backward, model FLOPs: 2 x L^2 x hidden per layer forward, x 3 (backward = 2 x forward)
ATTENTION_FLOPS_FACTOR = 6.0
# what recomputation adds (hardware FLOPs): checkpointing's second forward (2) and the flash backward's scores (1)
CHECKPOINT_ATTENTION_FACTOR = 2.0
FLASH_RECOMPUTE_ATTENTION_FACTOR = 1.0

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity) of common GPUs, matched on the device name.
KNOWN_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "V100": 125.0,
}


def detect_peak_tflops(device: torch.device, dtype: torch.dtype) -> float | None:
    """Peak TFLOP/s of ``device`` for bf16/fp16 on known CUDA GPUs, else None (CPU: pass --peak_tflops)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in KNOWN_PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


class FlopParams(NamedTuple):
    """What the FLOP counts need of a model: ``body`` = parameters without the input embedding and the LM head,
    ``head`` = the LM head's parameters (the tied embedding counts here), ``layers``, ``hidden``."""

    body: int
    head: int
    layers: int
    hidden: int


def model_flop_params(model: torch.nn.Module) -> FlopParams:
    """:class:`FlopParams` of ``model`` for :func:`train_flops` / :func:`hardware_flops`.

    Parameters count by their full size, whichever rank holds them: a DeepSpeed ZeRO-3 partition by ``ds_numel``
    (its local tensor is empty), an FSDP2 ``DTensor`` by its global shape (:func:`pf_trl.sharding.full_numel`).
    """
    from pf_trl.sharding import full_numel

    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    total = sum(full_numel(p) for p in model.parameters())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb_params = full_numel(emb.weight) if emb is not None else 0
    head = full_numel(out.weight) if out is not None and getattr(out, "weight", None) is not None else 0
    tied = out is not None and emb is not None and getattr(out, "weight", None) is emb.weight
    body = total - emb_params - (0 if tied else head)  # tied: the one matrix is counted once, as the head
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    return FlopParams(body, head, layers, hidden)


def as_flop_params(params: Sequence[int]) -> FlopParams:
    """A :class:`FlopParams` from its four numbers (as a JSON record holds them)."""
    if len(params) != 4:
        raise ConfigError(f"flop params are (body, head, layers, hidden), got {list(params)}")
    return FlopParams(*(int(p) for p in params))


def train_flops(params: Sequence[int], real_tokens: float, head_tokens: float, sum_sq_lengths: float) -> float:
    """Model FLOPs (forward + backward, no recomputation) of ``real_tokens`` tokens in examples whose squared
    lengths sum to ``sum_sq_lengths``, the LM head computed at ``head_tokens`` positions (module docstring)."""
    body, head, layers, hidden = as_flop_params(params)
    return (6.0 * body * real_tokens + 6.0 * head * head_tokens
            + ATTENTION_FLOPS_FACTOR * layers * hidden * sum_sq_lengths)


def hardware_flops(params: Sequence[int], real_tokens: float, head_tokens: float, sum_sq_lengths: float, *,
                   checkpointing: bool, flash_recompute: bool = True) -> float:
    """:func:`train_flops` plus what recomputation adds: activation checkpointing's second forward of every decoder
    layer (``checkpointing``), the scores recomputed by a FlashAttention-style backward (``flash_recompute``)."""
    body, _, layers, hidden = as_flop_params(params)
    extra_attention = (CHECKPOINT_ATTENTION_FACTOR if checkpointing else 0.0) + (
        FLASH_RECOMPUTE_ATTENTION_FACTOR if flash_recompute else 0.0)
    return (train_flops(params, real_tokens, head_tokens, sum_sq_lengths)
            + (2.0 * body * real_tokens if checkpointing else 0.0)
            + extra_attention * layers * hidden * sum_sq_lengths)


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class PeakRSS:
    """Peak resident memory over a window: a 5 ms poller plus the kernel's high-water mark (``ru_maxrss``)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.start_rss = 0
        self.peak = 0
        self._start_maxrss = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.start_rss = self.peak = rss_bytes()
        self._start_maxrss = maxrss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pf-trl-peak-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        self.peak = max(self.peak, rss_bytes())
        high_water = maxrss_bytes()
        if high_water > self._start_maxrss:  # the process's all-time peak was reached in this window
            self.peak = max(self.peak, high_water)
        return self.peak


class LightMemoryTracker(TrainerMemoryTracker):
    """transformers' tracker with a 2 ms poll instead of a busy loop (which takes a whole core and the GIL: on a
    small CPU machine it slows training by tens of percent), plus the kernel high-water mark for the peak."""

    def peak_monitor_func(self):
        self.cpu_mem_used_peak = -1
        start_high = maxrss_bytes()
        while True:
            self.cpu_mem_used_peak = max(self.cpu_mem_used(), self.cpu_mem_used_peak)
            if not self.peak_monitoring:
                break
            time.sleep(0.002)
        high = maxrss_bytes()
        if high > start_high:
            self.cpu_mem_used_peak = max(self.cpu_mem_used_peak, high)


class TokenMeter:
    """Counts what the micro-batches hold; reduced across ranks at logging time."""

    def __init__(self) -> None:
        self.reset_totals()

    def reset_totals(self) -> None:
        self.totals = dict(real=0, processed=0, supervised=0, sum_sq=0.0, correct=0, scored=0, examples=0)
        self.step_tokens: list[int] = []  # real tokens of each finished optimizer step (this rank)
        self.max_micro = 0
        self.reset_interval()
        self._current_step = 0
        self.last_real = 0

    def reset_interval(self) -> None:
        self.interval = dict(real=0, processed=0, supervised=0, sum_sq=0.0, correct=0, scored=0, examples=0)
        self.interval_steps: list[int] = []
        self.interval_max_micro = 0

    def observe(self, inputs: dict[str, Any], real_tokens: int | None = None) -> None:
        ids = inputs.get("input_ids")
        if ids is None:
            return
        processed = int(ids.numel())
        mask = inputs.get("attention_mask")
        cu = inputs.get("cu_seq_lens_q")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            row_lengths = mask.sum(dim=1).double()
            real = int(row_lengths.sum()) if real_tokens is None else int(real_tokens)
            sum_sq = float((row_lengths**2).sum())
            examples = int((row_lengths > 0).sum())
        else:
            if isinstance(cu, torch.Tensor) and cu.numel() > 1:
                seg = (cu[1:] - cu[:-1]).double()
            else:
                pos = inputs.get("position_ids")
                if isinstance(pos, torch.Tensor):
                    seg = segment_lengths(cu_seqlens_from_starts(pos.reshape(-1) == 0)).double()
                else:
                    seg = torch.full((ids.shape[0],), float(ids.shape[-1]), dtype=torch.float64)
            real = processed if real_tokens is None else int(real_tokens)
            sum_sq = float((seg**2).sum())
            examples = int(seg.numel())
            if real < processed and seg.numel() > 0:
                sum_sq -= float(seg[-1] ** 2)  # the dummy pad segment is the last one
                examples -= 1
        labels = inputs.get("labels")
        supervised = int(count_targets(labels)) if isinstance(labels, torch.Tensor) else 0
        for d in (self.totals, self.interval):
            d["real"] += real
            d["processed"] += processed
            d["supervised"] += supervised
            d["sum_sq"] += sum_sq
            d["examples"] += examples
        self.max_micro = max(self.max_micro, processed)
        self.interval_max_micro = max(self.interval_max_micro, processed)
        self._current_step += real
        self.last_real = real

    def add_accuracy(self, correct: int, scored: int) -> None:
        for d in (self.totals, self.interval):
            d["correct"] += int(correct)
            d["scored"] += int(scored)

    def end_step(self) -> None:
        self.step_tokens.append(self._current_step)
        self.interval_steps.append(self._current_step)
        self._current_step = 0


# the counters of TokenMeter that are summed over ranks at logging time, in the order reduce_across_ranks sends them
SUM_KEYS = ("real", "processed", "supervised", "sum_sq", "correct", "scored", "examples")


def reduce_across_ranks(values: list[float], device, op: str = "sum") -> list[float]:
    """``values`` summed (``op="sum"``) or maxed (``"max"``) over the ranks of the process group, as floats; the
    values themselves in a single process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()
