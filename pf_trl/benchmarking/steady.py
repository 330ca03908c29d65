"""Steady-state step timing for any ``Trainer`` measured by pf-trl's token meter, and the summary of its record.

:class:`StepTimer` times every optimizer step from the end of the step before (or the start of training) to its own
``on_step_end``, so a step's ``seconds`` include fetching and collating its batch (the Trainer does that before
``on_step_begin``, in ``get_batch_samples``) and the Trainer's bookkeeping between steps; that part alone is the
step's ``data_seconds`` (end of the step before to ``on_step_begin``). ``torch.cuda.synchronize()`` runs at the step's
begin and end on CUDA (kernels are asynchronous: without it a step's time would be the time to queue it). It
snapshots the token meter's running totals at each step end, so that each step has its own real / supervised /
processed tokens and sum of squared example lengths. The first ``warmup_steps`` are recorded but excluded from the
figures (allocator growth, kernel JIT, torch.compile). It stops training once the timed steps
reach ``min_steps`` or their time reaches ``min_seconds``, whichever comes first.

:func:`summarize` derives every figure from that record alone, so a JSON holding the record can be re-checked.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

from pf_trl.trainer.metrics import hardware_flops, train_flops


class StepTimer(TrainerCallback):
    """Synchronized per-step times and per-step token counts (see module docstring)."""

    def __init__(self, meter_of, *, warmup_steps: int = 3, min_steps: int = 100, min_seconds: float = 60.0,
                 cuda: bool = False) -> None:
        self.meter_of = meter_of  # () -> TokenMeter, read at each step end
        self.warmup_steps, self.min_steps, self.min_seconds, self.cuda = warmup_steps, min_steps, min_seconds, cuda
        self.steps: list[dict[str, float]] = []
        self.memory: dict[str, int] = {}
        self._t_begin = self._t_end = time.perf_counter()
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
        self._t_end = time.perf_counter()  # the first step's time starts here: it fetches its batch too

    def on_step_begin(self, args, state, control, **kwargs):
        self._sync()
        self._t_begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        now = time.perf_counter()
        totals = self.meter_of().totals
        step = {"seconds": now - self._t_end, "data_seconds": self._t_begin - self._t_end}
        self._t_end = now
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


def summarize(record: dict[str, Any], *, flop_params: tuple[int, int, int, int],
              peak_tflops: float | None) -> dict[str, Any]:
    """Figures of one arm from its record: tokens/s over the timed steps, padding share, MFU, HFU, memory.

    MFU = model FLOPs / timed seconds / peak (:func:`pf_trl.trainer.metrics.train_flops`: 6 x body parameters x real
    tokens + 6 x LM head parameters x supervised tokens + 6 x layers x hidden x sum of squared example lengths). HFU
    = hardware FLOPs (:func:`pf_trl.trainer.metrics.hardware_flops`: with the recomputation that
    ``record["recompute"]`` names) / timed seconds / peak. The timed seconds include fetching and collating each
    batch; ``data_seconds_share`` is that part.
    """
    timed = record["steps"][record["warmup_steps"]:]
    if not timed:
        return {"timed_steps": 0}
    seconds = sum(s["seconds"] for s in timed)
    real = sum(s["real"] for s in timed)
    supervised = sum(s["supervised"] for s in timed)
    processed = sum(s["processed"] for s in timed)
    sum_sq = sum(s["sum_sq"] for s in timed)
    flops = train_flops(flop_params, real, supervised, sum_sq)
    recompute = record.get("recompute") or {}
    hw_flops = hardware_flops(flop_params, real, supervised, sum_sq,
                              checkpointing=bool(recompute.get("activation_checkpointing")),
                              flash_recompute=bool(recompute.get("flash_recompute")))
    mem = record.get("gpu_memory_bytes") or {}
    data = [s["data_seconds"] for s in timed if "data_seconds" in s]
    return {
        "timed_steps": len(timed),
        "timed_seconds": round(seconds, 4),
        "data_seconds_share": round(sum(data) / seconds, 4) if data and seconds else None,
        "real_tokens": int(real),
        "supervised_tokens": int(supervised),
        "real_tokens_per_second": round(real / seconds, 1),
        "supervised_tokens_per_second": round(supervised / seconds, 1),
        "padding_share": round(1 - real / processed, 4) if processed else 0.0,
        "step_seconds_median": round(sorted(s["seconds"] for s in timed)[len(timed) // 2], 4),
        "tflops": round(flops / seconds / 1e12, 2),
        "hardware_tflops": round(hw_flops / seconds / 1e12, 2),
        "mfu": round(flops / seconds / (peak_tflops * 1e12), 4) if peak_tflops else None,
        "hfu": round(hw_flops / seconds / (peak_tflops * 1e12), 4) if peak_tflops else None,
        "gpu_max_allocated_gb": round(mem["max_memory_allocated"] / 2**30, 2) if mem else None,
        "gpu_max_reserved_gb": round(mem["max_memory_reserved"] / 2**30, 2) if mem else None,
    }
