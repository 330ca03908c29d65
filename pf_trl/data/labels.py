"""The label rule of every row pf-trl writes: :data:`IGNORE_INDEX` marks a token without loss.

A leaf of :mod:`pf_trl.data` (it imports nothing), so that the data code, which runs before torch loads, and
:mod:`pf_trl.batching.packing`, which re-exports it to the collator, the attention layers and the trainer, share one
value without an import cycle between ``data`` and ``batching``.
"""

from __future__ import annotations

# the label value Hugging Face's losses (torch's cross_entropy ignore_index default) skip
IGNORE_INDEX = -100
