"""TRL's padded GRPO/RLOO batch as one packed row: the layout the log-probability forward runs.

TRL's trainers score ``input_ids = [prompt_ids | completion_ids]`` (``[B, P + C]``, prompts left-padded, completions
right-padded; ``attention_mask`` marks the real tokens) and keep the log-probabilities of the last ``C`` predictions
(``logits_to_keep``). :func:`rl_packed_layout` turns that batch into one row without a pad token:

- plain: every sequence (its real prompt tokens, then its real completion tokens) is a segment with
  ``position_ids`` ``0 .. n - 1``, the positions generation gave it (TRL's padded forward passes no ``position_ids``,
  so its left-padded prompts start at the padding's width instead);
- shared prefix: the sequences with the same prompt (a GRPO group) hold that prompt once, as a segment of its own,
  followed by each completion as a segment that also sees the prompt (:mod:`pf_trl.attention.shared_prefix`), with
  ``position_ids`` continuing from the prompt length.

Either way each scored prediction is listed with its position in the packed row (the hidden state that predicts it:
for a completion's first token, the prompt's last token), its position in TRL's flattened ``[B, C]`` output and its
target token, so that the LM head scores only those and the values land where TRL's loss code reads them.
"""

from __future__ import annotations

from typing import Any

import torch

from pf_trl.attention.shared_prefix import shared_prefix_layout
from pf_trl.batching.packing import cu_seqlens_from_lengths
from pf_trl.errors import PackingError

__all__ = ["rl_packed_layout"]


def _runs(mask: torch.Tensor, prompt_width: int) -> tuple[list[int], list[int], list[int]]:
    """Per row: where its real prompt tokens start, how many there are, how many real completion tokens follow.
    Refuses a mask that is not TRL's layout (one run of prompt tokens ending at the prompt width, completion tokens
    from the first completion column on)."""
    prompt = mask[:, :prompt_width].bool()
    completion = mask[:, prompt_width:].bool()
    p = prompt.sum(1)
    c = completion.sum(1)
    width = mask.shape[1] - prompt_width
    cols_p = torch.arange(prompt_width, device=mask.device)
    cols_c = torch.arange(width, device=mask.device)
    if not torch.equal(prompt, cols_p[None, :] >= (prompt_width - p)[:, None]):
        raise PackingError("a GRPO/RLOO batch must have left-padded prompts (TRL's layout); got another prompt mask")
    if not torch.equal(completion, cols_c[None, :] < c[:, None]):
        raise PackingError("a GRPO/RLOO batch must have right-padded completions (TRL's layout); got another mask")
    if bool((p == 0).any()):
        raise PackingError("a GRPO/RLOO batch holds an empty prompt; its first completion token has no prediction")
    p_list, c_list = p.tolist(), c.tolist()
    return [prompt_width - n for n in p_list], p_list, c_list


def rl_packed_layout(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *,
                     shared_prefix: bool) -> dict[str, Any]:
    """The packed row of TRL's ``[B, P + C]`` batch (``C = logits_to_keep``; see the module docstring).

    Returns ``input_ids`` / ``position_ids`` (``LongTensor[1, T]``), ``cu_seq_lens_q`` / ``cu_seq_lens_k``,
    ``max_length_q`` / ``max_length_k``, ``shared_prefix`` (a
    :class:`~pf_trl.attention.shared_prefix.SharedPrefixLayout` or ``None``), ``src`` / ``dst`` / ``targets``
    (long ``[K]``: packed position, flattened ``[B, C]`` position and token of every scored prediction), ``rows``
    and ``width`` (``B``, ``C``), all on the host."""
    ids = input_ids.detach().cpu()
    mask = attention_mask.detach().cpu()
    rows, total_width = ids.shape
    width = int(logits_to_keep)
    prompt_width = total_width - width
    starts, p, c = _runs(mask, prompt_width)
    prompts = [ids[i, starts[i]:prompt_width] for i in range(rows)]
    completions = [ids[i, prompt_width:prompt_width + c[i]] for i in range(rows)]
    tokens, positions, lengths, prefix_of, src, dst, tgt = [], [], [], [], [], [], []
    offset = 0

    def segment(values: torch.Tensor, first_position: int, prefix: int = -1) -> int:
        nonlocal offset
        start = offset
        tokens.append(values)
        positions.append(torch.arange(first_position, first_position + values.numel()))
        lengths.append(int(values.numel()))
        prefix_of.append(prefix)
        offset += int(values.numel())
        return start

    if shared_prefix:
        groups: dict[tuple[int, ...], list[int]] = {}
        for i in range(rows):
            groups.setdefault(tuple(prompts[i].tolist()), []).append(i)
        for members in groups.values():
            prompt_index = len(lengths)
            prompt_start = segment(prompts[members[0]], 0)
            last_prompt = prompt_start + p[members[0]] - 1
            for i in members:
                if c[i] == 0:
                    continue
                start = segment(completions[i], p[i], prompt_index)
                # completion token j is predicted by the prompt's last token (j = 0), else by completion token j - 1
                src.append(torch.cat([torch.tensor([last_prompt]), torch.arange(start, start + c[i] - 1)]))
                dst.append(torch.arange(i * width, i * width + c[i]))
                tgt.append(completions[i])
    else:
        for i in range(rows):
            start = segment(torch.cat([prompts[i], completions[i]]), 0)
            src.append(torch.arange(start + p[i] - 1, start + p[i] - 1 + c[i]))
            dst.append(torch.arange(i * width, i * width + c[i]))
            tgt.append(completions[i])
    targets = torch.cat(tgt) if tgt else ids.new_zeros(0)
    src_t = torch.cat(src).long() if src else torch.zeros(0, dtype=torch.long)
    dst_t = torch.cat(dst).long() if dst else torch.zeros(0, dtype=torch.long)
    layout = dict(input_ids=torch.cat(tokens).unsqueeze(0), position_ids=torch.cat(positions).unsqueeze(0), src=src_t,
                  dst=dst_t, targets=targets.long(), rows=rows, width=width, shared_prefix=None)
    if shared_prefix:
        prefix = shared_prefix_layout(lengths, prefix_of)
        layout.update(shared_prefix=prefix, cu_seq_lens_q=prefix.cu_seq_lens, cu_seq_lens_k=prefix.cu_seq_lens,
                      max_length_q=prefix.max_length, max_length_k=prefix.max_length)
    else:
        cu = cu_seqlens_from_lengths(lengths)
        layout.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=max(lengths),
                      max_length_k=max(lengths))
    return layout
