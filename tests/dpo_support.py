"""What the DPO parity tests and ``benchmarks/dpo_throughput.py`` both build: tiny models, preference rows, TRL's
``DPOTrainer`` beside ``PaddingFreeDPOTrainer`` from the same config fields, and the comparison of one step."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import torch
from transformers import TrainerCallback

TINY = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
WORDS = ("the a cat dog runs sleeps quickly blue green red house tree over under with and because never always one "
         "two three small large river stone light dark").split()
# loss and metrics: float32 rounding of sums over ~100 tokens; gradients: relative to each tensor's largest entry
RTOL, ATOL, GRAD_RTOL = 2e-5, 2e-6, 1e-4


def model(arch: str = "llama", seed: int = 0):
    from pf_trl.models import build_model

    if arch == "llama":
        return build_model("pf-trl/tiny-llama", attn_implementation="sdpa", seed=seed, **TINY)
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, vocab_size=32000, max_position_embeddings=512, **TINY)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).float()


def pairs(n: int, *, seed: int = 0, long: int = 20) -> list[dict]:
    rng = random.Random(seed)

    def text(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [dict(prompt=text(rng.randint(3, 12)), chosen=text(rng.randint(2, long)),
                 rejected=text(rng.randint(2, long))) for _ in range(n)]


def fields(tmp_path, **kw) -> dict:
    base = dict(output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
                dataloader_num_workers=0, disable_tqdm=True, logging_steps=1, learning_rate=1e-3)
    base.update(kw)
    return base


_TOKENIZER = []


def tokenizer():
    """The shipped tokenizer, loaded once per process (about 0.5 s of CPU a load). The trainers share it: the only
    change TRL makes to it, pad = EOS when it has no pad token, is the same for every trainer here."""
    if not _TOKENIZER:
        from pf_trl.data.tokenizer import load_tokenizer

        _TOKENIZER.append(load_tokenizer())
    return _TOKENIZER[0]


def trainer(cls, rows, tmp_path, *, arch="llama", ref=True, eval_rows=None, peft_config=None, model_obj=None, **kw):
    """``cls`` (TRL's DPOTrainer or PaddingFreeDPOTrainer) on ``rows``, with a DPOConfig of ``fields``; ``ref``: a
    separate reference model (seed 1) or TRL's default (None)."""
    from trl import DPOConfig

    from pf_trl.trainer.dpo_config import PaddingFreeDPOConfig

    pf_keys = {"max_tokens_per_batch", "padding_free_mode", "attention_backend", "lm_head_kernel"}
    config_cls = PaddingFreeDPOConfig if pf_keys & set(kw) else DPOConfig
    args = config_cls(**fields(tmp_path / cls.__name__, **kw))
    return cls(model_obj if model_obj is not None else model(arch), ref_model=model(arch, seed=1) if ref else None,
               args=args, train_dataset=datasets.Dataset.from_list(rows),
               eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
               processing_class=tokenizer(), peft_config=peft_config)


def one_step(t, indices, *, mutate=None, backward=True):
    """Loss, metrics and gradients (``backward``) of one micro-batch of ``indices`` (TRL's order) through
    ``compute_loss``."""
    batch = t.data_collator([t.train_dataset[i] for i in indices])
    if mutate is not None:
        mutate(batch)
    t.model.train()
    t.model.zero_grad()
    for values in t._metrics["train"].values():
        values.clear()
    t._total_train_tokens = 0  # TRL's num_tokens counts on from earlier steps
    with torch.set_grad_enabled(backward):
        loss = t.compute_loss(t.model, batch)
    if backward:
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in t._metrics["train"].items() if v}
    return float(loss.detach()), metrics, grads


def differences(a, b) -> list[str]:
    """What differs between two ``one_step`` results beyond float32 rounding (empty: equal)."""
    (la, ma, ga), (lb, mb, gb) = a, b
    bad = []
    if abs(la - lb) > ATOL + RTOL * abs(la):
        bad.append(f"loss {la} != {lb}")
    for key in sorted(set(ma) | set(mb)):
        x, y = ma.get(key), mb.get(key)
        if x is None or y is None or abs(x - y) > ATOL + RTOL * abs(x):
            bad.append(f"{key} {x} != {y}")
    if set(ga) != set(gb):
        bad.append(f"gradient names differ: {sorted(set(ga) ^ set(gb))}")
    for name in ga.keys() & gb.keys():
        scale = float(ga[name].abs().max())
        if float((ga[name] - gb[name]).abs().max()) > GRAD_RTOL * scale + 1e-9:
            bad.append(f"grad {name}")
    return bad


# ------------------------------------------------------------------------------------------- logged metrics

LOGGED = ("loss", "grad_norm", "entropy", "num_tokens", "mean_token_accuracy")
_TIMES = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


def logged(history: list[dict]) -> list[dict]:
    """TRL's logged values of a ``log_history`` (loss, grad norm and every DPO metric, train and eval)."""
    return [{k: v for k, v in h.items() if k in LOGGED or k.startswith(("rewards/", "logps/", "logits/", "eval_"))}
            for h in history]


def compare_logs(a: list[dict], b: list[dict], rtol: float = 1e-4) -> list[str]:
    """What differs between two :func:`logged` histories beyond float32 rounding (timings aside)."""
    bad = []
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in x:
            if key in _TIMES or key.startswith("eval_") and key.endswith(("per_second", "_tokens")):
                continue
            if key not in y or abs(x[key] - y[key]) > 1e-5 + rtol * abs(x[key]):
                bad.append(f"step {step} {key}: {x[key]} vs {y.get(key)}")
    return bad


# ------------------------------------------------------------------------------------------- recorded runs


def chosen_sequences(inputs: dict) -> list[list[int]]:
    """The prompt+chosen token ids of each pair of a collated batch (its first half of rows): a pair's identity."""
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    half = ids.shape[0] // 2
    return [ids[i][mask[i].bool()].tolist() for i in range(half)]


def recording(cls):
    """``cls`` (a DPO trainer class) that records the pairs of every training micro-batch in ``pf_seen`` and the
    gradient of its first optimizer step (after the ranks' reduction) in ``pf_grad``."""

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pf_seen: list[list[list[int]]] = []
            self.pf_grad: dict[str, torch.Tensor] = {}
            self.add_callback(_FirstGradient(self))

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.model.training:
                self.pf_seen.append(chosen_sequences(inputs))
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    Recording.__name__ = cls.__name__
    return Recording


class _FirstGradient(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.trainer.pf_grad:
            self.trainer.pf_grad.update({n: p.grad.detach().clone()
                                         for n, p in self.trainer.model.named_parameters() if p.grad is not None})


def run_job(job: dict, out: str) -> dict:
    """One recorded training (``job``: ``name``, ``trainer`` ``"pf"`` / ``"trl"``, ``rows`` ``[n, seed]``,
    ``unweighted`` (pf under a budget: each micro-batch's plain mean, the control of the pair weighting), and
    :func:`fields` keywords under ``kw``). Returns the logged history, the pairs of every micro-batch, the budget
    sampler's batches and the rank; the first step's gradient is under ``grad``."""
    import torch.distributed as dist
    from trl import DPOTrainer

    from pf_trl.trainer.dpo_trainer import PaddingFreeDPOTrainer

    cls = recording(PaddingFreeDPOTrainer if job["trainer"] == "pf" else DPOTrainer)
    n, seed = job["rows"]
    t = trainer(cls, pairs(n, seed=seed), Path(out) / job["name"], **job["kw"])
    if job.get("unweighted"):
        t.loss_is_scaled_for_ga = False
        t._get_num_items_in_batch = lambda batch_samples, device: None
    t.train()
    sampler = getattr(t, "_pf_train_sampler", None)
    if sampler is not None:
        sampler.set_epoch(0)
    return {"name": job["name"], "rank": dist.get_rank() if dist.is_initialized() else 0,
            "world": t.args.world_size, "history": logged(t.state.log_history), "seen": t.pf_seen,
            "batches": [list(map(int, b)) for b in sampler] if sampler is not None else [], "grad": t.pf_grad,
            "weights": {k: v.detach().clone() for k, v in t.model.state_dict().items()}}


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``pf-trl ARGV`` in this process: (exit status, stdout, stderr)."""
    from pf_trl.cli.main import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_same_trained_weights(pf_dir: Path, trl_dir: Path, start_dir: str) -> None:
    """The model pf-trl's command saved equals the one TRL's script saved (float32 rounding), and training moved
    the weights away from ``start_dir``'s (so the agreement is not the starting point's)."""
    from safetensors.torch import load_file

    pf, trl = load_file(Path(pf_dir) / "model.safetensors"), load_file(Path(trl_dir) / "model.safetensors")
    start = load_file(f"{start_dir}/model.safetensors")
    assert pf.keys() == trl.keys()
    for name in trl:
        torch.testing.assert_close(pf[name], trl[name], rtol=1e-4, atol=2e-6, msg=name)
    assert any(not torch.allclose(start[n], trl[n]) for n in trl)
