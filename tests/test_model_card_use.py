"""The model card of an adapter loads as written: it names the base model (no `base_model: ''` left by PEFT), its
"Use" snippet has no absolute local path, and executed from the folder the card says (the output folder's parent),
it loads the very model that was trained: same logits. An embedded base is rebuilt from its config and seed; a local
base folder is named by its folder name."""

from __future__ import annotations

import re

import pytest

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
IDS = [1, 415, 2936, 9060, 285, 1142, 754, 12, 90, 3]
ROWS = [{"prompt": f"Question {i}:", "completion": f" answer number {i}."} for i in range(12)]


def _snippet(card: str) -> str:
    use = card.split("## Use", 1)[1]
    return re.search(r"```python\n(.*?)```", use, re.S).group(1)


def _run(snippet: str, cwd, monkeypatch) -> dict:
    """The card's snippet executed as written from ``cwd``, in a fresh namespace of the test's process (a new
    interpreter would only import torch and transformers again): the logits it loads for IDS."""
    import torch

    scope: dict = {}
    with monkeypatch.context() as m:
        m.chdir(cwd)
        exec(compile(snippet, "<model card snippet>", "exec"), scope)
    with torch.no_grad():
        logits = scope["model"](input_ids=torch.tensor([IDS])).logits
    return {"logits": logits[0, -1, :16].tolist(), "tokenizer": len(scope["tokenizer"])}


def _train(tmp_path, model, name: str):
    import datasets
    from peft import LoraConfig

    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    args = PaddingFreeConfig(output_dir=str(tmp_path / name), report_to=[], use_cpu=True, max_steps=2,
                             save_strategy="no", learning_rate=5e-2, disable_tqdm=True)
    trainer = PaddingFreeSFTTrainer(model, args=args, train_dataset=datasets.Dataset.from_list(ROWS),
                                    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           task_type="CAUSAL_LM"))
    trainer.train()
    trainer.save_model()
    import torch

    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=torch.tensor([IDS]).to(trainer.model.device)).logits[0, -1, :16].tolist()
    return trainer, (tmp_path / name / "README.md").read_text(), want


@pytest.mark.slow
def test_an_adapter_on_an_embedded_base_loads_as_the_card_says(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    from pf_trl.models import build_model

    _, card, want = _train(tmp_path, build_model("pf-trl/tiny-llama", seed=7, **TINY), "adapter")
    assert "base_model: ''" not in card and "base_model:adapter:'" not in card and "library_name: peft" in card
    assert "embedded `pf-trl/tiny-llama` config" in card
    snippet = _snippet(card)
    assert str(tmp_path) not in snippet and 'model_dir = "adapter"' in snippet
    got = _run(snippet, tmp_path, monkeypatch)  # "run from the folder that contains `adapter`"
    assert got["logits"] == pytest.approx(want, abs=1e-5) and got["tokenizer"] == 32000
    # negative control: another seed is another base, and the check sees it
    wrong = _run(snippet.replace("seed=7", "seed=8"), tmp_path, monkeypatch)
    assert wrong["logits"] != pytest.approx(want, abs=1e-5)


@pytest.mark.slow
def test_an_adapter_on_a_local_base_folder_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model

    base = build_model("pf-trl/tiny-llama", seed=3, **TINY)
    base.save_pretrained(tmp_path / "my-base")
    load_tokenizer().save_pretrained(tmp_path / "my-base")
    _, card, want = _train(tmp_path, build_model(str(tmp_path / "my-base")), "tuned")
    snippet = _snippet(card)
    assert str(tmp_path) not in snippet and 'from_pretrained("my-base")' in snippet
    assert "base_model: ''" not in card
    assert _run(snippet, tmp_path, monkeypatch)["logits"] == pytest.approx(want, abs=1e-5)
