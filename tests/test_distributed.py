"""torchrun --nproc_per_node 2 (gloo, CPU): disjoint balanced batches, equal step counts, and the same losses and
weights as one process training on the same global batches (gradient accumulation over the two ranks' batches)."""

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
    import json, os, sys
    import numpy as np
    import torch
    from pf_trl.data.shards import load_shards
    from pf_trl.models import build_model
    from pf_trl.sampler import TokenBudgetBatchSampler
    from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer
    from pf_trl.data.tokenizer import load_tokenizer

    shards, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    ds = load_shards(shards)
    lengths = np.asarray(ds["length"])
    ds = ds.select(np.nonzero(lengths <= 200)[0][:32].tolist()).flatten_indices()
    rank = int(os.environ.get("RANK", 0))
    seen = []

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
                             learning_rate=1e-3, seed=0, max_steps=3, padding_free="internal", max_length=None,
                             use_cpu=True, max_tokens_per_batch=600, dataloader_num_workers=0,
                             gradient_accumulation_steps=2 if mode == "single" else 1)
    model = build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=0, **TINY)
    tr = T(model, args=args, train_dataset=ds, processing_class=load_tokenizer())
    tr.train()
    sampler = tr._pf_train_sampler
    res = {
        "rank": rank,
        "world": tr.args.world_size,
        "steps": tr.state.global_step,
        "losses": [h["loss"] for h in tr.state.log_history if "loss" in h],
        "micro_tokens": seen,
        "batches": [list(map(int, b)) for b in (list(sampler) if mode != "single" else [])][:3],
        "real_tokens": tr.state.log_history[-1]["train_real_tokens"],
    }
    with open(os.path.join(out, f"result_{mode}_{rank}.json"), "w") as f:
        json.dump(res, f)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in tr.model.state_dict().items()}, os.path.join(out, f"weights_{mode}.pt"))
    '''
)


def _env():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


@pytest.mark.slow
def test_torchrun_two_ranks_match_single_process(tmp_path, sample_shards):
    script = tmp_path / "dist_train.py"
    script.write_text(SCRIPT)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun not found"
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", "29533", str(script), str(sample_shards), str(tmp_path), "ddp"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    single = subprocess.run([sys.executable, str(script), str(sample_shards), str(tmp_path), "single"], env=_env(),
                            capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-4000:]

    r0, r1 = (json.loads((tmp_path / f"result_ddp_{r}.json").read_text()) for r in (0, 1))
    s = json.loads((tmp_path / "result_single_0.json").read_text())
    assert r0["world"] == r1["world"] == 2
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
    w_ddp = torch.load(tmp_path / "weights_ddp.pt")
    w_single = torch.load(tmp_path / "weights_single.pt")
    for name, value in w_single.items():
        torch.testing.assert_close(w_ddp[name], value, rtol=1e-4, atol=2e-5, msg=name)
