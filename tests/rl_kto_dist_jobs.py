"""Two-rank GRPO (RLOO) and KTO trainings that tests/dpo_dist_harness.py runs beside the DPO ones in its torchrun
launch (``torchrun --nproc_per_node 2``, gloo, CPU), for tests/test_dpo_distributed.py.

A ``JOB`` (:func:`run_job`) is ``{"name", "kind"}`` plus:

- ``kind="rl"``: ``loss_type`` (a GRPO loss type, or ``"rloo"``: RLOO), ``budget`` (``max_tokens_per_forward`` or
  ``None``) and ``control``, the negative control's piece weights: ``None`` (the real ones), a loss type (its
  weights) or ``"local"`` (``dapo``'s pieces normalised by their rank's own completion tokens). PaddingFreeGRPOTrainer
  (PaddingFreeRLOOTrainer) trains one step (plain SGD) on a tiny Llama whose policy differs from its reference model
  (the KL term and the loss are not zero);
- ``kind="kto"``: ``trainer`` (``"trl"`` or ``"pf"``) and ``precompute`` (``precompute_ref_log_probs``): TRL's
  KTOTrainer or PaddingFreeKTOTrainer trains two steps on tests/test_kto_trainer.py's rows and reference model.

- ``kind="precompute_refusal"``: PaddingFreeKTOTrainer and PaddingFreeDPOTrainer built with
  ``precompute_ref_log_probs=True`` on an in-memory dataset: each one-line refusal (nothing trained).

Each returns the logged history, the gradient of the first optimizer step after the ranks' reduction, and what the
job's checks need (RL: each training micro-batch's completions and its number of packed forwards after the ranks
agreed; KTO: each rank's own KL estimate of each step, before TRL gathers it).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import TrainerCallback

# the step's prompts: 2 per rank, of different lengths (the ranks hold different numbers of completion tokens)
PROMPTS = 4
EOS_BIAS = 9.0


class _FirstGradient(TrainerCallback):
    """The gradient of the first optimizer step (DDP has reduced it over the ranks), into ``grads``."""

    def __init__(self, model, grads: dict):
        self.model, self.grads = model, grads

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.grads:
            self.grads.update({n: p.grad.detach().clone() for n, p in self.model.named_parameters()
                               if p.grad is not None})


def rl_job(job: dict, folder: str, out: Path) -> dict:
    from transformers import AutoModelForCausalLM

    from pf_trl.trainer.rl import mixin
    from pf_trl.trainer.rl.budget import piece_weight
    from tests import rl_support as R

    extra = {} if job["budget"] is None else {"max_tokens_per_forward": job["budget"]}
    if job["loss_type"] == "rloo":
        from pf_trl.trainer.rl import PaddingFreeRLOOConfig as config_cls
        from pf_trl.trainer.rl import PaddingFreeRLOOTrainer as cls
    else:
        from pf_trl.trainer.rl import PaddingFreeGRPOConfig as config_cls
        from pf_trl.trainer.rl import PaddingFreeGRPOTrainer as cls

        extra["loss_type"] = job["loss_type"]
    # EOS made likely in generation (the tiny model's own chance is ~1/32000 a token): completions of several lengths,
    # so that the ranks hold different numbers of completion tokens
    eos_bias = {"sequence_bias": [[[R.tokenizer(folder).eos_token_id], EOS_BIAS]]}
    args = config_cls(**R.config_fields(out, max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=1e9,
                                        generation_kwargs=eos_bias, **extra))
    # the policy's head scaled: it differs from the reference TRL loads from ``folder`` (a zero KL and group-centred
    # advantages would make GRPO's loss zero but for rounding)
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        policy.lm_head.weight.mul_(1.5)
    t = cls(model=policy, reward_funcs=R.reward_length, args=args, train_dataset=R.prompts(PROMPTS, seed=3),
            processing_class=R.tokenizer(folder))
    grads: dict = {}
    t.add_callback(_FirstGradient(t.model, grads))
    seen, plans = [], []
    compute_loss, plan = t.compute_loss, t._pf_plan

    def recorded_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if t.model.training:
            seen.append({"completion_ids": inputs["completion_ids"].clone(),
                         "completion_mask": inputs["completion_mask"].clone(),
                         "num_items_in_batch": float(inputs.get("num_items_in_batch", -1))})
        return compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def recorded_plan(inputs, budget):
        forwards = plan(inputs, budget)
        plans.append(1 if forwards is None else len(forwards))
        return forwards

    t.compute_loss, t._pf_plan = recorded_loss, recorded_plan
    real = mixin.piece_weight
    if job["control"] == "local":  # a piece's dapo sum over the rank's own tokens instead of the ranks' mean count
        world = t.accelerator.num_processes
        mixin.piece_weight = lambda loss_type, inputs, piece: (
            float(inputs["num_items_in_batch"]) / world / float(inputs["completion_mask"].sum()))
    elif job["control"] is not None:  # the pieces weighted by another loss type's normaliser
        mixin.piece_weight = lambda loss_type, inputs, piece: piece_weight(job["control"], inputs, piece)
    try:
        t.train()
    finally:
        mixin.piece_weight = real
    return {"history": R.logged(t.state.log_history), "grad": grads, "seen": seen, "plans": plans,
            "world": t.args.world_size}


def kto_job(job: dict, out: Path, rows: str) -> dict:
    """``rows``: tests/test_kto_trainer.py's rows as a JSONL file both ranks load (a dataset with cache files in the
    shared datasets cache: TRL's reference precompute writes its column there on rank 0 and every rank reads it; an
    in-memory dataset's cache folder is a temporary folder of each process)."""
    import datasets
    from trl import KTOConfig, KTOTrainer

    from pf_trl.trainer.preference import PaddingFreeKTOTrainer
    from tests import dpo_support as D
    from tests.test_kto_trainer import reference_model

    cls = PaddingFreeKTOTrainer if job["trainer"] == "pf" else KTOTrainer
    args = KTOConfig(**D.fields(out, per_device_train_batch_size=2, max_steps=2,
                                precompute_ref_log_probs=bool(job.get("precompute"))))
    train = datasets.load_dataset("json", data_files=rows, split="train")
    t = cls(D.model(), ref_model=reference_model(), args=args, train_dataset=train, processing_class=D.tokenizer())
    grads: dict = {}
    t.add_callback(_FirstGradient(t.model, grads))
    kl_logps = []  # TRL scores each batch's KL completions on the policy, then on the reference
    compute = t._compute_kl_logps

    def recorded(model, batch):
        value = compute(model, batch)
        kl_logps.append(value.detach().clone())
        return value

    t._compute_kl_logps = recorded
    t.train()
    # each step's policy and reference KL scores in turn (precomputed: the reference's come from the dataset)
    local_kl = [] if job.get("precompute") else [float((kl_logps[i] - kl_logps[i + 1]).mean())
                                                 for i in range(0, len(kl_logps), 2)]
    return {"history": [{k: v for k, v in h.items() if not k.endswith(("runtime", "per_second", "tflops"))
                         and not k.startswith("train_")} for h in t.state.log_history],
            "grad": grads, "local_kl": local_kl, "world": t.args.world_size}


def precompute_refusal_job(out: Path) -> dict:
    import datasets
    from trl import DPOConfig, KTOConfig

    from pf_trl.errors import ConfigError
    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer
    from pf_trl.trainer.preference import PaddingFreeKTOTrainer
    from tests import dpo_support as D
    from tests.test_kto_trainer import ROWS

    refused = {}
    for name, cls, config, rows in (("kto", PaddingFreeKTOTrainer, KTOConfig, ROWS),
                                    ("dpo", PaddingFreeDPOTrainer, DPOConfig, D.pairs(4))):
        args = config(**D.fields(out / name, precompute_ref_log_probs=True))
        try:
            cls(D.model(), args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=D.tokenizer())
        except ConfigError as exc:
            refused[name] = str(exc)
    return {"refused": refused, "world": int(DPOConfig(**D.fields(out)).world_size)}


def run_job(job: dict, spec: dict) -> dict:
    """``job`` (see the module docstring) in this process; ``spec``'s ``out`` holds its folder, ``folder`` the tiny
    model the RL jobs load, ``kto_rows`` the KTO jobs' rows."""
    import torch.distributed as dist

    out = Path(spec["out"]) / job["name"]
    if job["kind"] == "precompute_refusal":
        result = precompute_refusal_job(out)
    else:
        result = rl_job(job, spec["folder"], out) if job["kind"] == "rl" else kto_job(job, out, spec["kto_rows"])
    return dict(result, name=job["name"], rank=dist.get_rank() if dist.is_initialized() else 0)
