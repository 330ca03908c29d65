"""Streamed data (datasets.IterableDataset): packed to the token budget from a bounded look-ahead buffer, refused at
construction for what is knowable then, resumed exactly from the stream's state, on one process and on 2 ranks."""

from __future__ import annotations

import hashlib
import json
import subprocess
import textwrap

import numpy as np
import pytest

from conftest import write_jsonl

TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)


def _alpaca(sample_rows, n, offset=0):
    return [{"instruction": r["prompt"][15:300], "input": "", "output": r["completion"][:500]}
            for r in sample_rows[offset:offset + n]]


@pytest.fixture(scope="module")
def alpaca_file(tmp_path_factory, sample_rows):
    return write_jsonl(tmp_path_factory.mktemp("stream") / "alpaca.jsonl", _alpaca(sample_rows, 120))


def _stream(path):
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)


def _key(example) -> str:
    return hashlib.sha1(str(example["input_ids"]).encode()).hexdigest()[:12]


def test_packer_fills_the_budget_and_resumes_exactly_at_every_batch(alpaca_file, tokenizer):
    from pf_trl.batching.stream_sampler import StreamPacker
    from pf_trl.data.pretokenize import PretokenizeConfig
    from pf_trl.data.streaming import prepare_stream

    config = PretokenizeConfig(max_seq_len=512)
    make = lambda: prepare_stream(_stream(alpaca_file), tokenizer, config).dataset
    packer = StreamPacker(make(), 2048, buffer_size=32)
    batches, buffered = [], []
    for batch in packer:
        batches.append([_key(e) for e in batch])
        buffered.append(len(packer._buffer))
        assert sum(e["length"] for e in batch) <= 2048
        if len(batches) == 40:
            break
    assert packer.passes >= 1, "the run crossed the end of the stream (120 rows) into its next pass"
    assert max(buffered) <= 32, "memory bounded by the buffer"
    assert packer.real_tokens / (2048 * len(batches)) >= 0.95
    for k in (1, 7, 23, 39):
        state = json.loads(json.dumps(packer.resume_state(k), default=str))  # the saved form: JSON + examples
        resumed = StreamPacker(make(), 2048, buffer_size=32, state=state)
        again = []
        for batch in resumed:
            again.append([_key(e) for e in batch])
            if len(again) == 40 - k:
                break
        assert again == batches[k:], k
    with pytest.raises(ValueError, match="buffer 32; now 2048, 16"):
        list(zip(range(1), StreamPacker(make(), 2048, buffer_size=16, state=packer.resume_state(7))))


def _trainer(tokenizer, tmp_path, train, **kw):
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    base = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_length=512, max_steps=3,
                max_tokens_per_batch=1024, save_strategy="no", disable_tqdm=True, logging_steps=100)
    eval_dataset = kw.pop("eval_dataset", None)
    base.update(kw)
    return PaddingFreeSFTTrainer(build_model("pf-trl/tiny-llama", seed=0, **TINY), args=PaddingFreeConfig(**base),
                                 train_dataset=train, eval_dataset=eval_dataset, processing_class=tokenizer)


def test_padded_training_on_a_stream_gets_token_columns_only(alpaca_file, tokenizer, tmp_path):
    """padding_free=False on a stream: pf-trl tokenizes it and hands TRL rows of input_ids and labels, none of the
    tokenizing pass's bookkeeping columns (the list lives in pf_trl.data.bookkeeping), and TRL trains them."""
    from pf_trl.data.bookkeeping import BOOKKEEPING_COLUMNS

    trainer = _trainer(tokenizer, tmp_path, _stream(alpaca_file), padding_free_mode="none", max_tokens_per_batch=None,
                       per_device_train_batch_size=2, max_steps=1)
    first = next(iter(trainer.train_dataset))
    assert set(first) == {"input_ids", "labels"}, sorted(set(first) & set(BOOKKEEPING_COLUMNS))
    assert trainer.train().global_step == 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["raw", "shards", "data_config"])
def test_stream_trains_padding_free_at_the_budget(alpaca_file, tokenizer, tmp_path, kind, sample_rows):
    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.shards import load_shards

    if kind == "raw":
        train = _stream(alpaca_file)
    elif kind == "data_config":  # fms-hf-tuning's `streaming: true`: each source its format, interleaved by weight
        chats = write_jsonl(tmp_path / "chats.jsonl", [
            {"messages": [{"role": "user", "content": r["prompt"][15:300]},
                          {"role": "assistant", "content": r["completion"][:500]}]} for r in sample_rows[300:360]])
        (tmp_path / "stream.yaml").write_text(
            "dataprocessor: {type: default, streaming: true, seed: 3}\ndatasets:\n"
            f"  - {{name: alpaca, sampling: 0.7, data_paths: [{alpaca_file}]}}\n"
            f"  - {{name: chats, sampling: 0.3, data_paths: [{chats}]}}\n")
        train = str(tmp_path / "stream.yaml")
    else:
        pretokenize(alpaca_file, tmp_path / "shards", tokenizer=tokenizer, progress=False)
        train = load_shards(tmp_path / "shards").to_iterable_dataset()
    trainer = _trainer(tokenizer, tmp_path, train, eval_dataset=_stream(alpaca_file), eval_max_examples=6)
    metrics = trainer.train().metrics
    assert trainer.state.global_step == 3
    assert metrics["train_padding_share"] == 0.0
    assert metrics["train_real_tokens"] >= 0.95 * 3 * 1024, "fill >= 0.95 of the token budget"
    assert trainer.eval_dataset.num_rows == 6  # a streamed eval set, read at construction
    if kind == "data_config":
        assert [(x["name"], x["input_format"]) for x in trainer._pf_stream.sources] == [("alpaca", "alpaca"),
                                                                                       ("chats", "messages")]
    assert np.isfinite(trainer.evaluate()["eval_loss"])


def test_stream_refused_at_construction_for_what_is_known_then(alpaca_file, tokenizer, tmp_path):
    import datasets

    with pytest.raises(ValueError, match="set max_steps"):
        _trainer(tokenizer, tmp_path, _stream(alpaca_file), max_steps=-1)
    odd = datasets.Dataset.from_list([{"question": "q", "answer": "a"}] * 4).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"stream, checked on its first 4 rows\): cannot detect the input format"):
        _trainer(tokenizer, tmp_path, odd)
    with pytest.raises(ValueError, match="smaller than max_length 512"):
        _trainer(tokenizer, tmp_path, _stream(alpaca_file), max_tokens_per_batch=256)


DDP_SCRIPT = textwrap.dedent(
    r'''
    import hashlib, json, os, sys
    import datasets, torch
    from pf_trl.data.tokenizer import load_tokenizer
    from pf_trl.models import build_model
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer

    # MODES: "full,resume", trained one after the other in the same processes (one launch: the imports paid once)
    data, out, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    rank = int(os.environ.get("RANK", 0))
    trained = []

    class T(PaddingFreeSFTTrainer):
        def compute_loss(self, model, inputs, *a, **kw):
            if self.model.training:
                ids, pos = inputs["input_ids"][0].tolist(), inputs["position_ids"][0].tolist()
                starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
                keys = [hashlib.sha1(str(ids[a:b]).encode()).hexdigest()[:12] for a, b in zip(starts, starts[1:])]
                trained.append([self.state.global_step, keys, len(ids)])
            return super().compute_loss(model, inputs, *a, **kw)

    def train(resume):
        trained.clear()
        stream = datasets.load_dataset("json", data_files=data, split="train", streaming=True)
        args = PaddingFreeConfig(output_dir=os.path.join(out, resume), report_to=[], use_cpu=True, max_length=512, max_steps=4, save_steps=2,
                                 save_strategy="steps", max_tokens_per_batch=1024, disable_tqdm=True, logging_steps=1,
                                 learning_rate=1e-3, lr_scheduler_type="constant", seed=0, stream_buffer_size=24,
                                 padding_free_mode="internal", save_only_model=False)
        model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
        trainer = T(model, args=args, train_dataset=stream, processing_class=load_tokenizer())
        result = trainer.train(resume_from_checkpoint=os.path.join(out, "full", "checkpoint-2") if resume == "resume" else None)
        with open(os.path.join(out, f"{resume}_{rank}.json"), "w") as f:
            json.dump({"trained": trained, "metrics": result.metrics, "world": trainer.args.world_size,
                       "budget": trainer.pf_token_budget, "ignore_data_skip": trainer.args.ignore_data_skip}, f)
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
                       os.path.join(out, f"weights_{resume}.pt"))

    for mode in modes:
        train(mode)
        # the next mode starts from a clean slate: no accelerate state left (the process group stays)
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.distributed.barrier()
    # every result is on disk: leave without gloo's C++ teardown, whose threads abort a process now and then on a
    # loaded machine (tests/test_distributed.py says the same)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    '''
)


@pytest.mark.slow
def test_stream_under_ddp_two_ranks_packs_and_resumes_exactly(alpaca_file, tmp_path):
    """torchrun, 2 ranks (gloo): each rank packs its own part of the stream (disjoint), to the budget with no
    padding; a run resumed from the step-2 checkpoint trains exactly the batches of steps 3-4 of the uninterrupted
    run, to the same weights (the packer's buffer and the stream position are in the checkpoint)."""
    import torch
    from test_distributed import _env, _failure, _torchrun

    script = tmp_path / "stream_ddp.py"
    script.write_text(DDP_SCRIPT)
    env = {**_env(), "PF_TRL_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "run"
    proc = subprocess.run(_torchrun(script, str(alpaca_file), str(out), "full,resume"), env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, _failure(proc)
    full = [json.loads((out / f"full_{r}.json").read_text()) for r in (0, 1)]
    resumed = [json.loads((out / f"resume_{r}.json").read_text()) for r in (0, 1)]
    assert full[0]["world"] == 2 and full[0]["budget"] == 1024
    for r in (0, 1):
        steps = [t[0] for t in full[r]["trained"]]
        assert steps == [0, 1, 2, 3]
        assert full[r]["metrics"]["train_padding_share"] == 0.0
        fill = sum(t[2] for t in full[r]["trained"]) / (1024 * len(steps))
        assert fill >= 0.95, fill
        assert resumed[r]["trained"] == full[r]["trained"][2:], f"rank {r}: steps 3-4 after the resume"
        # the resume set ignore_data_skip for the call only (the packer starts at the checkpoint's position)
        assert resumed[r]["ignore_data_skip"] is False, f"rank {r}: ignore_data_skip left set after train()"
    keys = [{k for t in full[r]["trained"] for k in t[1]} for r in (0, 1)]
    assert keys[0] and keys[1] and not keys[0] & keys[1], "the ranks read disjoint parts of the stream"
    for state in ("pf_trl_stream_state_rank0.json", "pf_trl_stream_state_rank1.json"):
        assert (out / "full" / "checkpoint-2" / state).is_file()
    w_full, w_resumed = torch.load(out / "weights_full.pt"), torch.load(out / "weights_resume.pt")
    for name, value in w_full.items():
        torch.testing.assert_close(w_resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
