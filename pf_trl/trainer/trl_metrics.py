"""TRL's own step metrics in padding-free mode: ``entropy`` and ``num_tokens``, with TRL's meaning.

TRL's ``SFTTrainer.compute_loss`` logs, per micro-batch, the mean entropy of the predicted distributions over the
supervised positions (all ranks: summed entropies / summed supervised tokens) and ``num_tokens``, the tokens trained
on so far (cumulative, all ranks; real tokens, padding excluded). pf-trl's own forward computes the loss at the
supervised positions only, so these come from its per-token terms (:class:`pf_trl.trainer.loss.LossTerms`) and the
packed row's real-token count, and land in the same ``trainer._metrics`` TRL averages and logs (``eval_`` prefixed in
evaluation). ``mean_token_accuracy`` is pf-trl's token meter's in training (:mod:`pf_trl.trainer.callbacks`), TRL's
per-micro-batch mean in evaluation.
"""

from __future__ import annotations

from typing import Any

import torch


def record_num_tokens(trainer, real_tokens: int | None) -> None:
    """``num_tokens``: in training, this micro-batch's real tokens (every rank's) added to TRL's running total; in
    evaluation the total so far, as TRL logs it."""
    mode = "train" if trainer.model.training else "eval"
    if mode == "train":
        local = torch.tensor(int(real_tokens or 0), device=trainer.args.device)
        seen = int(trainer.accelerator.gather_for_metrics(local).sum().item())
        trainer._total_train_tokens += seen // max(int(getattr(trainer, "_tp_size", 1) or 1), 1)
    trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]


def record_step_metrics(trainer, out: dict[str, Any]) -> None:
    """``entropy``: the summed entropies of every rank's supervised positions over their count (0.0 for none), one
    value per micro-batch, as TRL appends it (nothing on a path that computes no entropy: Liger's). In evaluation also
    ``mean_token_accuracy`` the same way (in training pf-trl's token meter logs it)."""
    mode = "train" if trainer.model.training else "eval"
    entropy_sum = out.get("entropy_sum")
    correct = out.get("correct")
    accuracy = mode == "eval" and correct is not None and int(correct) >= 0
    if entropy_sum is None and not accuracy:
        return
    zero = out["num_tokens"].new_zeros(())
    # one gather for the three sums (TRL gathers each)
    local = torch.stack([t.detach().to(torch.float64).reshape(()) for t in
                         (entropy_sum if entropy_sum is not None else zero, correct if accuracy else zero,
                          out["num_tokens"])])
    total = trainer.accelerator.gather_for_metrics(local.reshape(1, 3).to(trainer.args.device)).reshape(-1, 3).sum(0)
    count = float(total[2])
    if entropy_sum is not None:
        trainer._metrics[mode]["entropy"].append(float(total[0]) / count if count > 0 else 0.0)
    if accuracy:
        trainer._metrics[mode]["mean_token_accuracy"].append(float(total[1]) / count if count > 0 else 0.0)
