"""Steady-state step timing for any ``Trainer`` measured by pf-trl's token meter, and the summary of its record.

:class:`StepTimer` times every optimizer step between ``on_step_begin`` and ``on_step_end``, with
``torch.cuda.synchronize()`` at both ends on CUDA (kernels are asynchronous: without it a step's time would be the
time to queue it), and snapshots the token meter's running totals at each step end, so that each step has its own
real / supervised / processed tokens and sum of squared example lengths. The first ``warmup_steps`` are recorded but
excluded from the figures (allocator growth, kernel JIT, torch.compile). It stops training once the timed steps
reach ``min_steps`` or their time reaches ``min_seconds``, whichever comes first.

:func:`summarize` derives every figure from that record alone, so a JSON holding the record can be re-checked.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from pf_trl.trainer.metrics import ATTENTION_FLOPS_FACTOR


class StepTimer(TrainerCallback):
    """Synchronized per-step times and per-step token counts (see module docstring)."""

    def __init__(self, meter_of, *, warmup_steps: int = 3, min_steps: int = 100, min_seconds: float = 60.0,
                 cuda: bool = False) -> None:
        self.meter_of = meter_of  # () -> TokenMeter, read at each step end
        self.warmup_steps, self.min_steps, self.min_seconds, self.cuda = warmup_steps, min_steps, min_seconds, cuda
        self.steps: list[dict[str, float]] = []
        self.memory: dict[str, int] = {}
        self._t = 0.0
        self._last = dict(real=0, supervised=0, processed=0, sum_sq=0.0, examples=0)

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        seconds = time.perf_counter() - self._t
        totals = self.meter_of().totals
        step = {"seconds": seconds}
        for key in self._last:
            step[key] = totals[key] - self._last[key]
            self._last[key] = totals[key]
        self.steps.append(step)
        timed = self.steps[self.warmup_steps:]
        if timed and (len(timed) >= self.min_steps or sum(s["seconds"] for s in timed) >= self.min_seconds):
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self.cuda:
            import torch

            self.memory = {"max_memory_allocated": int(torch.cuda.max_memory_allocated()),
                           "max_memory_reserved": int(torch.cuda.max_memory_reserved())}

    def record(self) -> dict[str, Any]:
        return {"warmup_steps": self.warmup_steps, "steps": self.steps, "gpu_memory_bytes": self.memory}


def summarize(record: dict[str, Any], *, flop_params: tuple[int, int, int],
              peak_tflops: float | None) -> dict[str, Any]:
    """Figures of one arm from its record: tokens/s over the timed steps, padding share, MFU, memory.

    MFU = (6 * P * real tokens + 7 * layers * hidden * sum of squared example lengths) / timed seconds / peak
    (:func:`pf_trl.trainer.metrics.train_flops`; attention forward + backward = 3.5x forward).
    """
    timed = record["steps"][record["warmup_steps"]:]
    if not timed:
        return {"timed_steps": 0}
    seconds = sum(s["seconds"] for s in timed)
    real = sum(s["real"] for s in timed)
    processed = sum(s["processed"] for s in timed)
    params, layers, hidden = flop_params
    flops = 6.0 * params * real + ATTENTION_FLOPS_FACTOR * layers * hidden * sum(s["sum_sq"] for s in timed)
    mem = record.get("gpu_memory_bytes") or {}
    return {
        "timed_steps": len(timed),
        "timed_seconds": round(seconds, 4),
        "real_tokens": int(real),
        "supervised_tokens": int(sum(s["supervised"] for s in timed)),
        "real_tokens_per_second": round(real / seconds, 1),
        "supervised_tokens_per_second": round(sum(s["supervised"] for s in timed) / seconds, 1),
        "padding_share": round(1 - real / processed, 4) if processed else 0.0,
        "step_seconds_median": round(sorted(s["seconds"] for s in timed)[len(timed) // 2], 4),
        "tflops": round(flops / seconds / 1e12, 2),
        "mfu": round(flops / seconds / (peak_tflops * 1e12), 4) if peak_tflops else None,
        "gpu_max_allocated_gb": round(mem["max_memory_allocated"] / 2**30, 2) if mem else None,
        "gpu_max_reserved_gb": round(mem["max_memory_reserved"] / 2**30, 2) if mem else None,
    }
