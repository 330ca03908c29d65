"""Honest throughput: real tokens (no pad), supervised tokens, padding share, memory, MFU.

The stock trainer's tokens/s counts pad tokens, so the seed compared ``train_runtime`` instead. Here
every batch is counted as it enters ``training_step``: the same code measures padded and padding-free
runs, which is what makes their ratio meaningful.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

IGNORE_INDEX = -100

# Dense bf16 peak of one device (datasheet, TFLOP/s), matched on the CUDA device name.
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def detect_peak_tflops() -> float | None:
    """Peak bf16 TFLOP/s of the current CUDA device when it is a known part, else None."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in KNOWN_PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def flops_per_step_terms(model: torch.nn.Module) -> tuple[int, int, int]:
    """(matmul parameters, layers, hidden size) for the FLOP count.

    Training FLOPs = 6 * N * tokens + 6 * layers * hidden * sum_i L_i^2, where N excludes the input
    embedding (a lookup, no matmul) and sum_i L_i^2 runs over the examples: causal attention costs
    2 * L^2 * hidden per layer forward (QK^T and AV, halved by the mask), times 3 for forward + backward.
    Padding and cross-example attention are not useful work, so they are never counted.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings()
    emb_params = emb.weight.numel() if emb is not None else 0
    out = model.get_output_embeddings()
    tied = out is not None and emb is not None and out.weight is emb.weight
    n = total - emb_params + (emb_params if tied else 0)
    return n, int(getattr(config, "num_hidden_layers", 0)), int(getattr(config, "hidden_size", 0))


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20


@dataclass
class BatchCounts:
    real: int  # tokens of examples (what a padded batch calls attention_mask.sum())
    processed: int  # tokens the model ran on, pad included
    supervised: int  # tokens with a next-token label
    sum_sq_lengths: int  # sum of squared example lengths (attention FLOPs)
    examples: int


def count_batch(inputs: dict[str, Any]) -> BatchCounts:
    """Token counts of one collated batch, packed (cu_seq_lens / position_ids) or padded (attention_mask)."""
    ids = inputs["input_ids"]
    labels = inputs.get("labels")
    supervised = int((labels[..., 1:] != IGNORE_INDEX).sum()) if labels is not None else 0
    if "attention_mask" in inputs and inputs["attention_mask"] is not None:
        lengths = inputs["attention_mask"].sum(dim=-1)
    elif "cu_seq_lens_q" in inputs:
        cu = inputs["cu_seq_lens_q"]
        lengths = cu[1:] - cu[:-1]
    elif "position_ids" in inputs:
        pos = inputs["position_ids"].reshape(-1)
        starts = torch.nonzero(pos == 0).reshape(-1).tolist() + [pos.numel()]
        lengths = torch.tensor([b - a for a, b in zip(starts[:-1], starts[1:])])
    else:
        lengths = torch.full((ids.shape[0],), ids.shape[-1])
    lengths = lengths.to("cpu", torch.int64)
    return BatchCounts(
        real=int(lengths.sum()),
        processed=int(ids.numel()),
        supervised=supervised,
        sum_sq_lengths=int((lengths * lengths).sum()),
        examples=int(lengths.numel()),
    )


@dataclass
class ThroughputMeter:
    """Accumulates token counts per optimizer step; turns them into the logged metrics."""

    flop_terms: tuple[int, int, int] = (0, 0, 0)
    peak_tflops: float | None = None
    world_size: int = 1
    real: int = 0
    processed: int = 0
    supervised: int = 0
    sum_sq: int = 0
    examples: int = 0
    step_tokens: list[int] = field(default_factory=list)
    _current_step_tokens: int = 0
    started: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def add(self, counts: BatchCounts) -> None:
        if self.started is None:
            self.start()
        self.real += counts.real
        self.processed += counts.processed
        self.supervised += counts.supervised
        self.sum_sq += counts.sum_sq_lengths
        self.examples += counts.examples
        self._current_step_tokens += counts.real

    def end_step(self) -> None:
        self.step_tokens.append(self._current_step_tokens)
        self._current_step_tokens = 0

    def flops(self) -> float:
        n, layers, hidden = self.flop_terms
        return 6.0 * n * self.real + 6.0 * layers * hidden * self.sum_sq

    def metrics(self, prefix: str = "train") -> dict[str, float]:
        """Metrics of this process so far, scaled to all ranks by ``world_size`` (ranks are balanced)."""
        elapsed = max(time.perf_counter() - self.started, 1e-9) if self.started is not None else 0.0
        w = self.world_size
        out: dict[str, float] = {
            f"{prefix}_real_tokens": float(self.real * w),
            f"{prefix}_supervised_tokens": float(self.supervised * w),
            f"{prefix}_padding_share": round(1.0 - self.real / self.processed, 6) if self.processed else 0.0,
            f"{prefix}_examples": float(self.examples * w),
            f"{prefix}_peak_rss_mb": round(peak_rss_mb(), 1),
        }
        if elapsed:
            out[f"{prefix}_real_tokens_per_second"] = round(self.real * w / elapsed, 3)
            out[f"{prefix}_supervised_tokens_per_second"] = round(self.supervised * w / elapsed, 3)
            out[f"{prefix}_real_tokens_per_second_per_device"] = round(self.real / elapsed, 3)
        if self.step_tokens:
            out[f"{prefix}_tokens_per_step_mean"] = round(sum(self.step_tokens) / len(self.step_tokens), 1)
            out[f"{prefix}_tokens_per_step_max"] = float(max(self.step_tokens))
        if torch.cuda.is_available():
            out[f"{prefix}_peak_cuda_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        if self.peak_tflops and elapsed:
            out[f"{prefix}_tflops_per_device"] = round(self.flops() / elapsed / 1e12, 3)
            out[f"{prefix}_mfu"] = round(self.flops() / elapsed / (self.peak_tflops * 1e12), 4)
        return out
