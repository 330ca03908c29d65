"""Which data is trained, against TRL 1.16's padded SFTTrainer built from the same fields and rows (issue 19).

Each test walks the dataloaders of both trainers (what reaches the loss: every example's token ids and shifted
labels) and, where the field changes the step, compares parameters after one step. Negative controls switch pf-trl's
handling off and see the difference appear.

Before (main): max_length was ignored for tokenized rows (441 tokens trained instead of TRL's 240, parameters 0.97
relative apart after one step), eval likewise (353 tokens vs 152), dataloader_drop_last and train_sampling_strategy
were ignored in silence, and a resume on other rows with the same lengths was accepted.

Rows of random token ids run on a ``SMALL_VOCAB`` head (``SMALL``: trl_parity_support), rows of text on the
tokenizer's 32,000.
"""

from __future__ import annotations

import logging
import warnings

import datasets
import pytest
import torch
from trl_parity_support import LENGTHS, SMALL_VOCAB, fields, model, pf_trainer, rows, tokenizer, trl_trainer

SMALL = dict(vocab_size=SMALL_VOCAB)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PF_TRL_CACHE", str(tmp_path / "cache"))
    warnings.filterwarnings("ignore", category=FutureWarning)


def examples(loader) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every example reaching the loss: (token ids, labels after the first), in loader order."""
    out = []
    for batch in loader:
        ids, labels = batch["input_ids"], batch["labels"]
        if "attention_mask" in batch:  # padded rows
            for row_ids, row_labels, mask in zip(ids, labels, batch["attention_mask"]):
                n = int(mask.sum())
                out.append((tuple(row_ids[:n].tolist()), tuple(row_labels[1:n].tolist())))
        else:  # one packed row
            starts = (batch["position_ids"].reshape(-1) == 0).nonzero().reshape(-1).tolist() + [ids.shape[-1]]
            flat_ids, flat_labels = ids.reshape(-1).tolist(), labels.reshape(-1).tolist()
            for a, b in zip(starts, starts[1:]):
                out.append((tuple(flat_ids[a:b]), tuple(flat_labels[a + 1:b])))
    return out


@torch.no_grad()
def relative_update_gap(a, b, start) -> float:
    num = sum(float((x - y).pow(2).sum()) for x, y in zip(a.parameters(), b.parameters()))
    den = sum(float((x - s).pow(2).sum()) for x, s in zip(a.parameters(), start.parameters()))
    return (num / den) ** 0.5


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_max_length_trains_what_trl_trains(tmp_path, mode, monkeypatch):
    """max_length / truncation_mode on tokenized rows, train and eval: the same examples, eval loss and step as TRL
    (the row that keep_start leaves without a supervised label is dropped by both)."""
    evals = rows([80, 100, 77, 96], [4, 4, 4, 4], seed=1, **SMALL)
    kw = dict(max_length=40, truncation_mode=mode, per_device_train_batch_size=len(LENGTHS),
              per_device_eval_batch_size=4, max_steps=1, **SMALL)
    trl = trl_trainer(rows(**SMALL), tmp_path, evals, **kw)
    pf = pf_trainer(rows(**SMALL), tmp_path, evals, max_tokens_per_batch=1000, max_eval_tokens_per_batch=1000, **kw)
    trl_rows, pf_rows = examples(trl.get_train_dataloader()), examples(pf.get_train_dataloader())
    assert len(trl_rows) == (6 if mode == "keep_start" else 7)
    assert sorted(pf_rows) == sorted(trl_rows) and all(len(ids) <= 40 for ids, _ in pf_rows)
    assert sorted(examples(pf.get_eval_dataloader())) == sorted(examples(trl.get_eval_dataloader()))
    assert pf.evaluate()["eval_loss"] == pytest.approx(trl.evaluate()["eval_loss"], rel=1e-5)
    trl.train()
    pf.train()
    assert relative_update_gap(pf.model, trl.model, model(**SMALL)) < 1e-4

    # negative control: without the limit pf-trl trains the full rows (441 + tokens) and the step differs
    import pf_trl.data.sequence_limit as sequence_limit

    monkeypatch.setattr(sequence_limit, "apply_sequence_limit", lambda dataset, args, what: (dataset, None))
    unlimited = pf_trainer(rows(**SMALL), tmp_path / "neg", max_tokens_per_batch=1000, **kw)
    assert sum(len(ids) for ids, _ in examples(unlimited.get_train_dataloader())) == sum(LENGTHS)
    unlimited.train()
    assert relative_update_gap(unlimited.model, trl.model, model(**SMALL)) > 0.05


def test_default_max_length_cuts_a_long_row_and_says_so(tmp_path, caplog):
    """TRL's default max_length 1024 applies to tokenized rows (1,300 / 200 / 50 -> 1,024 / 200 / 50)."""
    data = rows([1300, 200, 50], [5, 5, 5], **SMALL)
    with caplog.at_level(logging.WARNING, logger="pf_trl"):
        pf = pf_trainer(data, tmp_path, **SMALL)
    assert sorted(len(r) for r in pf.train_dataset["input_ids"]) == [50, 200, 1024]
    assert "1 of 3 examples were longer than max_length 1024 and were cut (keep_start); 276 supervised tokens lost" \
        in caplog.text
    trl = trl_trainer(data, tmp_path, **SMALL)
    assert sorted(examples(pf.get_train_dataloader())) == sorted(examples(trl.get_train_dataloader()))


@pytest.mark.parametrize("policy", ["drop", "refuse"])
def test_truncation_policy_drop_or_refuse(tmp_path, policy):
    from pf_trl.data.truncation import TruncationRefused

    data = rows([64, 30, 90], [5, 5, 5], **SMALL)
    if policy == "refuse":
        with pytest.raises(TruncationRefused, match=r"training data: 2 of 3 examples are longer than max_length 40 "
                                                     r"\(first: row 0, 64 tokens\)"):
            pf_trainer(data, tmp_path, max_length=40, truncation=policy, **SMALL)
        return
    pf = pf_trainer(data, tmp_path, max_length=40, truncation=policy, **SMALL)
    assert [len(r) for r in pf.train_dataset["input_ids"]] == [30]


@pytest.mark.slow
def test_completion_mask_unset_is_applied_and_said_false_follows_trl(tmp_path, caplog):
    """Decision: an unset completion_only_loss keeps a tokenized completion_mask (TRL would train the full sequence)
    and says so in one line; False trains what TRL trains, True too without the line."""
    data = rows([30, 40, 50, 43], [15, 20, 25, 21], labels=False, mask_column="completion_mask", **SMALL)

    def supervised(loader):
        return sorted(sum(1 for t in labels if t != -100) for _, labels in examples(loader))

    with caplog.at_level(logging.WARNING, logger="pf_trl"):
        pf = pf_trainer(data, tmp_path / "unset", **SMALL)
    assert supervised(pf.get_train_dataloader()) == [15, 20, 22, 25]
    assert caplog.text.count("completion_mask column is applied") == 1
    trl = trl_trainer(data, tmp_path / "unset", **SMALL)
    assert supervised(trl.get_train_dataloader()) == [29, 39, 42, 49]  # TRL: the full sequence
    for value in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pf_trl"):
            pf = pf_trainer(data, tmp_path / str(value), completion_only_loss=value, **SMALL)
        trl = trl_trainer(data, tmp_path / str(value), completion_only_loss=value, **SMALL)
        assert sorted(examples(pf.get_train_dataloader())) == sorted(examples(trl.get_train_dataloader()))
        assert "completion_mask column is applied" not in caplog.text


@pytest.mark.slow
def test_assistant_only_loss_false_trains_every_token(tmp_path, caplog):
    """Chat rows: assistant_only_loss=False (TRL's default, and a converted SFTConfig's) trains every token as TRL does,
    the same token ids; unset (PaddingFreeConfig) trains the assistant turns and says so."""
    chats = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                           {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(4)]

    def pf_chat(name, **kw):
        from trl import SFTConfig

        from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

        sft = kw.pop("sft_config", False)
        cls = SFTConfig if sft else PaddingFreeConfig
        extra = {"padding_free": True} if sft else {"padding_free_mode": "huggingface"}
        return PaddingFreeSFTTrainer(model(), args=cls(**fields(tmp_path / name, **extra, **kw)),
                                     train_dataset=datasets.Dataset.from_list(chats), processing_class=tokenizer())

    from trl import SFTConfig, SFTTrainer

    trl = SFTTrainer(model(), args=SFTConfig(**fields(tmp_path / "trl")), train_dataset=datasets.Dataset.from_list(chats),
                     processing_class=tokenizer())
    expected = sorted(examples(trl.get_train_dataloader()))
    for name, kw in (("false", {"assistant_only_loss": False}), ("sft", {"sft_config": True})):
        assert sorted(examples(pf_chat(name, **kw).get_train_dataloader())) == expected
    with caplog.at_level(logging.WARNING, logger="pf_trl"):
        unset = pf_chat("unset")
    assert "chat rows train on assistant turns only" in caplog.text
    answers = [tokenizer().decode([t for t in labels if t != -100]) for _, labels in examples(unset.get_train_dataloader())]
    assert sorted(a.strip() for a in answers) == sorted(f"It is {2 * i}.</s>" for i in range(4))


@pytest.mark.slow
def test_sequential_sampling_trains_trls_batches(tmp_path):
    """train_sampling_strategy='sequential' (with shuffle_dataset): the batches TRL's SequentialSampler makes, in its
    order, so three steps end on the same parameters. Equal lengths make a budget of 4 examples hold exactly 4."""
    data = rows([24] * 16, [4] * 16, **SMALL)
    kw = dict(train_sampling_strategy="sequential", shuffle_dataset=True, per_device_train_batch_size=4, max_steps=3,
              max_length=None, **SMALL)
    trl = trl_trainer(data, tmp_path, **kw)
    pf = pf_trainer(data, tmp_path, **kw)
    assert examples(pf.get_train_dataloader()) == examples(trl.get_train_dataloader())
    trl.train()
    pf.train()
    assert relative_update_gap(pf.model, trl.model, model(**SMALL)) < 1e-4
    # negative control: pf-trl's default (random) sampling trains other batches
    shuffled = pf_trainer(data, tmp_path / "random", **{**kw, "train_sampling_strategy": "random"})
    assert examples(shuffled.get_train_dataloader()) != examples(trl.get_train_dataloader())


def test_group_by_length_is_named_in_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="pf_trl"):
        pf_trainer(rows([24] * 8, [4] * 8, **SMALL), tmp_path, train_sampling_strategy="group_by_length", **SMALL)
    assert "train_sampling_strategy='group_by_length' has no effect" in caplog.text


@pytest.mark.slow
def test_resume_refuses_other_examples_with_the_same_lengths(tmp_path):
    """The sampler's fingerprint sees lengths only: the same lengths with other rows (or the same rows reordered)
    used to resume, training some examples twice and others never. The data's content is checked now."""
    data = rows([24] * 16, [4] * 16, **SMALL)
    kw = dict(max_steps=3, save_strategy="steps", save_steps=2, per_device_train_batch_size=4, max_length=None,
              **SMALL)
    pf_trainer(data, tmp_path / "a", **kw).train()
    checkpoint = str(tmp_path / "a" / "pf" / "checkpoint-2")
    with pytest.raises(ValueError, match=r"training data is incompatible with the checkpoint's: the same number of "
                                         r"examples \(16\) but other token ids or labels, or the same examples in "
                                         r"another order"):
        pf_trainer(list(reversed(data)), tmp_path / "b", **kw).train(resume_from_checkpoint=checkpoint)
    with pytest.raises(ValueError, match=r"it has 15 examples, the checkpoint's data had 16"):
        pf_trainer(data[:15], tmp_path / "c", **kw).train(resume_from_checkpoint=checkpoint)
    resumed = pf_trainer(data, tmp_path / "d", **kw)  # the same data resumes
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 3


@pytest.mark.slow
@pytest.mark.parametrize("eos_token", [None, "<unk>"])
def test_prompt_completion_rows_and_eos_token_as_trl(tmp_path, eos_token):
    """Raw prompt-completion rows: the same token ids and completion labels as TRL, ending with SFTConfig.eos_token when
    set (TRL sets it on the tokenizer in its __init__; pf-trl before it tokenizes)."""
    data = [{"prompt": f"Question {i}: add {i} and {i}.", "completion": f" The sum is {2 * i}."} for i in range(5)]
    kw = {} if eos_token is None else {"eos_token": eos_token}
    trl = trl_trainer(data, tmp_path, **kw)
    pf = pf_trainer(data, tmp_path, **kw)
    got = sorted(examples(pf.get_train_dataloader()))
    assert got == sorted(examples(trl.get_train_dataloader()))
    assert {ids[-1] for ids, _ in got} == {0 if eos_token else 2}


@pytest.mark.slow
def test_eval_dataset_passed_to_evaluate_is_cut_as_trl_cuts_it(tmp_path):
    """evaluate(eval_dataset=rows): TRL prepares the rows (max_length) before evaluating them; so does pf-trl."""
    train = rows([30, 20], [5, 5], **SMALL)
    held_out = rows([80, 100, 77, 96], [4, 4, 4, 4], seed=2, **SMALL)
    kw = dict(max_length=40, per_device_eval_batch_size=4, **SMALL)
    trl = trl_trainer(train, tmp_path, **kw)
    pf = pf_trainer(train, tmp_path, max_eval_tokens_per_batch=1000, **kw)
    held = datasets.Dataset.from_list(held_out)
    got = pf.evaluate(eval_dataset=held)
    assert got["eval_supervised_tokens"] == 4 * 39 - 4 * 3  # 40 tokens kept, 4 prompt labels, shifted
    assert got["eval_loss"] == pytest.approx(trl.evaluate(eval_dataset=held)["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_chat_template_path_jinja_file_as_trl(tmp_path):
    """chat_template_path (a .jinja file) renders the chat rows pf-trl tokenizes, as TRL sets it before tokenizing."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>> {{ m['content'] }}\n{% endfor %}{{ eos_token }}")
    chats = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}!"}]}
             for i in range(3)]
    kw = dict(chat_template_path=str(template), assistant_only_loss=False)
    trl = trl_trainer(chats, tmp_path, **kw)
    pf = pf_trainer(chats, tmp_path, **kw)
    got = sorted(examples(pf.get_train_dataloader()))
    assert got == sorted(examples(trl.get_train_dataloader()))
    assert tokenizer().decode(list(got[0][0])).startswith("<<user>> Say 0.")
