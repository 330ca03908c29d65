"""Where a model comes from: an embedded tiny config (random init), a local folder, a Hugging Face Hub id, or a
committed prefix in a bucket (``s3://``, ``gs://``, ``az://``: the ``output_dir`` of a finished ``pf-trl train``).

``--model_name_or_path pf-trl/tiny-llama`` (or any name below) builds the model from these configs; a local folder
loads with ``from_pretrained(folder)``; a Hub id (``ORG/NAME``) is downloaded by huggingface_hub into its cache
(:mod:`pf_trl.hub`) and its snapshot folder loads as a local folder does. A local path wins over a Hub id of the same
spelling, as in transformers. A bucket model is read only when committed (its marker, written last, lists every
file with its size and checksum: :mod:`pf_trl.storage.committed`); its root files (config, weights, tokenizer) are
downloaded once per node into the node cache, each checked, and load as a local folder does.
"""

from __future__ import annotations

from typing import Any

EMBEDDED_MODELS: dict[str, dict[str, Any]] = {
    # 4 layers x 256 like the shared baseline; vocab of the embedded Mistral tokenizer.
    "pf-trl/tiny-llama": dict(
        model_type="llama", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "pf-trl/tiny-mistral": dict(
        model_type="mistral", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, sliding_window=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    "pf-trl/tiny-qwen2": dict(
        model_type="qwen2", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # hybrids with layers that carry state along the row (pf_trl.attention.stateful), same width and vocabulary:
    # Qwen3.5's pattern (three gated-delta-net layers, then full attention) ...
    "pf-trl/tiny-qwen3.5": dict(
        model_type="qwen3_5_text", vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    ),
    # ... and Granite 4.0-H's (Mamba2 layers, one attention layer without position embeddings, MoE + shared MLP).
    # No load-balancing loss: TRL 1.16's padded path cannot compute it for this config (it reads `num_experts`,
    # which GraniteMoeHybridConfig calls `num_local_experts`), and the benchmark compares against that path.
    "pf-trl/tiny-granite-4.0-h": dict(
        model_type="granitemoehybrid", vocab_size=32000, hidden_size=256, intermediate_size=256,
        shared_intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=8, num_key_value_heads=4, position_embedding_type="nope", num_local_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.0, mamba_n_heads=16, mamba_d_head=32, mamba_d_state=32,
        mamba_n_groups=1, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # ~1.1B Llama (TinyLlama shape) for GPU benchmarks: random init in bf16.
    "pf-trl/llama-1b": dict(
        model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
    # Mistral-7B v0.1 shape (7.24B parameters) for the seed's single-GPU experiment, random init; no sliding window
    # (v0.1's is 4096, the longest row here, so it never masks anything).
    "pf-trl/mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}


# a bucket model's files a tokenizer needs (what AutoTokenizer.from_pretrained reads), with config.json for the
# vocabulary check: `pf-trl pretokenize --model_name_or_path s3://...` fetches these, never the weights
TOKENIZER_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                           "*.tiktoken", "chat_template.*", "preprocessor_config.json", "processor_config.json",
                           "config.json")


def fetch_bucket_model(uri: str, *, tokenizer_only: bool = False, flag: str = "--model_name_or_path") -> str:
    """The node-cache folder of the committed bucket model ``uri``: its root files (``tokenizer_only``: the
    tokenizer's files and config.json), each checked against the commit marker's size and checksum.

    Raises:
        pf_trl.storage.StorageError: uncommitted prefix, a file that differs from its marker, the bucket unreachable
            (one line).
    """
    from fnmatch import fnmatch

    from pf_trl.storage.committed import fetch_committed

    def wanted(name: str) -> bool:
        if "/" in name:  # subfolders (runs/, merged/) are not the model transformers loads from the root
            return False
        return not tokenizer_only or any(fnmatch(name, p) for p in TOKENIZER_FILE_PATTERNS)

    return str(fetch_committed(uri, flag=flag, select=wanted))


def is_embedded_model(name: str) -> bool:
    return name in EMBEDDED_MODELS


def embedded_config(name: str, **overrides: Any):
    """The ``transformers`` config of an embedded model, with overrides (e.g. ``num_hidden_layers=2``)."""
    from transformers import AutoConfig

    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    spec = {**EMBEDDED_MODELS[name], **overrides}
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, **spec)


def pinned_revision(name: str, revision: str | None) -> str | None:
    """``--model_revision`` as it applies to ``name``: None when unset or ``main``; any other revision pins a Hub id
    and is refused for an embedded model or a local folder (they have one revision).

    Raises:
        pf_trl.hub.HubError: a revision for something that is not a Hub id.
    """
    from pf_trl.hub import HubError, looks_like_repo_id

    if revision in (None, "", "main"):
        return None
    if is_embedded_model(name) or not looks_like_repo_id(name):
        raise HubError(f"--model_revision {revision}: {name} is not a Hub id (a local folder or an embedded model has "
                       "one revision); drop --model_revision, or pass the Hub id")
    return revision


def resolve_model_path(name: str, *, revision: str | None = None, flag: str = "--model_name_or_path",
                       trust_remote_code: bool | None = None) -> str:
    """``name`` as pf-trl loads it: an embedded model name as it is, a local folder (``~`` expanded), or the snapshot
    folder of the Hub repository ``name`` at ``revision`` (downloaded by huggingface_hub, or from its cache).

    ``trust_remote_code`` (bool): a model that needs its repository's own code (:mod:`pf_trl.remote_code`) is refused
    without it, a Hub repository's ``config.json`` being fetched and checked before anything else is downloaded;
    with it, the repository's ``*.py`` files come with the snapshot. ``None``: the folder only, no check (callers
    that load no model class, after the run's own check).

    Raises:
        pf_trl.hub.HubError: a Hub failure (not found, gated, offline, unreachable) or a name that is neither.
        pf_trl.remote_code.RemoteCodeError: custom code without ``trust_remote_code``.
        pf_trl.storage.StorageError: a bucket prefix that is not a committed model (one line).
    """
    from pathlib import Path

    from pf_trl.hub import HubError, looks_like_repo_id, snapshot
    from pf_trl.remote_code import check_remote_code
    from pf_trl.storage import is_remote

    if is_embedded_model(name):
        return name
    if is_remote(name):
        local = fetch_bucket_model(name, flag=flag)
        if trust_remote_code is not None:
            check_remote_code(Path(local), trust_remote_code=trust_remote_code, name=name, flag=flag)
        return local
    folder = Path(name).expanduser()
    if folder.is_dir():
        if trust_remote_code is not None:
            check_remote_code(folder, trust_remote_code=trust_remote_code, name=name, flag=flag)
        return str(folder)
    if folder.exists() or not looks_like_repo_id(name):
        raise HubError(f"{flag} {name!r} is neither an embedded model (pf-trl/tiny-llama, pf-trl/tiny-mistral, ...), "
                       "a local model folder, nor a Hub id (ORG/NAME)")
    if trust_remote_code is None:
        return snapshot(name, repo_type="model", revision=revision, flag=flag, what="model").folder
    # the config alone first: custom code is refused before any weights (or code) are downloaded
    config = snapshot(name, repo_type="model", revision=revision, flag=flag, what="config")
    check_remote_code(config.folder, trust_remote_code=trust_remote_code, name=name, flag=flag)
    found = snapshot(name, repo_type="model", revision=revision, flag=flag, what="model",
                     code=bool(trust_remote_code)).folder
    check_remote_code(found, trust_remote_code=trust_remote_code, name=name, flag=flag)  # the same commit, whole
    return found


def build_model(name_or_path: str, *, torch_dtype: Any = None, attn_implementation: str | None = None, seed: int = 0,
                quantization_config: Any = None, revision: str | None = None, trust_remote_code: bool = False,
                **overrides: Any):
    """An embedded model (random init, seeded), a local checkpoint folder or a Hub id (its snapshot, at ``revision``)
    (``quantization_config``: a bitsandbytes config for QLoRA, pretrained weights only; ``trust_remote_code``: run the
    repository's own model code, as transformers does, refused without it when the model needs it)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if is_embedded_model(name_or_path):
        config = embedded_config(name_or_path, **overrides)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **kwargs)
        if torch_dtype is not None:
            model = model.to(torch_dtype)
        model.pf_trl_base = name_or_path  # what the model card names as its origin (a config, not pretrained weights)
        # how to build these very initial weights again (the card's snippet for an adapter trained on them)
        model.pf_trl_build = {"seed": int(seed), "overrides": dict(overrides)}
        return model
    name_or_path = resolve_model_path(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    return _auto_class(name_or_path, trust_remote_code).from_pretrained(
        name_or_path, local_files_only=True, trust_remote_code=trust_remote_code, **kwargs)


def _auto_class(folder: str, trust_remote_code: bool = False):
    """``AutoModelForCausalLM``, or ``AutoModelForImageTextToText`` for a vision-language type it does not map
    (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    try:
        model_type = AutoConfig.from_pretrained(folder, local_files_only=True,
                                                trust_remote_code=trust_remote_code).model_type
    except Exception:
        return AutoModelForCausalLM
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
