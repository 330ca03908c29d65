"""Batching: what turns examples into packed micro-batches, shared by the SFT and DPO trainers.

- ``sampler``: :class:`TokenBudgetBatchSampler` (lengths in, batches of indices out; numpy only, no torch)
- ``mixture_sampler``: :class:`MixtureBatchSampler`, sampling several sources by weight
- ``stream_sampler``: :class:`StreamPacker`, packing a stream to the token budget
- ``packing``: how a packed row marks its examples (``cu_seqlens``, ``position_ids``, segment ids, the label shift)
- ``collator``: :class:`PaddingFreeCollator`, features in, one packed row out
- ``preference``: :func:`pair_lengths`, the packed tokens of each preference pair (what token budgets plan with)

This package imports nothing itself, so the sampler stays importable without torch.
"""
