"""PaddingFreeGRPOTrainer / PaddingFreeRLOOTrainer against TRL's trainers, an unpadded one-sequence-per-row reference,
and the shared-prefix attention rule, each with a negative control.

Tolerance: float32 rounding. The packed and padded forwards run the same ops on differently shaped tensors (matmul
blocking, softmax over other key counts), so values agree to rounding, not bitwise: relative 1e-5 on logged metrics
(means over ~100 tokens), 2e-5 relative to the largest entry on per-token values and gradients. The negative controls
differ by 1e-2 or more."""

from __future__ import annotations

import pytest
import torch

from tests import rl_support as S

# every test here takes over 3 s or reads the module's trained runs (about 15-30 s to build)
pytestmark = pytest.mark.slow

LOGP_RTOL = 2e-5


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = LOGP_RTOL) -> bool:
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-6)
    return float((a - b).abs().max()) <= rtol * scale


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(a.abs().max()), 1e-6)


# ------------------------------------------------------------------------------------------ the attention rule


def test_shared_prefix_attention_equals_separate_rows():
    """A prompt held once and G completions seeing it: the outputs and gradients of G separate causal rows (GQA,
    a sliding window that crosses into the prompt), with the completions' queries bottom-right aligned (GPU kernels)
    and laid out after copies of the prompt's queries (the CPU path)."""
    from pf_trl.attention.backends.sdpa import forward as sdpa_forward
    from pf_trl.attention.shared_prefix import attend, shared_prefix_layout

    torch.manual_seed(0)
    p, cs, hq, hkv, d = 7, (3, 5, 1), 4, 2, 8
    total = p + sum(cs)
    q, k, v = (torch.randn(total, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    layout = shared_prefix_layout([p, *cs], [-1, 0, 0, 0])
    for window, copy_queries in ((None, True), (None, False), (4, True), (4, False)):
        out = attend(q, k, v, layout, causal=True, sliding_window=window, copy_queries=copy_queries)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        # reference: each completion in its own row [prompt, completion], the prompt repeated
        rows, offsets = [], []
        start = p
        for c in cs:
            rows.append(torch.cat([torch.arange(p), torch.arange(start, start + c)]))
            offsets.append(start)
            start += c
        index = torch.cat(rows)
        lengths = [p + c for c in cs]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        left = -1 if window is None else window - 1
        ref = sdpa_forward(q[index], k[index], v[index], cu, cu, max(lengths), max(lengths), causal=True,
                           scale=d ** -0.5, window=(left, 0), softcap=0.0, dropout_p=0.0)
        # the prompt's rows of the first copy, then each completion's own rows
        keep = torch.cat([torch.arange(p)] + [torch.arange(int(cu[i]) + p, int(cu[i + 1])) for i in range(len(cs))])
        assert torch.allclose(out, ref[keep], atol=1e-12)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        # the G copies of the prompt all carry the prompt's weight in the reference's loss only once
        ref_weights = torch.zeros_like(ref)
        ref_weights[keep] = weights
        (ref * ref_weights).sum().backward()
        for got, x in zip(grads, (q, k, v)):
            assert torch.allclose(got, x.grad, atol=1e-12)
            x.grad = None
    # negative control: completions that do not see the prompt
    alone = shared_prefix_layout([p, *cs], [-1, -1, -1, -1])
    assert _gap(attend(q, k, v, alone, causal=True), attend(q, k, v, layout, causal=True)) > 1e-2


def test_shared_prefix_refusals():
    from pf_trl.attention.shared_prefix import shared_prefix_layout, shared_prefix_refusal
    from pf_trl.errors import PackingError
    from pf_trl.models import build_model

    hybrid = build_model("pf-trl/tiny-qwen3.5", hidden_size=64, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                         num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=1000)
    assert "carry state along the row" in shared_prefix_refusal(hybrid)
    plain = build_model("pf-trl/tiny-llama", **S.TINY)
    assert "mode='internal'" in shared_prefix_refusal(plain)
    with pytest.raises(PackingError, match="prefix"):
        shared_prefix_layout([3, 2, 2], [-1, 0, 1])


# ------------------------------------------------------------------------------------------ trainers vs TRL


@pytest.fixture(scope="module", autouse=True)
def _gc_frozen():
    with S.gc_frozen():
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return S.model_folder(tmp_path_factory.mktemp("rl-model"))


# a token budget that holds one group (a 13-token prompt once, two completions of up to 8) but not two (at least
# 2 x (13 + 2)): every training micro-batch of 4 sequences (2 groups) runs as 2 packed forwards, each no-grad
# scoring chunk too
GROUP_BUDGET = 29
# RLOO without shared prefixes: one sequence (13 + up to 8 tokens) per forward
SEQUENCE_BUDGET = 23


@pytest.fixture(scope="module")
def grpo_runs(folder, tmp_path_factory):
    """TRL's GRPOTrainer and pf-trl's (shared prefixes, the default, and a token budget that splits every micro-batch),
    two steps each on prompts of equal length (TRL's left padding then shifts no position): a reference model
    (beta > 0) and num_iterations=2 (old-policy log-probabilities), gradient checkpointing on (GRPOConfig's default).
    Plain SGD, so that the parameters after the steps compare the gradients (Adam's normalisation turns the rounding
    of a near-zero gradient into a full step). The path without shared prefixes runs in the RLOO test."""
    from trl import GRPOConfig, GRPOTrainer

    from pf_trl.trainer.rl import PaddingFreeGRPOConfig, PaddingFreeGRPOTrainer

    tmp = tmp_path_factory.mktemp("grpo")
    data = S.prompts(4, equal=True)
    runs = {}
    for name, cls, config_cls, extra in (("trl", GRPOTrainer, GRPOConfig, {}),
                                         ("pf", PaddingFreeGRPOTrainer, PaddingFreeGRPOConfig,
                                          {"max_tokens_per_forward": GROUP_BUDGET})):
        t = S.trainer(cls, config_cls, folder, data, tmp / name, num_iterations=2, optim="sgd", learning_rate=1.0,
                      **extra)
        calls = _record_scoring_forwards(t)
        t.train()
        runs[name] = (t, S.logged(t.state.log_history), S.parameters(t), calls)
    return runs


def _record_scoring_forwards(t) -> list[dict]:
    """What the policy's and the reference's backbones are given outside generation (rows, attention mask, layout)."""
    calls, generating = [], []

    def record(module, args, kwargs):
        if not generating:
            ids = kwargs.get("input_ids", args[0] if args else None)
            calls.append(dict(rows=int(ids.shape[0]), tokens=int(ids.shape[1]), grad=torch.is_grad_enabled(),
                              mask=kwargs.get("attention_mask") is not None,
                              segments=kwargs.get("cu_seq_lens_q") is not None,
                              shared="pf_shared_prefix" in kwargs))

    for model in (t.model, t.ref_model):
        if model is not None:  # (a LoRA policy's reference is the policy with its adapter disabled)
            model.base_model.register_forward_pre_hook(record, with_kwargs=True)
    generate = t._generate

    def tracked(prompts):
        generating.append(True)
        try:
            return generate(prompts)
        finally:
            generating.pop()

    t._generate = tracked
    return calls


def test_grpo_matches_trl_on_equal_prompts(grpo_runs):
    """Every logged metric and the parameters after two steps, with shared prefixes and each micro-batch split into
    packed forwards under a token budget."""
    _, trl_logs, trl_params, trl_calls = grpo_runs["trl"]
    pf_trainer, logs, params, calls = grpo_runs["pf"]
    assert pf_trainer.pf_shared_prefix and pf_trainer.pf_max_tokens == GROUP_BUDGET
    assert trl_logs[1]["kl"] > 0 and trl_logs[0]["grad_norm"] > 0  # the reference and the gradients are exercised
    assert trl_logs[1]["clip_ratio/region_mean"] > 0  # the old policy differs from the policy at the second step
    # every scoring forward of pf-trl's backbones is one packed row (TRL's: the padded batch, with its mask)
    assert trl_calls and all(c["rows"] == 4 and c["mask"] for c in trl_calls)
    assert calls and all(c["rows"] == 1 and not c["mask"] and c["segments"] and c["shared"] for c in calls)
    # under the budget: each forward holds one group of two completions, so twice TRL's forwards, training ones too
    assert all(c["tokens"] <= GROUP_BUDGET for c in calls)
    assert len(calls) == 2 * len(trl_calls)
    assert sum(c["grad"] for c in calls) == 2 * sum(c["grad"] for c in trl_calls) > 0
    assert S.compare_logs(trl_logs, logs) == []
    for key, value in trl_params.items():
        assert _close(value, params[key], 1e-5), key


def test_rloo_matches_trl_on_equal_prompts(folder, tmp_path):
    """RLOO without shared prefixes (every sequence with its prompt: pf-trl's plain packed row), each micro-batch
    split into one forward per sequence by the token budget; two accumulated micro-batches (RLOO leaves the division
    by the accumulation steps to the Trainer, which the forwards backpropagated early must then get too)."""
    from trl import RLOOConfig, RLOOTrainer

    from pf_trl.trainer.rl import PaddingFreeRLOOConfig, PaddingFreeRLOOTrainer

    data = S.prompts(4, equal=True)
    logs = []
    for cls, config_cls, extra in ((RLOOTrainer, RLOOConfig, {}),
                                   (PaddingFreeRLOOTrainer, PaddingFreeRLOOConfig,
                                    {"shared_prefix": "off", "max_tokens_per_forward": SEQUENCE_BUDGET})):
        t = S.trainer(cls, config_cls, folder, data, tmp_path / cls.__name__, max_steps=1, beta=0.05,
                      gradient_accumulation_steps=2, **extra)
        calls = _record_scoring_forwards(t)
        t.train()
        logs.append(S.logged(t.state.log_history))
    assert not t.pf_shared_prefix
    assert calls and all(c["rows"] == 1 and not c["shared"] and c["tokens"] <= SEQUENCE_BUDGET for c in calls)
    assert sum(c["grad"] for c in calls) == 8  # the 2 training micro-batches: one forward per sequence
    assert logs[0][0]["grad_norm"] > 0
    assert S.compare_logs(*logs) == []


def test_grpo_with_lora_matches_trl(folder, tmp_path):
    """A LoRA policy (TRL's peft_config path) whose reference is the same model with its adapter disabled (beta > 0,
    no reference model loaded): two steps, every logged metric and the trained adapter as TRL's. LoRA dropout 0: its
    masks are drawn over each forward's shape, so a packed row and a padded batch draw different ones."""
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from pf_trl.trainer.rl import PaddingFreeGRPOConfig, PaddingFreeGRPOTrainer

    data = S.prompts(4, equal=True)
    runs = {}
    for name, cls, config_cls in (("trl", GRPOTrainer, GRPOConfig), ("pf", PaddingFreeGRPOTrainer,
                                                                       PaddingFreeGRPOConfig)):
        args = config_cls(**S.config_fields(tmp_path / name, optim="sgd", learning_rate=1.0))
        t = cls(model=folder, reward_funcs=S.reward_length, args=args, train_dataset=data,
                processing_class=S.tokenizer(folder),
                peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM"))
        calls = _record_scoring_forwards(t)
        t.train()
        runs[name] = (S.logged(t.state.log_history), {n: p for n, p in S.parameters(t).items() if "lora_" in n})
    (trl_logs, trl_lora), (logs, lora) = runs["trl"], runs["pf"]
    # pf-trl's scoring forwards (policy, old policy, the adapter-disabled reference) are packed rows, shared prefixes
    assert calls and all(c["rows"] == 1 and not c["mask"] and c["shared"] for c in calls)
    # the adapter moved at step 1, so step 2's reference (the adapter disabled) differs from the policy
    assert trl_logs[1]["kl"] > 0 and trl_logs[0]["grad_norm"] > 0
    assert S.compare_logs(trl_logs, logs) == []
    assert trl_lora and trl_lora.keys() == lora.keys()
    for key, value in trl_lora.items():
        assert _close(value, lora[key], 1e-5), key


# ------------------------------------------------------------------------------- prompts of different lengths


def _ragged_batch(tokenizer_pad: int):
    """TRL's layout of 3 prompts (2, 5 and 9 tokens) x 2 completions (0 to 6 tokens; 0: a completion TRL masked
    whole, as ``mask_truncated_completions`` does): left-padded prompts, right-padded completions."""
    g = torch.Generator().manual_seed(0)
    prompt_lengths, completion_lengths = (2, 5, 9), ((3, 6), (1, 4), (5, 0))
    P, C = max(prompt_lengths), 6
    ids, mask = [], []
    for p, cs in zip(prompt_lengths, completion_lengths):
        prompt = torch.randint(100, 30000, (p,), generator=g)
        for c in cs:
            completion = torch.randint(100, 30000, (c,), generator=g)
            row = torch.full((P + C,), tokenizer_pad)
            row[P - p:P] = prompt
            row[P:P + c] = completion
            ids.append(row)
            mask.append(((torch.arange(P + C) >= P - p) & (torch.arange(P + C) < P + c)).long())
    return torch.stack(ids), torch.stack(mask), C


@pytest.fixture(scope="module")
def ragged(grpo_runs):
    trl_trainer, pf_trainer = grpo_runs["trl"][0], grpo_runs["pf"][0]
    ids, mask, width = _ragged_batch(trl_trainer.processing_class.pad_token_id)
    # the same weights in both models (each trainer stepped its own copy identically; copy to be exact)
    pf_trainer.model.load_state_dict(trl_trainer.model.state_dict())
    pf_trainer.pf_max_tokens = None  # one packed row per batch here; the budget has its own tests below
    yield trl_trainer, pf_trainer, ids, mask, width
    pf_trainer.pf_max_tokens = GROUP_BUDGET


def _unpadded_reference(trl_trainer, ids, mask, width):
    """TRL's own forward on each sequence alone, without padding: positions from 0, as generation gave them."""
    from trl import GRPOTrainer

    rows = []
    for i in range(ids.shape[0]):
        seq = ids[i][mask[i].bool()]
        c = int(mask[i, ids.shape[1] - width:].sum())
        if c == 0:  # nothing scored: zeros, as TRL's head leaves unscored positions
            rows.append((torch.zeros(width), torch.zeros(width)))
            continue
        logps, ent, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trl_trainer, trl_trainer.model, seq[None], torch.ones_like(seq)[None], c, compute_entropy=True)
        rows.append((torch.nn.functional.pad(logps[0], (0, width - c)),
                     torch.nn.functional.pad(ent[0], (0, width - c))))
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def test_ragged_batch_matches_unpadded_reference(ragged):
    trl_trainer, pf_trainer, ids, mask, width = ragged
    pf_trainer.model.eval()
    trl_trainer.model.eval()
    with torch.no_grad():
        ref_logps, ref_ent = _unpadded_reference(trl_trainer, ids, mask, width)
        for shared in (True, False):
            pf_trainer.pf_shared_prefix = shared
            logps, ent, _ = pf_trainer._get_per_token_logps_and_entropies(pf_trainer.model, ids, mask, width,
                                                                          compute_entropy=True)
            assert _close(logps, ref_logps) and _close(ent, ref_ent), shared
            assert bool((logps[mask[:, -width:] == 0] == 0).all())  # unscored positions: zero, as TRL's head
    pf_trainer.pf_shared_prefix = True


def test_ragged_batch_gradients_match_unpadded_reference(ragged):
    """Gradients through the shared prompt are the sum over its group, as the G copies give."""
    trl_trainer, pf_trainer, ids, mask, width = ragged
    weights = torch.linspace(0.5, 1.5, ids.shape[0] * width).view(ids.shape[0], width)

    def grads(fn, model):
        model.zero_grad()
        (fn() * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(lambda: _unpadded_reference(trl_trainer, ids, mask, width)[0], trl_trainer.model)
    for shared in (True, False):
        pf_trainer.pf_shared_prefix = shared
        got = grads(lambda: pf_trainer._get_per_token_logps_and_entropies(pf_trainer.model, ids, mask, width)[0],
                    pf_trainer.model)
        assert ref.keys() == got.keys()
        for name in ref:
            assert _close(ref[name], got[name], 1e-4), (shared, name)
    pf_trainer.pf_shared_prefix = True


def test_negative_controls_differ(ragged):
    """Without isolation, with completion positions restarting at 0 instead of continuing from the prompt, or with
    completions that do not see their prompt, the values are far from the reference. (Positions running on across
    isolated sequences shift each sequence by a constant, which rotary embeddings do not see.)"""
    from pf_trl.trainer.rl.forward import packed_chunk, unwrapped_model
    from pf_trl.trainer.rl.layout import rl_packed_layout

    trl_trainer, pf_trainer, ids, mask, width = ragged
    model = pf_trainer.model
    model.eval()
    with torch.no_grad():
        ref, _ = _unpadded_reference(trl_trainer, ids, mask, width)

        def run(layout):
            return packed_chunk(model, unwrapped_model(model), layout, ids.device, False)[0]

        plain = rl_packed_layout(ids, mask, width, shared_prefix=False)
        total = plain["input_ids"].shape[1]
        one = torch.tensor([0, total], dtype=torch.int32)
        leaky = {**plain, "cu_seq_lens_q": one, "cu_seq_lens_k": one, "max_length_q": total, "max_length_k": total}
        shared = rl_packed_layout(ids, mask, width, shared_prefix=True)
        cu = shared["cu_seq_lens_q"].tolist()
        restarted = {**shared, "position_ids": torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])[None]}
        no_prefix = {**shared, "shared_prefix": None}  # the same segments, the rule left out
        assert _close(run(plain), ref) and _close(run(shared), ref)
        for name, layout in (("no isolation", leaky), ("positions restarted", restarted), ("prompt unseen", no_prefix)):
            assert _gap(run(layout), ref) > 1e-2, name


def test_trl_padded_positions_are_shifted(ragged):
    """TRL's padded forward gives a left-padded prompt positions from the padding's width: documented, not pf-trl's
    behaviour. With rotary embeddings only relative positions enter attention, so its values differ from the
    unpadded reference by rounding of the larger angles; pf-trl gives each sequence the positions generation gave."""
    from trl import GRPOTrainer

    from pf_trl.trainer.rl.layout import rl_packed_layout

    trl_trainer, _, ids, mask, width = ragged
    layout = rl_packed_layout(ids, mask, width, shared_prefix=False)
    starts = layout["cu_seq_lens_q"][:-1].long()
    assert bool((layout["position_ids"][0, starts] == 0).all())
    with torch.no_grad():
        padded, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trl_trainer, trl_trainer.model, ids, mask, width)
        ref, _ = _unpadded_reference(trl_trainer, ids, mask, width)
    assert _gap(padded, ref) < 1e-3


# ------------------------------------------------------------------------------------------ token budgets


def test_plan_forwards_keeps_groups_under_the_budget():
    """Whole groups (one prompt each) or whole sequences per forward; a group over the budget split between forwards,
    each holding its prompt once; a sequence over the budget alone; several ranks' agreed count reached by halving."""
    from pf_trl.errors import PackingError
    from pf_trl.trainer.rl.layout import plan_forwards, rl_packed_layout

    ids, mask, width = _ragged_batch(0)  # prompts of 2, 5, 9 tokens; completions (3, 6), (1, 4), (5, 0)
    assert plan_forwards(ids, mask, width, 100, shared_prefix=True) == [[0, 1, 2, 3, 4, 5]]
    assert plan_forwards(ids, mask, width, 20, shared_prefix=True) == [[0, 1], [2, 3], [4, 5]]
    assert plan_forwards(ids, mask, width, 12, shared_prefix=True) == [[0, 1], [2, 3], [4], [5]]  # 5 + 1 + 4 > 12
    assert plan_forwards(ids, mask, width, 20, shared_prefix=False) == [[0, 1, 2], [3], [4], [5]]
    assert plan_forwards(ids, mask, width, 1, shared_prefix=False) == [[i] for i in range(6)]
    assert plan_forwards(ids, mask, width, 100, shared_prefix=True, min_forwards=4) == [[0], [1, 2], [3], [4, 5]]
    for budget, shared in ((20, True), (12, True), (20, False)):
        for rows in plan_forwards(ids, mask, width, budget, shared_prefix=shared):
            index = torch.tensor(rows)
            layout = rl_packed_layout(ids[index], mask[index], width, shared_prefix=shared)
            # within the budget, or a sequence over it alone (row 4: 9 + 5 tokens)
            assert layout["input_ids"].shape[1] <= budget or rows == [4], (budget, shared, rows)
    with pytest.raises(PackingError, match="min_forwards"):
        plan_forwards(ids, mask, width, 100, shared_prefix=True, min_forwards=7)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")


def _loss_inputs(trainer, ids, mask, width) -> dict:
    """TRL's micro-batch of the ragged batch: advantages of both signs, old-policy and reference log-probabilities
    0.3 nats off the policy's (the ratios clip, the KL term counts)."""
    prompt = ids.shape[1] - width
    completion_mask = mask[:, prompt:]
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
    g = torch.Generator().manual_seed(1)
    return dict(prompt_ids=ids[:, :prompt], prompt_mask=mask[:, :prompt], completion_ids=ids[:, prompt:],
                completion_mask=completion_mask, advantages=torch.linspace(-1, 1, ids.shape[0]),
                old_per_token_logps=(current + 0.3 * torch.randn(current.shape, generator=g)) * completion_mask,
                ref_per_token_logps=(current + 0.3 * torch.randn(current.shape, generator=g)) * completion_mask,
                num_items_in_batch=completion_mask.sum())


def _loss_grads_metrics(trainer, inputs, loss_type, budget):
    """What Trainer.training_step does with a micro-batch (compute_loss, then the backward), for ``loss_type`` under
    ``budget``: the loss, the gradients and TRL's logged metrics."""
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"  # as TRL requires
    trainer.pf_max_tokens = budget
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    trainer.accelerator.backward(loss)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return float(loss), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


@pytest.fixture()
def budget_trainer(ragged, monkeypatch):
    from trl.models.utils import disable_gradient_checkpointing

    _, trainer, ids, mask, width = ragged
    trainer.model.train()
    monkeypatch.setattr(trainer, "current_gradient_accumulation_steps", 2, raising=False)  # TRL's loss divides by it
    inputs = _loss_inputs(trainer, ids, mask, width)
    loss_type = trainer.loss_type
    # the same gradients with or without recomputing the layers (the runs above have it on); without is cheaper
    with disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        yield trainer, inputs
    trainer.loss_type, trainer.importance_sampling_level, trainer.pf_max_tokens = loss_type, "token", None


def test_budget_keeps_each_loss_type(budget_trainer, monkeypatch):
    """Each loss type's micro-batch split into 3 packed forwards of whole groups gives the unsplit loss, gradients and
    logged metrics (grpo also split into one forward per sequence, without shared prefixes). Tolerance: the split
    forwards' per-token values round differently, and the loss, its metrics and its gradients are sums over the
    batch's ~90 tokens of terms built from them (:func:`tests.tolerances.sum_rtol`); measured: gradients ~3e-7,
    vespo's loss 3e-6 (an exponential of per-sequence sums of log-ratios), the others' losses ~1e-7. Negative
    control: the pieces weighted by another loss type's normaliser (bnpo's token share for grpo, grpo's sequence
    share for dapo) move the gradients by far more."""
    from pf_trl.trainer.rl import budget as budget_module
    from pf_trl.trainer.rl import mixin
    from tests.tolerances import assert_other_math, assert_same_math, sum_rtol

    trainer, inputs = budget_trainer
    rtol = sum_rtol(int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()))
    assert len(trainer._pf_plan(inputs, 20)) == 3
    whole = {}
    for loss_type in LOSS_TYPES:
        whole[loss_type] = _loss_grads_metrics(trainer, inputs, loss_type, None)
        for shared in (True, False) if loss_type == "grpo" else (True,):
            trainer.pf_shared_prefix = shared
            split = _loss_grads_metrics(trainer, inputs, loss_type, 20)
            for i, what in enumerate(("loss", "gradients", "metrics")):
                assert_same_math(split[i], whole[loss_type][i], what=f"{loss_type} {what}", rtol=rtol)
        trainer.pf_shared_prefix = True
    wrong = {"grpo": "bnpo", "dapo": "grpo"}
    real = budget_module.piece_weight
    monkeypatch.setattr(mixin, "piece_weight", lambda loss_type, batch, piece: real(wrong[loss_type], batch, piece))
    for loss_type in wrong:
        split = _loss_grads_metrics(trainer, inputs, loss_type, 20)
        assert_other_math(split[1], whole[loss_type][1],
                          what=f"{loss_type} with {wrong[loss_type]}'s normaliser", rtol=rtol)


def test_budget_refusals(folder, tmp_path, grpo_runs):
    """A budget is refused in one line where a split would change TRL's loss: the entropy bonus (at construction),
    top_entropy_quantile < 1, a loss type pf-trl does not know; a budget that is not a positive integer."""
    from pf_trl.errors import ConfigError
    from pf_trl.trainer.rl import PaddingFreeGRPOConfig, PaddingFreeGRPOTrainer
    from pf_trl.trainer.rl.budget import budget_refusal

    with pytest.raises(ConfigError, match="entropy bonus") as refused:
        S.trainer(PaddingFreeGRPOTrainer, PaddingFreeGRPOConfig, folder, S.prompts(4, equal=True), tmp_path,
                  beta=0.0, entropy_coef=0.01, max_tokens_per_forward=64)
    assert "max_tokens_per_forward" in str(refused.value) and "\n" not in str(refused.value)
    trainer = grpo_runs["pf"][0]
    assert budget_refusal(trainer) is None
    trainer.top_entropy_quantile = 0.5
    assert "top_entropy_quantile" in budget_refusal(trainer)
    trainer.top_entropy_quantile, trainer.loss_type = 1.0, "future_loss"
    assert "'future_loss'" in budget_refusal(trainer)
    trainer.loss_type = "grpo"
    trainer.args.max_tokens_per_forward = 0
    with pytest.raises(ConfigError, match="positive integer"):
        trainer._pf_setup()
    trainer.args.max_tokens_per_forward = GROUP_BUDGET
