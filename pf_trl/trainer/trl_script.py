"""The end of TRL's training scripts (``trl dpo``, ``trl reward``, ``trl kto``), shared by ``pf-trl dpo``,
``pf-trl reward`` and ``pf-trl kto``: ``--ignore_bias_buffers``, train, the final save, ``--push_to_hub``, the
trackers' end."""

from __future__ import annotations

from typing import Any

__all__ = ["ignore_bool_buffers", "train_save_push"]


def ignore_bool_buffers(model: Any) -> None:
    """``--ignore_bias_buffers`` as TRL's scripts apply it: DDP skips the model's boolean buffers (attention-bias
    masks some models register), which it cannot broadcast (its private ``_ddp_params_and_buffers_to_ignore``)."""
    import torch

    model._ddp_params_and_buffers_to_ignore = [name for name, buffer in model.named_buffers()
                                               if buffer.dtype == torch.bool]


def train_save_push(trainer: Any, script_args: Any, training_args: Any, command: str) -> Any:
    """Train, save to ``output_dir`` and, with ``--push_to_hub``, push (``dataset_name`` on the card) as TRL's
    script does; returns ``trainer``."""
    import transformers
    from packaging.version import Version

    if getattr(script_args, "ignore_bias_buffers", False):
        ignore_bool_buffers(trainer.model)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if trainer.is_world_process_zero():
        print(f"{command}: model saved to {training_args.output_dir}", flush=True)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        if trainer.is_world_process_zero():
            print(f"{command}: model pushed to the Hub as {trainer.hub_model_id}", flush=True)
    if Version(transformers.__version__) >= Version("5.18.0") and hasattr(trainer, "end"):
        trainer.end()  # the trackers' end, as TRL's script (transformers >= 5.18)
    return trainer
