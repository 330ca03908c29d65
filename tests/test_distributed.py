"""torchrun --nproc_per_node 2 (gloo, CPU): disjoint balanced batches, equal step counts, and the same losses and
weights as one process training on the same global batches (gradient accumulation over the two ranks' batches).

FSDP: accelerate runs FSDP only on accelerator devices (on CPU it trains plain DDP even when ``fsdp`` is set; pf-trl
warns, tested below), so the trainer cannot run sharded here. What pf-trl adds under FSDP2 is its loss forward
(backbone, then the LM head's weight used directly in the chunked cross-entropy); that is tested with torch's own
``fully_shard`` applied as accelerate's FSDP2 plugin applies it (each decoder layer, then the root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

SCRIPT = textwrap.dedent(
    r'''
    import json, logging, os, sys
    import numpy as np
    import torch
    from pf_trl.data.shards import load_shards
    from pf_trl.models import build_model
    from pf_trl.batching.sampler import TokenBudgetBatchSampler
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.data.tokenizer import load_tokenizer

    # MODES: comma-separated, run one after the other in the same processes (one launch: the imports paid once);
    # "fsdp2_loss" and "cli_save" are the launch's part of the tests of the same names (FSDP2_LOSS, CLI_SAVE below);
    # ARGV[4:]: the arguments of `pf-trl train` in "cli_save"
    shards, out, modes, cli_args = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4:]
    TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    ds = load_shards(shards)
    lengths = np.asarray(ds["length"])
    ds = ds.select(np.nonzero(lengths <= 200)[0][:32].tolist()).flatten_indices()
    rank = int(os.environ.get("RANK", 0))

    class Warnings(logging.StreamHandler):
        """pf-trl's warnings of the current mode, recorded (which mode said what) and printed to stderr as before
        (a handler of its own replaces logging's last resort, which printed them)."""
        def __init__(self):
            super().__init__(sys.stderr)
            self.setLevel(logging.WARNING)
            self.messages = []
        def emit(self, record):
            self.messages.append(record.getMessage())
            super().emit(record)

    warned = Warnings()
    logging.getLogger("pf_trl").addHandler(warned)

    class Interleaved:
        """One process, the two ranks' batches of each step in a row (GA=2 then equals a 2-rank step)."""
        def __init__(self, a, b):
            self.a, self.b = a, b
            self.max_tokens = a.max_tokens
        def __len__(self):
            return 2 * len(self.a)
        def set_epoch(self, e):
            self.a.set_epoch(e); self.b.set_epoch(e)
        def __iter__(self):
            for x, y in zip(self.a, self.b):
                yield x
                yield y
        def state_dict(self):
            return self.a.state_dict()

    def train(mode):
        seen = []
        warned.messages.clear()

        class T(PaddingFreeSFTTrainer):
            def _pf_sampler(self, dataset, budget, batch_size, *, shuffle):
                if mode == "single" and shuffle:
                    mk = lambda r: TokenBudgetBatchSampler(np.asarray(dataset["length"]), 600, seed=0, num_replicas=2, rank=r)
                    return Interleaved(mk(0), mk(1))
                return super()._pf_sampler(dataset, budget, batch_size, shuffle=shuffle)
            def compute_loss(self, model, inputs, **kw):
                if self.model.training:
                    seen.append(int(inputs["input_ids"].numel()))
                return super().compute_loss(model, inputs, **kw)

        args = PaddingFreeConfig(output_dir=out, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                                 learning_rate=1e-3, seed=0, max_steps=3, padding_free_mode="internal", max_length=None,
                                 use_cpu=True, max_tokens_per_batch=600, dataloader_num_workers=0,
                                 gradient_accumulation_steps=2 if mode == "single" else 1,
                                 **({"fsdp": "full_shard auto_wrap",
                                     "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
                                    if mode == "fsdp_on_cpu" else {}))
        model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
        tr = T(model, args=args, train_dataset=ds, processing_class=load_tokenizer())
        tr.train()
        from torch.distributed.tensor import DTensor
        sharded = sum(isinstance(p, DTensor) for p in tr.model.parameters())
        sampler = tr._pf_train_sampler
        res = {
            "rank": rank,
            "world": tr.args.world_size,
            "steps": tr.state.global_step,
            "losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
            "micro_tokens": seen,
            "batches": [list(map(int, b)) for b in (list(sampler) if mode != "single" else [])][:3],
            "real_tokens": tr.state.log_history[-1]["train_real_tokens"],
            "sharded_parameters": sharded,
            "fsdp_warning": any("fsdp was requested, but accelerate runs" in m for m in warned.messages),
        }
        with open(os.path.join(out, f"result_{mode}_{rank}.json"), "w") as f:
            json.dump(res, f)
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in tr.model.state_dict().items()}, os.path.join(out, f"weights_{mode}.pt"))

    def fsdp2_loss(out):
        """FSDP2_LOSS: pf-trl's loss forward on a model sharded with torch's own fully_shard."""
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from pf_trl.attention import enable_padding_free
        from pf_trl.batching.collator import PaddingFreeCollator
        from pf_trl.models import build_model
        from pf_trl.trainer.loss import install_pf_loss_forward

        rank, world = dist.get_rank(), dist.get_world_size()
        VOCAB = 128
        TINY = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, tie_word_embeddings=False)
        gen = torch.Generator().manual_seed(0)

        def example(n):
            ids = torch.randint(3, VOCAB, (n,), generator=gen).tolist()
            return {"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]}

        per_rank = [[example(n) for n in (9, 1, 14, 30)], [example(n) for n in (5, 11, 7, 3, 25)]]
        collate = PaddingFreeCollator()
        batches = [collate(b) for b in per_rank]
        n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)  # the step's supervised tokens, all ranks

        def prepared():
            model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
            enable_padding_free(model, mode="internal", backend="sdpa")
            install_pf_loss_forward(model, "chunked", 16)  # small chunks: several chunks per row
            return model

        ref = prepared()  # every rank: one process over both ranks' batches
        ref_loss = sum(ref(**b, pf_loss=True)["loss_sum"] for b in batches) / n_items
        ref_loss.backward()

        model = prepared()
        for layer in model.model.layers:  # what accelerate's FSDP2 plugin does with transformer_layer_cls_to_wrap
            fully_shard(layer)
        fully_shard(model)
        sharded = sum(isinstance(p, DTensor) for p in model.parameters())
        res = model(**batches[rank], pf_loss=True)
        loss = res["loss_sum"] / n_items * world  # FSDP averages gradients over ranks, as the trainer assumes
        loss.backward()
        total = res["loss_sum"].detach().clone()
        dist.all_reduce(total)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
        if rank == 0:
            err = {n: float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-12)) for n in ref_grads}
            json.dump({"sharded": sharded, "params": len(ref_grads), "loss": float(total / n_items), "ref_loss": float(ref_loss),
                       "max_rel_grad_err": max(err.values()), "worst": max(err, key=err.get), "keys_equal": grads.keys() == ref_grads.keys()},
                      open(os.path.join(out, "fsdp_result.json"), "w"))
    def cli_save(out, argv):
        """CLI_SAVE: `pf-trl train` with Trainer.save_model made a collective as it is under FSDP / ZeRO-3."""
        import torch.distributed as dist
        from pf_trl.cli.main import main

        original = PaddingFreeSFTTrainer.save_model

        def collective_save_model(self, *args, **kwargs):
            # FSDP's full-state-dict gather / ZeRO-3's consolidation: every rank must take part. gloo's barrier fails
            # (or hangs until the timeout) when a rank never arrives, so a rank-0-only call cannot pass this test.
            dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=60))
            with open(os.path.join(out, f"save_calls_{dist.get_rank()}.txt"), "a") as f:
                f.write((args[0] if args else kwargs.get("output_dir") or "final") + "\n")
            return original(self, *args, **kwargs)

        PaddingFreeSFTTrainer.save_model = collective_save_model
        try:
            rc = main(["train", *argv])
        finally:
            PaddingFreeSFTTrainer.save_model = original
        if rc != 0:
            os._exit(rc)  # no teardown barrier: the other rank may be inside a collective that this one never joins

    for mode in modes:
        if mode == "fsdp2_loss":
            fsdp2_loss(out)
        elif mode == "cli_save":
            cli_save(out, cli_args)
        else:
            train(mode)
        # the next mode starts from a clean slate: no accelerate state left (the process group stays)
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=True)
        if torch.distributed.is_initialized():  # both ranks' results are on disk once both pass this barrier
            torch.distributed.barrier()
    # leave without gloo's C++ teardown, whose threads abort a process now and then on a loaded machine ("terminate
    # called without an active exception", exit -6) after every collective has finished
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    '''
)


def _env():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, whatever the host name resolves to
    return env


def _torchrun(script, *args: str) -> list[str]:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found"
    # --tee 3: each rank's output prefixed with its rank, so a failure says which rank stopped where
    # --standalone: a rendezvous on localhost at a free port (no fixed port that another run may hold)
    return [torchrun, "--standalone", "--nproc_per_node", "2", "--tee", "3", str(script), *args]


def _failure(proc) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory, sample_shards):
    """One process, GA 2 over the two ranks' interleaved batches: the reference of the two-rank runs."""
    out = tmp_path_factory.mktemp("dist_single")
    script = out / "dist_train.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(sample_shards), str(out), "single"], env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "result_single_0.json").read_text()), torch.load(out / "weights_single.pt")


def _cli_args(sample_shards, folder) -> list[str]:
    """`pf-trl train` on 2 ranks: 2 steps, a checkpoint at each, then the final model (test_torchrun_cli_...)."""
    from pf_trl.data.pretokenize import pretokenize
    from pf_trl.data.shards import load_shards

    rows = folder / "train.jsonl"
    with open(rows, "w") as f:
        for row in load_shards(sample_shards).select(range(24)):
            f.write(json.dumps({"input_ids": row["input_ids"][:128], "labels": row["labels"][:128]}) + "\n")
    # shards built once here: two ranks building the same cache entry at once is a separate race (cli data path)
    data = folder / "shards"
    pretokenize(rows, data, progress=False)
    tiny = "num_hidden_layers=1,hidden_size=32,intermediate_size=64,num_attention_heads=2,num_key_value_heads=1"
    return ["--training_data_path", str(data), "--output_dir", str(folder / "run"), "--model_overrides", tiny,
            "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "1", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--padding_free_mode", "internal", "--use_cpu", "True", "--max_seq_len", "128",
            "--disable_tqdm", "True", "--save_only_model", "True"]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, sample_shards) -> tuple:
    """One torchrun launch for every two-rank check of this module, one after the other (the imports paid once):
    both trainer modes, the FSDP2 loss, then `pf-trl train` (last: the command sets pf-trl's loggers up)."""
    out = tmp_path_factory.mktemp("dist_two_ranks")
    script = out / "dist_train.py"
    script.write_text(SCRIPT)
    cli = _cli_args(sample_shards, out)
    env = {**_env(), "PF_TRL_CACHE": str(out / "cache")}
    proc = subprocess.run(_torchrun(script, str(sample_shards), str(out), "ddp,fsdp_on_cpu,fsdp2_loss,cli_save", *cli),
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, _failure(proc)
    return out, proc


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp_on_cpu"])
def test_torchrun_two_ranks_match_single_process(two_rank_runs, single_process_run, mode):
    """``fsdp_on_cpu``: accelerate ignores ``fsdp`` off accelerators and trains DDP; pf-trl must say so (on stderr,
    and only in that mode: each rank records the warnings of each mode), and the run must still be exact."""
    tmp_path, proc = two_rank_runs
    s, w_single = single_process_run

    r0, r1 = (json.loads((tmp_path / f"result_{mode}_{r}.json").read_text()) for r in (0, 1))
    assert r0["world"] == r1["world"] == 2
    assert r0["sharded_parameters"] == 0
    # said once, on rank 0 (pf-trl's warnings are quiet on the other ranks)
    assert (r0["fsdp_warning"] or r1["fsdp_warning"]) == (mode == "fsdp_on_cpu"), proc.stderr[-3000:]
    assert "fsdp was requested, but accelerate runs" in proc.stderr  # what the user sees
    assert r0["steps"] == r1["steps"] == s["steps"] == 3
    # disjoint batches on the two ranks, balanced within the budget
    idx0 = {i for b in r0["batches"] for i in b}
    idx1 = {i for b in r1["batches"] for i in b}
    assert idx0 and idx1 and not idx0 & idx1
    assert len(r0["micro_tokens"]) == len(r1["micro_tokens"]) == 3
    assert all(abs(a - b) <= 600 for a, b in zip(r0["micro_tokens"], r1["micro_tokens"]))
    # the global batches of the two runs are the same micro-batches
    assert sorted(s["micro_tokens"]) == sorted(r0["micro_tokens"] + r1["micro_tokens"])
    assert r0["real_tokens"] == r1["real_tokens"] == s["real_tokens"]  # reduced over ranks
    np.testing.assert_allclose(r0["losses"], s["losses"], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(r1["losses"], s["losses"], rtol=2e-5, atol=2e-5)
    w_dist = torch.load(tmp_path / f"weights_{mode}.pt")
    for name, value in w_single.items():
        torch.testing.assert_close(w_dist[name], value, rtol=1e-4, atol=2e-5, msg=name)


@pytest.mark.slow
def test_fsdp2_sharded_pf_loss_matches_single_process(two_rank_runs):
    """Two ranks, each its own packed row, every parameter an FSDP2 DTensor: the step's loss and the reduced
    gradients equal one process over both rows (loss / all supervised tokens, x world size as the trainer does)."""
    out, _ = two_rank_runs
    r = json.loads((out / "fsdp_result.json").read_text())
    assert r["sharded"] == r["params"] > 0, "FSDP2 did not shard the parameters"
    assert r["keys_equal"]
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-5, r
    assert r["max_rel_grad_err"] <= 1e-4, r  # a missing world-size factor gives 0.5


@pytest.mark.slow
def test_torchrun_cli_saves_checkpoint_and_final_model_on_every_rank(two_rank_runs):
    """`pf-trl train` on 2 ranks (gloo) saves a checkpoint and the final model; the save is entered by every rank,
    as FSDP / ZeRO-3 need (before: rank 0 only, which hangs there)."""
    tmp_path, _ = two_rank_runs
    out = tmp_path / "run"
    calls = [(tmp_path / f"save_calls_{r}.txt").read_text().split() for r in (0, 1)]
    assert calls[0] == calls[1] and len(calls[0]) == 3, calls  # checkpoint-1, checkpoint-2, final: on both ranks
    for folder in (out / "checkpoint-1", out / "checkpoint-2", out):
        assert (folder / "model.safetensors").is_file(), sorted(p.name for p in folder.iterdir())
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out)
    last = AutoModelForCausalLM.from_pretrained(out / "checkpoint-2")
    for (name, a), (_, b) in zip(final.state_dict().items(), last.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)  # the final model is the trained one (step 2)
