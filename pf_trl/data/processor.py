"""The processing class a model comes with: a tokenizer, or a multimodal processor wrapping one.

Tokenizer loading and fingerprints (:mod:`pf_trl.data.tokenizer`), pretokenizing and the vision data path all ask
the same questions of it (is it a processor? which tokenizer renders text? what is its identity?); this module
answers them and imports nothing of pf-trl, so each of those modules can ask without importing the others.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from typing import Any


def is_processor(obj: Any) -> bool:
    """True for a transformers ``ProcessorMixin`` (a multimodal processor, not a tokenizer)."""
    # Not imported here: transformers.processing_utils pulls in torch.distributed, accelerate and DeepSpeed's
    # integration (~2 s of CPU in a tokenizing process). A processor's class subclasses ProcessorMixin, so the
    # module is loaded whenever a processor exists.
    processing_utils = sys.modules.get("transformers.processing_utils")
    return processing_utils is not None and isinstance(obj, processing_utils.ProcessorMixin)


def text_tokenizer(processing_class: Any):
    """The tokenizer of a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def processor_fingerprint(processor, tokenizer_fingerprint: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """A processor's identity: its tokenizer's fingerprint (``tokenizer_fingerprint(processor.tokenizer)``) with the
    image processor's settings, the processor's own settings (image token counts...) and chat template, as parts of
    the content identity (``sha256``) and folded into the file identity of older manifests (``files_sha256``)."""
    from pf_trl.data.tokenizer_content import processor_content

    base = tokenizer_fingerprint(processor.tokenizer)
    digest = hashlib.sha256(base["files_sha256"].encode())
    digest.update(type(processor).__name__.encode())
    digest.update(json.dumps(processor.image_processor.to_dict(), sort_keys=True, default=str).encode())
    own = {k: v for k, v in vars(processor).items() if isinstance(v, (int, float, str, bool)) and k != "chat_template"}
    digest.update(json.dumps(own, sort_keys=True).encode())
    digest.update(str(getattr(processor, "chat_template", None)).encode())
    return {**base, **processor_content(base, processor), "class": type(processor).__name__,
            "tokenizer_class": base["class"], "image_processor": type(processor.image_processor).__name__,
            "files_sha256": digest.hexdigest()}
