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
target token, so that the LM head scores only those and the values land where TRL's loss code reads them. The plain
layout is :func:`pf_trl.trainer.packed.pack_padded`'s row (the packed core every trainer shares), its next-token
predictions narrowed to the completion tokens.

:func:`plan_forwards` splits a batch into the row sets of several packed forwards under a token budget (whole groups
when shared prefixes are on, else whole sequences).
"""

from __future__ import annotations

from typing import Any

import torch

from pf_trl.attention.shared_prefix import shared_prefix_layout
from pf_trl.errors import PackingError
from pf_trl.trainer.packed import pack_padded

__all__ = ["plan_forwards", "rl_packed_layout"]


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


def _plain_layout(ids: torch.Tensor, mask: torch.Tensor, width: int) -> dict[str, Any]:
    """Every sequence a segment of its own: :func:`~pf_trl.trainer.packed.pack_padded`'s row, its next-token
    predictions kept where they score a completion token (shifted column ``P - 1`` on: TRL's ``logits_to_keep``)."""
    rows, total_width = ids.shape
    row = pack_padded(mask, ids)
    first = total_width - width - 1  # the shifted column that predicts the first completion token
    seq, col = row.shift_dst // (total_width - 1), row.shift_dst % (total_width - 1)
    kept = col >= first
    seq, col = seq[kept], col[kept]
    return dict(input_ids=row.input_ids, position_ids=row.position_ids, src=row.shift_src[kept],
                dst=seq * width + col - first, targets=ids[seq, col + 1].long(), rows=rows, width=width,
                shared_prefix=None, **{k: v for k, v in row.attention_kwargs().items() if k != "position_ids"})


def _shared_layout(ids: torch.Tensor, starts: list[int], p: list[int], c: list[int], width: int) -> dict[str, Any]:
    """Each group's prompt once, then its completions as segments that also see it."""
    rows, total_width = ids.shape
    prompt_width = total_width - width
    prompts = [ids[i, starts[i]:prompt_width] for i in range(rows)]
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

    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(rows):
        groups.setdefault(tuple(prompts[i].tolist()), []).append(i)
    for members in groups.values():
        prompt_index = len(lengths)
        last_prompt = segment(prompts[members[0]], 0) + p[members[0]] - 1
        for i in members:
            if c[i] == 0:
                continue
            completion = ids[i, prompt_width:prompt_width + c[i]]
            start = segment(completion, p[i], prompt_index)
            # completion token j is predicted by the prompt's last token (j = 0), else by completion token j - 1
            src.append(torch.cat([torch.tensor([last_prompt]), torch.arange(start, start + c[i] - 1)]))
            dst.append(torch.arange(i * width, i * width + c[i]))
            tgt.append(completion)
    prefix = shared_prefix_layout(lengths, prefix_of)
    return dict(input_ids=torch.cat(tokens).unsqueeze(0), position_ids=torch.cat(positions).unsqueeze(0),
                src=torch.cat(src).long() if src else torch.zeros(0, dtype=torch.long),
                dst=torch.cat(dst).long() if dst else torch.zeros(0, dtype=torch.long),
                targets=torch.cat(tgt).long() if tgt else torch.zeros(0, dtype=torch.long), rows=rows, width=width,
                shared_prefix=prefix, cu_seq_lens_q=prefix.cu_seq_lens, cu_seq_lens_k=prefix.cu_seq_lens,
                max_length_q=prefix.max_length, max_length_k=prefix.max_length)


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
    width = int(logits_to_keep)
    starts, p, c = _runs(mask, ids.shape[1] - width)
    if shared_prefix:
        return _shared_layout(ids, starts, p, c, width)
    return _plain_layout(ids, mask, width)


def plan_forwards(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, max_tokens: int, *,
                  shared_prefix: bool, min_forwards: int = 1) -> list[list[int]]:
    """The rows of TRL's ``[B, P + C]`` batch that each packed forward takes, so that each forward's row holds at most
    ``max_tokens`` tokens (the tokens :func:`rl_packed_layout` would pack: with ``shared_prefix``, a group's prompt
    once).

    Rows are taken in order, a group (the rows with one prompt, under ``shared_prefix``) or a sequence at a time; a
    group that does not fit in what is left of a forward starts the next one, and a group over the budget on its own
    is split between forwards, each holding the prompt once. A sequence over the budget is forwarded alone. Then,
    while there are fewer than ``min_forwards`` forwards (several ranks agree on one count, at most ``B``), the
    forward with the most rows is halved."""
    if max_tokens <= 0:
        raise PackingError(f"max_tokens must be positive, got {max_tokens}")
    ids = input_ids.detach().cpu()
    width = int(logits_to_keep)
    prompt_width = ids.shape[1] - width
    starts, p, c = _runs(attention_mask.detach().cpu(), prompt_width)
    rows = ids.shape[0]
    if not 1 <= min_forwards <= rows:
        raise PackingError(f"min_forwards must be within 1 and the {rows} rows, got {min_forwards}")
    keys = [tuple(ids[i, starts[i]:prompt_width].tolist()) if shared_prefix else (i,) for i in range(rows)]
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(rows):
        groups.setdefault(keys[i], []).append(i)
    forwards: list[list[int]] = []
    current: list[int] = []
    used = 0
    seen: set[tuple[int, ...]] = set()

    def close() -> None:
        nonlocal current, used
        if current:
            forwards.append(current)
        current, used = [], 0
        seen.clear()

    for key, members in groups.items():
        alone = p[members[0]] + sum(c[i] for i in members) if shared_prefix else p[members[0]] + c[members[0]]
        if used + alone > max_tokens:
            close()
        for i in members:
            need = c[i] + (0 if key in seen else p[i])
            if current and used + need > max_tokens:
                close()
                need = c[i] + p[i]
            current.append(i)
            used += need
            seen.add(key)
    close()
    while len(forwards) < min_forwards:
        largest = max(range(len(forwards)), key=lambda k: len(forwards[k]))
        rows_of = forwards.pop(largest)
        half = len(rows_of) // 2
        forwards[largest:largest] = [rows_of[:half], rows_of[half:]]
    return forwards
