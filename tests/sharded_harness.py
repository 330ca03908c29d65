"""Trainings for tests/test_sharded.py: pf-trl under DDP, DeepSpeed ZeRO-2/3 and FSDP2, on CPU (gloo).

Run under ``torchrun --nproc_per_node 2`` (or one plain process for the ``single`` reference) with a JSON spec::

    python sharded_harness.py SPEC.json

``SPEC``: ``{"model": DIR, "models": {NAME: DIR}, "out": DIR, "zero3": FILE, "zero2": FILE, "jobs": [JOB, ...]}``,
each ``JOB`` ``{"name", "strategy", "padding_free", "optim", "ga", "steps", "save_steps", "resume_from", "fault",
"model", "eval", "lora"}`` (``model``: a name of ``models``, default ``model``; ``eval``: evaluate after training;
``lora``: LoRA adapters on q/v and the LM head) (or
``{"name", "cli": [ARGS]}``: ``pf-trl train ARGS``, the command's own order). The jobs run one after
the other in the same processes (one launch: the imports are paid once). Each writes ``OUT/NAME/result_RANK.json``
(losses, what is sharded, the metrics' parameter count) and, on rank 0, ``OUT/NAME/weights.pt`` (the full weights,
gathered from the shards).

Strategies:

- ``single``: one process, the batches of the two ranks of each step interleaved and accumulated (``ga`` x 2), so a
  step sees the same micro-batches as a two-rank step;
- ``ddp``: plain data parallel (accelerate's ``MULTI_CPU``);
- ``zero3``: DeepSpeed ZeRO-3 with the model loaded *after* the config (``zero.Init`` partitions it at load: the
  usual order, and the CLI's); ``zero3_preloaded``: the model loaded before the config (partitioned by
  ``deepspeed.initialize``); ``zero2``: ZeRO-2;
- ``fsdp2``: accelerate's FSDP2 plugin (``fully_shard`` per decoder layer, then the root; sharded state dict
  checkpoints). accelerate only routes FSDP on accelerator devices, so on CPU it would train plain DDP: this harness
  switches accelerate's state to FSDP after it is created (:func:`force_fsdp_on_cpu`), everything else is the Trainer's
  own FSDP2 path (``fsdp2_prepare_model``, ``save_fsdp_model`` / ``load_fsdp_model``).

Two settings are for CPU test machines only: DeepSpeed's shared-memory all-reduce op (used by its inference
all-reduce, never by training) is not built (it JIT-compiles for minutes on 2 cores), and the ZeRO-3 parameter
persistence threshold is 0 so that every parameter is partitioned, the norms included (the shipped config leaves it
to transformers' ``auto``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor

# CPU test machines: DeepSpeed's TorchBackend JIT-compiles a shared-memory op for inference all-reduce (minutes on two
# cores, once per machine); training never calls it. Leaving it unbuilt keeps every collective on gloo.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from pf_trl.batching.sampler import TokenBudgetBatchSampler  # noqa: E402
from pf_trl.data.tokenizer import load_tokenizer  # noqa: E402
from pf_trl.trainer import PaddingFreeConfig, PaddingFreeSFTTrainer  # noqa: E402

VOCAB = 128
BUDGET = 120
WORLD = 2
STEPS = 2  # optimizer steps of a job (tests/test_sharded.py sets them)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256)


def save_models(folder) -> dict[str, str]:
    """The models of the runs, saved once: ``llama`` (untied head) and ``gemma2`` (the LM head is the input
    embedding, one ZeRO-3 parameter used by two modules; soft-capped logits; sliding window)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    out = {}
    for name, model_cls, config in (
        ("llama", LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=False)),
        ("gemma2", Gemma2ForCausalLM, Gemma2Config(**TINY, head_dim=16, tie_word_embeddings=True, sliding_window=16)),
    ):
        torch.manual_seed(0)
        out[name] = os.path.join(str(folder), name)
        model_cls(config).save_pretrained(out[name])
    return out


def job(name: str, strategy: str, mode: str = "internal", optim: str = "sgd", **extra) -> dict:
    """A job of the spec: :data:`STEPS` optimizer steps, gradient accumulation 2 (per rank)."""
    return {"name": name, "strategy": strategy, "padding_free": mode, "optim": optim, "ga": 2, "steps": STEPS,
            **extra}


def dataset(n: int = 48, seed: int = 0) -> Dataset:
    """Tokenized rows with varied lengths and a prompt part without loss (every rank builds the same)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(5, 60, (1,), generator=g))
        ids = torch.randint(3, VOCAB, (length,), generator=g).tolist()
        cut = int(torch.randint(1, length - 1, (1,), generator=g))
        rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
    return Dataset.from_list(rows)


class Interleaved:
    """One process, the two ranks' batches of each micro-step in a row (GA x 2 then equals a two-rank step)."""

    def __init__(self, lengths: np.ndarray, seed: int) -> None:
        self.samplers = [TokenBudgetBatchSampler(lengths, BUDGET, seed=seed, num_replicas=WORLD, rank=r)
                         for r in range(WORLD)]
        self.max_tokens = BUDGET

    def __len__(self) -> int:
        return WORLD * len(self.samplers[0])

    def set_epoch(self, epoch: int) -> None:
        for s in self.samplers:
            s.set_epoch(epoch)

    def __iter__(self):
        for batches in zip(*self.samplers):
            yield from batches

    def state_dict(self):
        return self.samplers[0].state_dict()


def trainer_class(strategy: str, fault: str | None = None):
    class HarnessTrainer(PaddingFreeSFTTrainer):
        def _pf_divisor(self, num_items_in_batch, n_tok, device):
            divisor = super()._pf_divisor(num_items_in_batch, n_tok, device)
            if fault == "no_world_scale":  # negative control: forget that data parallelism averages the gradients
                divisor = divisor * self.accelerator.num_processes
            return divisor

        def _pf_sampler(self, dataset, budget, batch_size, *, shuffle):
            if strategy == "single" and shuffle:
                return Interleaved(np.asarray(dataset["length"] if "length" in dataset.column_names else
                                              [len(x) for x in dataset["input_ids"]]), self.args.seed)
            return super()._pf_sampler(dataset, budget, batch_size, shuffle=shuffle)

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            if strategy == "fsdp2":
                force_fsdp_on_cpu(self)

    return HarnessTrainer


def force_fsdp_on_cpu(trainer) -> None:
    """accelerate keeps ``MULTI_CPU`` on CPU even with an FSDP plugin; switch its state to FSDP2 (test machines)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    trainer.is_fsdp_enabled = True


def deepspeed_config(path: str, stage: int) -> dict:
    with open(path) as f:
        config = json.load(f)
    assert config["zero_optimization"]["stage"] == stage, path
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # every parameter partitioned
    return config


def run_job(spec: dict, job: dict) -> None:
    """One training; a job with ``fault`` ``no_gather`` / ``no_adopt`` (a fix of pf-trl switched off) records the
    error it raises instead (negative controls)."""
    if job.get("fault") in ("no_gather", "no_adopt"):
        return run_faulty_job(spec, job)
    strategy = job["strategy"]
    out = os.path.join(spec["out"], job["name"])
    rank = int(os.environ.get("RANK", 0))
    ga = int(job.get("ga", 2))
    extra: dict = {}
    if strategy in ("zero3", "zero3_preloaded"):
        extra["deepspeed"] = deepspeed_config(spec["zero3"], 3)
    elif strategy == "zero2":
        extra["deepspeed"] = deepspeed_config(spec["zero2"], 2)
    elif strategy == "fsdp2":
        extra["fsdp"] = True
        extra["fsdp_config"] = {"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
                                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}  # the model's _no_split_modules
    save_steps = job.get("save_steps")
    model = None
    model_dir = spec["models"][job["model"]] if job.get("model") else spec["model"]
    if strategy != "zero3":  # zero3: loaded after the config, so zero.Init partitions it at load
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = PaddingFreeConfig(
        output_dir=out, report_to=[], logging_steps=1, disable_tqdm=True, seed=0, max_steps=int(job["steps"]),
        padding_free=job["padding_free"], max_length=None, use_cpu=True, max_tokens_per_batch=BUDGET,
        dataloader_num_workers=0, gradient_accumulation_steps=ga * WORLD if strategy == "single" else ga,
        optim="sgd" if job["optim"] == "sgd" else "adamw_torch",
        learning_rate=0.05 if job["optim"] == "sgd" else 1e-3, lr_scheduler_type="constant", warmup_steps=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, save_only_model=False,
        **extra,
    )
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    partitioned_at_load = sum(1 for p in model.parameters() if hasattr(p, "ds_id") and p.numel() == 0)
    evalset = dataset(16, seed=1) if job.get("eval") else None
    peft_config = None
    if job.get("lora"):  # adapters on the attention projections and on the (ZeRO-3 partitioned) LM head
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"])
    trainer = trainer_class(strategy, job.get("fault"))(model, args=args, train_dataset=dataset(), eval_dataset=evalset,
                                                        processing_class=load_tokenizer(), peft_config=peft_config)
    flop_params = trainer.pf_metrics.flop_params[0]
    self_check = dict(getattr(model, "_pf_padding_free", {}).get("self_check") or {})
    result = trainer.train(resume_from_checkpoint=job.get("resume_from"))
    params = list(trainer.model.parameters())

    sharding = {
        "is_deepspeed_enabled": bool(trainer.is_deepspeed_enabled),
        "zero_stage": (trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None),
        "is_fsdp_enabled": bool(trainer.is_fsdp_enabled),
        "parameters": len(params),
        "partitioned_at_load": partitioned_at_load,
        "ds_partitioned": sum(1 for p in params if hasattr(p, "ds_tensor") and p.numel() == 0),
        "dtensor": sum(1 for p in params if isinstance(p, DTensor)),
        "dtensor_local_smaller": sum(1 for p in params if isinstance(p, DTensor)
                                     and p.to_local().numel() < p.numel()),
        "zero2_partitioned_optimizer": _zero2_partitioned(trainer),
    }
    from pf_trl.trainer.metrics import model_flop_params

    flop_params_sharded = model_flop_params(trainer.model)[0]  # counted on the trained, sharded model
    local_numel = int(sum(p.numel() if not isinstance(p, DTensor) else p.to_local().numel() for p in params))
    # after the sharding evidence: an evaluation leaves ZeRO-3 / FSDP2 parameters gathered for reuse
    eval_loss = trainer.evaluate()["eval_loss"] if evalset is not None else None
    weights = full_state_dict(trainer)

    res = {
        "rank": rank, "world": trainer.args.world_size, "steps": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": eval_loss,
        "self_check": self_check,
        "head_probe": trainer.pf_head_plan.probe,
        "flop_params": flop_params,
        "flop_params_sharded_model": flop_params_sharded,
        "local_numel": local_numel,
        "train_tflops": result.metrics.get("train_tflops"),
        "full_parameters": int(sum(v.numel() for v in weights.values())),
        **sharding,
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"result_{rank}.json"), "w") as f:
        json.dump(res, f)
    if rank == 0:
        torch.save(weights, os.path.join(out, "weights.pt"))
    del trainer, model, params, weights
    _reset_between_jobs()


def run_faulty_job(spec: dict, job: dict) -> None:
    import pf_trl.attention.enable as enable
    import pf_trl.parallel.checks as parallel

    out = os.path.join(spec["out"], job["name"])
    target, name = (enable, "gathered_forward") if job["fault"] == "no_gather" else \
        (parallel, "_adopt_process_group_for_deepspeed")
    original = getattr(target, name)
    setattr(target, name, contextlib.nullcontext if job["fault"] == "no_gather" else (lambda: None))
    try:
        run_job(spec, {**job, "fault": None})
        error = None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        setattr(target, name, original)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"result_{os.environ.get('RANK', 0)}.json"), "w") as f:
        json.dump({"error": error}, f)
    _reset_between_jobs()


def _zero2_partitioned(trainer) -> bool:
    """ZeRO-2 keeps whole parameters but partitions optimizer state and gradients: each rank's fp32 partition is a
    fraction of the model."""
    if not trainer.is_deepspeed_enabled or trainer.accelerator.state.deepspeed_plugin.zero_stage != 2:
        return False
    opt = trainer.model_wrapped.optimizer
    local = sum(t.numel() for t in opt.single_partition_of_fp32_groups)
    return local < sum(p.numel() for p in trainer.model.parameters())


def full_state_dict(trainer) -> dict[str, torch.Tensor]:
    """The whole model, fp32, on every rank: ZeRO-3 partitions gathered, FSDP2 DTensors made full."""
    model = trainer.model
    if trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {n: p.detach().clone().float() for n, p in model.named_parameters()}
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().float()
            for n, p in model.named_parameters()}


def _reset_between_jobs() -> None:
    """The next job starts from a clean slate: no DeepSpeed config left registered for ``from_pretrained``, no
    accelerate state (the process group stays)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set by accelerate's Accelerator for a DeepSpeed plugin
    AcceleratorState._reset_state(reset_partial_state=True)
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def run_cli_job(spec: dict, job: dict) -> None:
    """``pf-trl train ARGS`` as the command runs it (config parsed, then the model built); before any other
    DeepSpeed job when it comes first in the spec, so in a process where DeepSpeed is not set up yet."""
    from pf_trl.cli.main import main as pf_trl_main

    rc = pf_trl_main(["train", *job["cli"]])
    if rc != 0:
        os._exit(rc)  # no teardown barrier: the other rank may be inside a collective this one never joins
    out = os.path.join(spec["out"], job["name"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"result_{os.environ.get('RANK', 0)}.json"), "w") as f:
        json.dump({"rc": rc}, f)
    _reset_between_jobs()


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for job in spec["jobs"]:
        (run_cli_job if "cli" in job else run_job)(spec, job)
    if torch.distributed.is_initialized():  # both ranks' results are on disk once both pass this barrier
        torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    main()
    # leave without gloo's C++ teardown, whose threads abort a process now and then on a loaded machine
    # (tests/test_distributed.py says the same)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
