"""Token accounting for a (SFT)Trainer: a mixin that counts what ``compute_loss`` sees and reports it.

:class:`TokenAccountingMixin` feeds :class:`~pf_trl.trainer.metrics.TokenMeter` from ``compute_loss`` and registers
:class:`~pf_trl.trainer.callbacks.TokenMetricsCallback`, which turns the counts into the log keys listed in
:mod:`pf_trl.trainer.metrics`. :class:`MeasuredSFTTrainer` is TRL's own ``SFTTrainer`` measured by the same code
(the bench's padded and TRL baselines). Kept apart from :mod:`pf_trl.trainer.metrics` so the dependencies run one way:
this mixin -> the callback -> the counters.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.trainer_utils import TrainerMemoryTracker

from pf_trl.batching.packing import count_targets
from pf_trl.trainer.callbacks import TokenMetricsCallback
from pf_trl.trainer.metrics import (
    REAL_TOKENS_KEY,
    LightMemoryTracker,
    TokenMeter,
    detect_peak_tflops,
    model_flop_params,
)

__all__ = ["MeasuredDPOTrainer", "MeasuredSFTTrainer", "TokenAccountingMixin"]  # noqa: F822 (module __getattr__)


class TokenAccountingMixin:
    """Mix into a (SFT)Trainer before it: counts tokens in ``compute_loss`` and reports them through
    :class:`~pf_trl.trainer.callbacks.TokenMetricsCallback` (honest keys in the logs, token-weighted eval loss).
    Used by :class:`~pf_trl.trainer.PaddingFreeSFTTrainer` and by the bench's padded / TRL baselines
    (:class:`MeasuredSFTTrainer`), so every mode is measured by the same code.

    Besides ``compute_loss`` (a documented override point) it overrides one private Trainer method,
    ``_track_num_input_tokens``, and swaps the class of ``_memory_tracker``; docs/training.md says why.
    """

    def _pf_init_metrics(self) -> None:
        device = self.args.device
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        if getattr(self.args, "bf16", False):
            dtype = torch.bfloat16
        elif getattr(self.args, "fp16", False):
            dtype = torch.float16
        peak = getattr(self.args, "peak_tflops", None)
        self.pf_metrics = TokenMetricsCallback(model_flop_params(self.model),
                                               float(peak) if peak else detect_peak_tflops(device, dtype))
        # first in the list: the printer and the reporting integrations then log the keys it adds
        self.callback_handler.callbacks.insert(0, self.pf_metrics)
        # transformers' tracker busy-polls RSS in a thread; keep its keys, drop the busy loop
        tracker = getattr(self, "_memory_tracker", None)
        if tracker is not None and type(tracker) is TrainerMemoryTracker:
            tracker.__class__ = LightMemoryTracker  # keeps the init-stage numbers it already holds

    @property
    def _pf_meter(self) -> TokenMeter:
        return self.pf_metrics.meter

    # ------------------------------------------------------------------ counting

    def _pf_observe(self, inputs: dict[str, Any]) -> None:
        real = inputs.pop(REAL_TOKENS_KEY, None)
        if isinstance(real, torch.Tensor):
            real = int(real)
        if self.model.training:
            self._pf_meter.observe(inputs, real)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self._pf_observe(inputs)
        training = self.model.training
        labels = inputs.get("labels")
        scored = not training and isinstance(labels, torch.Tensor)
        count = int(count_targets(labels)) if scored else 0
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        if not training and num_items_in_batch is None:
            loss = result[0] if isinstance(result, tuple) else result
            self._pf_eval_add(loss.detach().float() * count, count)
        return result

    def _pf_eval_add(self, loss_sum: torch.Tensor, count: int) -> None:
        self.pf_metrics.add_eval(loss_sum, count)

    def _track_num_input_tokens(self, inputs):
        # private Trainer method, no public hook: transformers counts a packed row's pad segment ("all") or any
        # token equal to the pad id ("non_padding"); num_input_tokens_seen counts real tokens here in both modes
        if self.args.include_num_input_tokens_seen == "no":
            return
        t = torch.tensor(self._pf_meter.last_real, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += int(self.accelerator.gather(t).sum().item())


def _measured_sft_trainer_cls():
    from trl import SFTTrainer

    class MeasuredSFTTrainer(TokenAccountingMixin, SFTTrainer):
        """Stock TRL SFTTrainer (padded or TRL padding-free) measured by the same code as pf-trl."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._pf_init_metrics()

    return MeasuredSFTTrainer


def _measured_dpo_trainer_cls():
    from trl import DPOTrainer

    class MeasuredDPOTrainer(TokenAccountingMixin, DPOTrainer):
        """Stock TRL DPOTrainer (padded) measured by the same code as pf-trl's (benchmarks/dpo_throughput.py)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._pf_init_metrics()

    return MeasuredDPOTrainer


def __getattr__(name: str) -> Any:
    if name == "MeasuredSFTTrainer":  # built on first use: importing TRL's SFTTrainer is slow
        return _measured_sft_trainer_cls()
    if name == "MeasuredDPOTrainer":
        return _measured_dpo_trainer_cls()
    raise AttributeError(name)
