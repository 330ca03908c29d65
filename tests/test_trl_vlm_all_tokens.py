"""Vision-language chat rows with ``assistant_only_loss=False`` (TRL's default): every token is trained, as TRL's
padded run trains it, with a processor template that has no ``{% generation %}`` blocks (refused before)."""

from __future__ import annotations

import copy

import pytest
from test_vlm import GRAD_RTOL, LOSS_ATOL, _grads, chat_rows, grad_error, one_batch


@pytest.mark.slow
def test_vlm_chat_rows_train_every_token_as_trl_with_assistant_only_loss_false(tmp_path):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.data.formats import has_generation_blocks
    from pf_trl_dev.tiny_vlm import chat_template, tiny_vlm

    model, processor = tiny_vlm("qwen2_vl")
    processor.chat_template = chat_template("qwen2_vl", training=False)  # the model's own: no generation blocks
    assert not has_generation_blocks(processor.chat_template)
    initial = copy.deepcopy(model.state_dict())
    rows = chat_rows()
    trl = SFTTrainer(model=model, processing_class=processor, train_dataset=Dataset.from_list(rows),
                     args=SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=None,
                                    per_device_train_batch_size=4, save_strategy="no"))  # assistant_only_loss=False
    ref_batch = trl.data_collator(copy.deepcopy(rows))
    ref = trl.compute_loss(model, ref_batch)
    ref.backward()
    ref_grads = _grads(model)

    def pf(assistant_only_loss: bool):
        pf_model, _ = tiny_vlm("qwen2_vl", processor)
        pf_model.load_state_dict(initial)
        args = PaddingFreeConfig(output_dir=str(tmp_path / f"pf-{assistant_only_loss}"), report_to=[], use_cpu=True,
                                 max_length=None, max_tokens_per_batch=100_000, save_strategy="no",
                                 assistant_only_loss=assistant_only_loss)
        trainer = PaddingFreeSFTTrainer(pf_model, args=args, train_dataset=Dataset.from_list(rows),
                                        processing_class=processor)
        batch = one_batch(trainer)
        return trainer, batch, trainer.compute_loss(trainer.model, dict(batch))

    trainer, batch, loss = pf(False)
    loss.backward()
    assert abs(loss.item() - ref.item()) < LOSS_ATOL
    assert grad_error(_grads(trainer.model), ref_grads) < GRAD_RTOL
    # negative control: assistant turns only (pf-trl's default) trains fewer tokens, so another loss
    _, batch_true, loss_true = pf(True)
    assert int((batch_true["labels"] != -100).sum()) < int((batch["labels"] != -100).sum())
    assert abs(loss_true.item() - ref.item()) > 1e-3


def test_a_template_trl_cannot_mark_is_refused_naming_assistant_only_loss_false(tmp_path):
    from datasets import Dataset

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl_dev.tiny_vlm import tiny_vlm

    model, processor = tiny_vlm("qwen2_vl")
    # a template of no known model: no {% generation %} blocks and no training variant in TRL
    processor.chat_template = "{% for m in messages %}{{ m['role'] }}: ...\n{% endfor %}"
    args = PaddingFreeConfig(output_dir=str(tmp_path / "pf"), report_to=[], use_cpu=True, max_length=None,
                             max_tokens_per_batch=100_000, save_strategy="no", assistant_only_loss=True)
    with pytest.raises(ValueError) as caught:
        PaddingFreeSFTTrainer(model, args=args, train_dataset=Dataset.from_list(chat_rows()),
                              processing_class=processor)
    message = str(caught.value)
    assert "\n" not in message and "--assistant_only_loss False (TRL's default) to train every token" in message
