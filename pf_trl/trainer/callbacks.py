"""The honest training metrics as a ``TrainerCallback`` (public hooks of transformers' Trainer).

:class:`TokenMetricsCallback` owns the counters that ``compute_loss`` feeds (see
:class:`~pf_trl.trainer.accounting.TokenAccountingMixin`) and turns them into log keys in ``on_log``; the keys and their
meaning are listed in :mod:`pf_trl.trainer.metrics`.

``on_log`` receives the very dict that ``Trainer.log`` was given (for the final log, the metrics that ``train()``
returns; for an evaluation, the metrics that ``evaluate()`` returns), so keys added to it reach the caller. The copy
that ``Trainer.log`` has already appended to ``state.log_history`` is updated with the same keys. The callback sits
first in the callback list, so the printer and the reporting integrations (TensorBoard, W&B, ...) see the keys.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import TrainerCallback

from pf_trl.trainer.metrics import SUM_KEYS, PeakRSS, TokenMeter, reduce_across_ranks, train_flops

__all__ = ["TokenMetricsCallback"]


class TokenMetricsCallback(TrainerCallback):
    """Real / supervised tokens per second, padding share, tokens per step, TFLOP/s, MFU, peak memory, and the
    token-weighted eval loss.

    Args:
        flop_params: the model's :class:`~pf_trl.trainer.metrics.FlopParams` (body, LM head, layers, hidden), for
            :func:`~pf_trl.trainer.metrics.train_flops` (model FLOPs; the head at the supervised positions).
        peak_tflops: peak TFLOP/s of one device (for ``mfu``); ``None`` leaves ``mfu`` out.
    """

    def __init__(self, flop_params: tuple[int, int, int, int], peak_tflops: float | None) -> None:
        self.meter = TokenMeter()
        self.peak = PeakRSS()
        self.flop_params = flop_params
        self.peak_tflops = peak_tflops
        self.t_last = time.perf_counter()
        self.eval_sum = 0.0
        self.eval_count = 0

    # ------------------------------------------------------------------ fed by compute_loss

    def add_eval(self, loss_sum: torch.Tensor | float, count: int) -> None:
        """Summed loss over ``count`` supervised tokens of one evaluation micro-batch."""
        self.eval_sum += float(loss_sum)
        self.eval_count += int(count)

    def _reset_eval(self) -> None:
        self.eval_sum, self.eval_count = 0.0, 0

    # ------------------------------------------------------------------ hooks

    def on_train_begin(self, args, state, control, **kwargs):
        self.meter.reset_totals()
        if torch.cuda.is_available() and args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        self.peak.start()
        self.t_last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.end_step()

    def on_evaluate(self, args, state, control, **kwargs):
        self._reset_eval()  # consumed by on_log (called by evaluate() before on_evaluate)

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        # predict() does not log: its metrics dict (returned to the caller) gets the token-weighted loss here
        prefixes = [k[: -len("_runtime")] for k in (metrics or {}) if k.endswith("_runtime")]
        if prefixes:
            metrics.update(self._eval_keys(args, prefixes[0]))
        self._reset_eval()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        extra = self._extra_keys(args, logs)
        if extra:
            logs.update(extra)
            if state.log_history:  # Trainer.log appended a copy of logs before calling us
                state.log_history[-1].update(extra)

    # ------------------------------------------------------------------ keys

    def _extra_keys(self, args, logs: dict[str, Any]) -> dict[str, Any]:
        eval_prefixes = [k[: -len("_runtime")] for k in logs if k.endswith("_runtime") and k != "train_runtime"]
        if eval_prefixes:
            return self._eval_keys(args, eval_prefixes[0])
        if "train_loss" in logs and "total_flos" in logs:  # the final log of train()
            return self._final_keys(args, float(logs["train_runtime"]))
        if "loss" in logs:
            return self._step_keys(args)
        return {}

    def _eval_keys(self, args, prefix: str) -> dict[str, Any]:
        total, count = reduce_across_ranks([self.eval_sum, float(self.eval_count)], args.device)
        self._reset_eval()
        if count <= 0:
            return {}
        # token-weighted mean over all supervised tokens (transformers averages per-batch means instead)
        return {f"{prefix}_loss": total / count, f"{prefix}_supervised_tokens": int(count)}

    def _final_keys(self, args, runtime: float) -> dict[str, Any]:
        meter = self.meter
        peak = self.peak.stop()
        counts, steps, max_micro = self._gather(args, meter.totals, meter.step_tokens, meter.max_micro)
        out = self._rates(args, counts, runtime, "train_")
        out["train_real_tokens"] = int(counts["real"])
        out["train_supervised_tokens"] = int(counts["supervised"])
        out["train_processed_tokens"] = int(counts["processed"])
        out["train_examples"] = int(counts["examples"])
        # transformers derives samples/s from batch_size x steps; count the examples really trained on
        out["train_samples_per_second"] = round(counts["examples"] / max(runtime, 1e-9), 3)
        if steps:
            out["train_tokens_per_step_mean"] = round(sum(steps) / len(steps), 2)
            out["train_tokens_per_step_max"] = int(max(steps))
        out["train_micro_batch_tokens_max"] = int(max_micro)
        if args.include_num_input_tokens_seen != "no" or getattr(args, "include_tokens_per_second", False):
            out["train_tokens_per_second"] = out["train_real_tokens_per_second"]
        out["train_mem_cpu_peak"] = int(peak)
        out["train_mem_cpu_peak_delta"] = int(peak - self.peak.start_rss)
        if torch.cuda.is_available() and args.device.type == "cuda":
            out["train_mem_gpu_peak"] = int(torch.cuda.max_memory_allocated(args.device))
        return out

    def _step_keys(self, args) -> dict[str, Any]:
        meter = self.meter
        now = time.perf_counter()
        counts, steps, max_micro = self._gather(args, meter.interval, meter.interval_steps, meter.interval_max_micro)
        out = self._rates(args, counts, now - self.t_last, "")
        if steps:
            out["tokens_per_step_mean"] = round(sum(steps) / len(steps), 2)
            out["tokens_per_step_max"] = int(max(steps))
        out["micro_batch_tokens_max"] = int(max_micro)
        if counts["scored"] > 0:
            out["mean_token_accuracy"] = round(counts["correct"] / counts["scored"], 6)
        meter.reset_interval()
        self.t_last = now
        return out

    def _rates(self, args, counts: dict[str, float], seconds: float, prefix: str) -> dict[str, float]:
        out: dict[str, float] = {}
        seconds = max(seconds, 1e-9)
        out[f"{prefix}real_tokens_per_second"] = round(counts["real"] / seconds, 3)
        out[f"{prefix}supervised_tokens_per_second"] = round(counts["supervised"] / seconds, 3)
        out[f"{prefix}padding_share"] = round(1.0 - counts["real"] / counts["processed"], 6) if counts["processed"] else 0.0
        flops = train_flops(self.flop_params, counts["real"], counts["supervised"], counts["sum_sq"])
        out[f"{prefix}tflops"] = round(flops / seconds / 1e12, 6)
        if self.peak_tflops:
            world = max(1, args.world_size)
            out[f"{prefix}mfu"] = round(flops / seconds / (self.peak_tflops * 1e12 * world), 6)
        return out

    @staticmethod
    def _gather(args, counts: dict[str, float], steps: list[int], max_micro: int):
        device = args.device
        summed = reduce_across_ranks([float(counts[k]) for k in SUM_KEYS], device)
        counts = dict(zip(SUM_KEYS, summed))
        steps = reduce_across_ranks([float(s) for s in steps], device)
        max_micro = reduce_across_ranks([float(max_micro)], device, op="max")[0]
        return counts, steps, max_micro
