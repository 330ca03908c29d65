"""A tokenizer's identity by content: what it does, not the bytes of the files it was loaded from.

Two tokenizers are the same when they tokenize and render chats the same way: vocabulary, merges, added and special
tokens, normalizer, pre-tokenizer, post-processor, decoder and chat template. A copy re-saved with
``save_pretrained`` (other file bytes, other key order, other config keys) is the same tokenizer; another template
or vocabulary is not, and :func:`content_differences` names the part that differs.

A fast tokenizer's backend state is read from ``backend_tokenizer.to_str()`` (one JSON document, parsed once per
distinct state: the parts are cached under a digest of that text); a slow one's from ``get_vocab()``, its added
tokens and its sentencepiece model. Each part is hashed on its own (``content``), the identity is the hash of the
parts (``sha256`` of :func:`pf_trl.data.tokenizer.tokenizer_fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

CONTENT_IDENTITY = "content-1"  # the kind of identity a record carries; records without one hash files (older)

# the parts of a fast tokenizer's backend JSON, by the name a refusal uses; ``truncation`` / ``padding`` are call
# settings (transformers sets and resets them per call), not part of what the tokenizer is
_BACKEND_PARTS = ("normalizer", "pre_tokenizer", "post_processor", "decoder")
PART_NAMES = {
    "vocabulary": "vocabulary",
    "merges": "merges",
    "model": "tokenizer model settings",
    "added_tokens": "added tokens",
    "special_tokens": "special tokens",
    "normalizer": "normalizer",
    "pre_tokenizer": "pre-tokenizer",
    "post_processor": "post-processor",
    "decoder": "decoder",
    "chat_template": "chat template",
    "image_processor": "image processor settings",
    "processor": "processor settings",
}

_PARSED: dict[str, tuple[dict[str, str], dict[str, int]]] = {}  # to_str digest -> (part digests, sizes); small


def _digest(value: Any, *, ordered: bool = False) -> str:
    """sha256 of canonical JSON; ``ordered``: the value's own order is canonical already (a vocabulary as the
    backend writes it, by id; merges in rank order), and sorting a large one would cost more than the rest."""
    text = json.dumps(value, sort_keys=not ordered, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _backend_parts(backend_json: str) -> tuple[dict[str, str], dict[str, int]]:
    key = hashlib.sha256(backend_json.encode()).hexdigest()
    hit = _PARSED.get(key)
    if hit is None:
        state = json.loads(backend_json)
        model = dict(state.get("model") or {})
        vocab = model.pop("vocab", None)
        merges = model.pop("merges", None)
        added = state.get("added_tokens") or []
        items = list(vocab.items()) if isinstance(vocab, dict) else vocab  # (a list dumps ten times faster)
        parts = {"vocabulary": _digest(items, ordered=True), "merges": _digest(merges, ordered=True),
                 "model": _digest(model), "added_tokens": _digest(added)}
        parts.update({name: _digest(state.get(name)) for name in _BACKEND_PARTS})
        sizes = {"vocabulary": len(vocab) if isinstance(vocab, (dict, list)) else 0,
                 "merges": len(merges) if isinstance(merges, list) else 0, "added_tokens": len(added)}
        if len(_PARSED) > 32:
            _PARSED.clear()
        hit = _PARSED[key] = (parts, sizes)
    return dict(hit[0]), dict(hit[1])


def _slow_parts(tokenizer) -> tuple[dict[str, str], dict[str, int]]:
    vocab = tokenizer.get_vocab()
    added = {str(i): str(t) for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())}
    sp_model = getattr(tokenizer, "sp_model", None)
    proto = sp_model.serialized_model_proto() if hasattr(sp_model, "serialized_model_proto") else None
    parts = {"vocabulary": _digest(sorted(vocab.items(), key=lambda kv: kv[1])), "added_tokens": _digest(added),
             # a slow tokenizer's rules live in its class and its sentencepiece model
             "model": _digest([type(tokenizer).__name__, hashlib.sha256(proto).hexdigest() if proto else None])}
    return parts, {"vocabulary": len(vocab), "added_tokens": len(added)}


def _special_tokens(tokenizer) -> dict[str, Any]:
    """The special tokens by role, with their ids (a role set in memory changes the tokens written: a chat template
    renders ``eos_token``, text rows end with its id). The pad token is left out: no written token is padding (a packed
    row pads only its dummy segment, and TRL sets ``pad_token`` to EOS in memory when a tokenizer has none)."""
    out: dict[str, Any] = {}
    for role, token in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items()):
        if role != "pad_token":
            out[role] = [str(t) for t in token] if isinstance(token, (list, tuple)) else str(token)
    for role in ("bos_token_id", "eos_token_id", "unk_token_id"):
        out[role] = getattr(tokenizer, role, None)
    return out


def content_identity(tokenizer) -> dict[str, Any]:
    """``{"identity", "sha256", "content", "content_sizes"}`` of a tokenizer (not a processor): a digest per part
    (:data:`PART_NAMES`), the sizes a refusal quotes, and the digest of all parts."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        parts, sizes = _backend_parts(backend.to_str())
    else:
        parts, sizes = _slow_parts(tokenizer)
    parts["special_tokens"] = _digest(_special_tokens(tokenizer))
    template = getattr(tokenizer, "chat_template", None)
    parts["chat_template"] = _digest(template)
    return {"identity": CONTENT_IDENTITY, "sha256": _digest(parts), "content": parts, "content_sizes": sizes}


def processor_content(base: dict[str, Any], processor) -> dict[str, Any]:
    """A processor's content identity: its tokenizer's parts (``base``, from :func:`content_identity`) with the
    image processor's settings, the processor's own settings and its chat template."""
    parts = dict(base["content"])
    parts["image_processor"] = _digest(processor.image_processor.to_dict())
    own = {k: v for k, v in vars(processor).items() if isinstance(v, (int, float, str, bool)) and k != "chat_template"}
    parts["processor"] = _digest([type(processor).__name__, own])
    template = getattr(processor, "chat_template", None)
    if template is not None:  # the processor's template renders the chats (the tokenizer's when it has none)
        parts["chat_template"] = _digest(template)
    return {"identity": CONTENT_IDENTITY, "sha256": _digest(parts), "content": parts,
            "content_sizes": dict(base["content_sizes"])}


def _size_note(part: str, made_with: dict[str, Any], used: dict[str, Any]) -> str:
    a = (made_with.get("content_sizes") or {}).get(part)
    b = (used.get("content_sizes") or {}).get(part)
    if a is None or b is None:
        return ""
    unit = {"merges": "merges"}.get(part, "tokens")
    if a == b:
        return f" (the same number, {a} {unit}, other entries)"
    vocab = ""
    if made_with.get("vocab_size") != used.get("vocab_size"):
        vocab = f"; vocabulary {made_with.get('vocab_size')} vs {used.get('vocab_size')}"
    return f": {abs(a - b)} {unit} {'fewer' if b < a else 'more'} in the model's tokenizer ({a} vs {b}{vocab})"


def content_differences(made_with: dict[str, Any], used: dict[str, Any]) -> list[str]:
    """The parts that differ between two content identities (the data's, the model's), named for a user."""
    have, want = made_with.get("content") or {}, used.get("content") or {}
    out = []
    for part in sorted(set(have) | set(want), key=lambda p: list(PART_NAMES).index(p) if p in PART_NAMES else 99):
        if have.get(part) == want.get(part):
            continue
        label = PART_NAMES.get(part, part)
        if part not in want or part not in have:
            out.append(f"{label}: only the {'data' if part in have else 'model'}'s tokenizer has one")
        elif part == "chat_template":
            out.append("chat template differs")  # the caller adds which template each side has
        elif part == "special_tokens":
            ids = [f"{k} {made_with.get(k)} vs {used.get(k)}" for k in ("bos_token_id", "eos_token_id")
                   if made_with.get(k) != used.get(k)]
            out.append("special tokens differ" + (f" ({', '.join(ids)})" if ids else ""))
        else:
            out.append(f"{label} differ{'s' if not label.endswith('s') else ''}{_size_note(part, made_with, used)}")
    return out
