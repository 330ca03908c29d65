"""The packed forward's core, shared by every trainer that keeps TRL's padded layout: a padded batch becomes one
packed row, and per-token values computed on that row go back where TRL's code reads them.

TRL's trainers (DPO, reward, KTO, GRPO, RLOO) build a padded ``[B, L]`` batch with an ``attention_mask`` and run
their loss and metric code on ``[B, L]`` (or shifted ``[B, L - 1]``) tensors. A padding-free trainer keeps that
batch as an *index layout*, runs the model on :class:`PackedRow` (``[1, T]``, ``T`` the real tokens, no pad token,
``position_ids`` restarting at 0 on every sequence, ``cu_seq_lens_*`` marking them for varlen attention; see
:func:`pf_trl.attention.enable_padding_free`), and scatters the row's per-token values back, zero elsewhere, so
TRL's own loss code runs unchanged.

API (small and stable; tensors on the batch's device):

- :func:`pack_padded` ``(attention_mask [B, L], input_ids [B, L] | None) -> PackedRow``: each row's real tokens must
  be contiguous (right padding, left padding, or both, as a left-padded prompt followed by a right-padded
  completion); rows keep their order.
- :attr:`PackedRow.token_index` ``[T]``: where each packed token sits in the flattened ``[B, L]`` layout;
  :meth:`PackedRow.gather` reads ``[B, L, ...]`` values at the packed tokens, :meth:`PackedRow.scatter` writes
  ``[T, ...]`` (or ``[1, T, ...]``) values back into ``[B, L, ...]``.
- :attr:`PackedRow.shift_src` / :attr:`PackedRow.shift_dst`: every next-token prediction *inside* a sequence, as its
  position among the row's ``T - 1`` shifted outputs and in the flattened ``[B, L - 1]`` shifted layout (the first
  token of a packed sequence is never a target: it would be predicted from the previous sequence);
  :meth:`PackedRow.scatter_shifted` writes ``[T - 1, ...]`` (or ``[1, T - 1, ...]``) shifted values back into
  ``[B, L - 1, ...]``.
- :meth:`PackedRow.to`: the row on another device (a batch's row moves with the batch).
- :meth:`PackedRow.model_kwargs`: ``input_ids``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k`` for the
  model's forward on the row.
- :meth:`PackedRow.last_index`: each sequence's pooled position in the row (sequence classification pools the last
  token that is not the pad token, as transformers does on the padded batch).

Positions restart at 0 on every sequence; a left-padded row of TRL's padded run counts positions from the row's
first column instead (transformers' default ``position_ids``), which rotary embeddings see as the same relative
positions: equal within float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from pf_trl.batching.packing import cu_seqlens_from_lengths
from pf_trl.errors import PackingError

__all__ = ["PackedRow", "pack_padded"]


@dataclass(frozen=True)
class PackedRow:
    """One packed row of a padded ``[B, L]`` batch, with the maps between the two layouts (see the module
    docstring). ``input_ids`` is ``None`` when :func:`pack_padded` was given no ids."""

    input_ids: torch.Tensor | None  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 per sequence
    cu_seq_lens: torch.Tensor  # int32 [B + 1]
    lengths: tuple[int, ...]  # real tokens of each row
    offsets: tuple[int, ...]  # first real column of each row in the padded layout
    token_index: torch.Tensor  # [T]: flat index into [B, L]
    shift_src: torch.Tensor  # [P]: index into the row's T - 1 shifted outputs
    shift_dst: torch.Tensor  # [P]: flat index into [B, L - 1]
    shape: tuple[int, int]  # (B, L)

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.numel())

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def starts(self) -> torch.Tensor:
        """Each sequence's first position in the row (``LongTensor[B]``)."""
        return self.cu_seq_lens[:-1].long()

    def to(self, device: torch.device | str, non_blocking: bool = False, **_: Any) -> PackedRow:
        """This row with its tensors on ``device`` (accelerate's ``send_to_device`` calls it on a batch's row)."""
        def move(t):
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(self, input_ids=move(self.input_ids), position_ids=move(self.position_ids),
                       cu_seq_lens=move(self.cu_seq_lens), token_index=move(self.token_index),
                       shift_src=move(self.shift_src), shift_dst=move(self.shift_dst))

    def attention_kwargs(self) -> dict[str, Any]:
        """What varlen attention reads: ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``."""
        return {"position_ids": self.position_ids, "cu_seq_lens_q": self.cu_seq_lens,
                "cu_seq_lens_k": self.cu_seq_lens, "max_length_q": self.max_length, "max_length_k": self.max_length}

    def model_kwargs(self) -> dict[str, Any]:
        """:meth:`attention_kwargs` plus the row's ``input_ids``: the keyword arguments of the model's forward."""
        if self.input_ids is None:
            raise PackingError("this PackedRow was built without input_ids; pass them to pack_padded")
        return {"input_ids": self.input_ids, **self.attention_kwargs()}

    def gather(self, padded: torch.Tensor) -> torch.Tensor:
        """``padded [B, L, ...]`` at the packed tokens: ``[T, ...]``."""
        return padded.reshape(-1, *padded.shape[2:]).index_select(0, self.token_index.to(padded.device))

    def scatter(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """``values [T, ...]`` (or ``[1, T, ...]``) of the packed tokens placed in ``[B, L, ...]``, ``fill``
        elsewhere (differentiable)."""
        return self._place(values, self.token_index, self.num_tokens, self.shape[1], fill)

    def scatter_shifted(self, values: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """``values [T - 1, ...]`` (or ``[1, T - 1, ...]``: the row's shifted outputs, position ``t`` predicting
        token ``t + 1``) placed in the shifted layout ``[B, L - 1, ...]``, ``fill`` at every prediction that is not
        inside one sequence (differentiable)."""
        flat = self._squeeze(values, self.num_tokens - 1)
        picked = flat.index_select(0, self.shift_src.to(flat.device))
        return self._place(picked, self.shift_dst, picked.shape[0], self.shape[1] - 1, fill)

    def last_index(self, input_ids: torch.Tensor | None = None, pad_token_id: int | None = None) -> torch.Tensor:
        """Each sequence's pooled position in the row (``LongTensor[B]``): its last token, or, given the padded
        ``input_ids`` and ``pad_token_id``, its last token that is not ``pad_token_id`` (position 0 of the sequence
        when every token is), where transformers' sequence classification pools the padded batch."""
        lengths = torch.tensor(self.lengths, dtype=torch.long, device=self.cu_seq_lens.device)
        if input_ids is None or pad_token_id is None:
            return self.starts + lengths - 1
        rows, width = input_ids.shape
        cols = torch.arange(width, device=input_ids.device)
        offsets = torch.tensor(self.offsets, dtype=torch.long, device=input_ids.device)
        inside = (cols >= offsets[:, None]) & (cols < (offsets + lengths.to(input_ids.device))[:, None])
        real = inside & (input_ids != pad_token_id)
        # transformers' rule on the padded row: the rightmost column that is not pad; argmax of 0s is column 0
        last = (cols * real).argmax(-1)
        within = torch.where(real.any(-1), last - offsets, torch.zeros_like(last))
        return self.starts.to(input_ids.device) + within

    def _squeeze(self, values: torch.Tensor, n: int) -> torch.Tensor:
        flat = values[0] if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == n else values
        if flat.shape[0] != n:
            raise PackingError(f"expected {n} packed values, got shape {tuple(values.shape)}")
        return flat

    def _place(self, values: torch.Tensor, index: torch.Tensor, n: int, width: int, fill: float) -> torch.Tensor:
        flat = self._squeeze(values, n)
        out = flat.new_full((self.shape[0] * width, *flat.shape[1:]), fill)
        out = out.index_copy(0, index.to(flat.device), flat)
        return out.reshape(self.shape[0], width, *flat.shape[1:])


def pack_padded(attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None) -> PackedRow:
    """The packed row of a padded ``[B, L]`` batch (``attention_mask``: 1 on real tokens, contiguous per row).

    Raises :class:`~pf_trl.errors.PackingError` on an empty row or a row whose real tokens are not contiguous."""
    if attention_mask.dim() != 2:
        raise PackingError(f"attention_mask must be [B, L], got {tuple(attention_mask.shape)}")
    mask = attention_mask.bool()
    rows, width = mask.shape
    lengths = mask.sum(dim=1)
    if rows == 0 or int(lengths.min()) <= 0:
        raise PackingError("a padded batch to pack holds an empty row; drop empty sequences before collation")
    cols = torch.arange(width, device=mask.device)
    offsets = torch.where(mask, cols, width).amin(dim=1)
    expected = (cols >= offsets[:, None]) & (cols < (offsets + lengths)[:, None])
    if not torch.equal(mask, expected):
        raise PackingError("each row's real tokens must be contiguous (right, left or both-sided padding)")
    token_index = torch.nonzero(mask.reshape(-1), as_tuple=True)[0]
    lengths_list = [int(n) for n in lengths.tolist()]
    offsets_list = [int(o) for o in offsets.tolist()]
    cu = cu_seqlens_from_lengths(lengths_list, device=mask.device)
    starts = cu[:-1].long()
    # the packed position of each token, and its index inside its sequence
    seq = torch.repeat_interleave(torch.arange(rows, device=mask.device), lengths)
    within = torch.arange(int(lengths.sum()), device=mask.device) - starts[seq]
    inner = within < (lengths[seq] - 1)  # tokens that predict a next token of their own sequence
    packed_pos = torch.arange(int(lengths.sum()), device=mask.device)
    shift_src = packed_pos[inner]
    shift_dst = seq[inner] * (width - 1) + offsets[seq[inner]] + within[inner]
    packed_ids = None
    if input_ids is not None:
        packed_ids = input_ids.reshape(-1).index_select(0, token_index.to(input_ids.device)).unsqueeze(0)
    return PackedRow(input_ids=packed_ids, position_ids=within.unsqueeze(0), cu_seq_lens=cu,
                     lengths=tuple(lengths_list), offsets=tuple(offsets_list), token_index=token_index,
                     shift_src=shift_src, shift_dst=shift_dst, shape=(rows, width))
