"""Tiny configs for every causal-LM type transformers ships: the defaults of each config class, shrunk.

:func:`tiny_config` starts from ``CONFIG_MAPPING[model_type]()`` (the architecture's own defaults: rotary type, norm,
softcapping, sliding-window pattern...) and shrinks only sizes: widths to 64, 2 layers (3 when the layer-type pattern
has three kinds), 4 heads, 4 experts, vocabulary 256. Per-layer lists (``layer_types``...) keep one layer of every
kind they hold, so a hybrid keeps both its attention and its recurrent layers. Token ids that fall outside the small
vocabulary are moved inside it. Sub-configs (``text_config``, ``attn_config``...) are shrunk the same way.
"""

from __future__ import annotations

from typing import Any

# The hand-written Llama-family shape the attention tests build their models from (vocabulary 128; plain Python, so
# the legacy suite on an old transformers imports it as well)
LLAMA_SHAPE: dict[str, int] = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
VOCAB = 256
WIDTH = 64
HEAD_DIM = 16

# attribute name -> tiny value (applied only when the default is larger)
_SIZES: dict[str, int] = {
    **dict.fromkeys(
        ("hidden_size", "n_embd", "d_model", "embedding_size", "emb_dim", "embedding_dim", "attention_hidden_size",
         "lru_width", "backbone_hidden_size", "word_embed_proj_dim", "input_embedding_size", "output_embedding_size",
         "router_hidden_size"),
        WIDTH,
    ),
    **dict.fromkeys(
        ("intermediate_size", "n_inner", "d_inner", "d_ff", "dim_ff", "dff", "ffn_dim", "decoder_ffn_dim",
         "encoder_ffn_dim", "feed_forward_size", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size",
         "expert_ffn_hidden_size"),
        128,
    ),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
         "moe_shared_expert_intermediate_size", "shared_experts_intermediate_size"),
        32,
    ),
    **dict.fromkeys(
        ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
         "num_decoder_layers", "num_encoder_layers"),
        2,
    ),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
         "attention_heads", "swa_num_attention_heads", "num_encoder_attention_heads", "num_decoder_attention_heads",
         "linear_num_heads"),
        4,
    ),
    **dict.fromkeys(
        ("head_dim", "d_head", "d_kv", "dim_head", "attention_head_dim", "swa_head_dim", "kv_channels",
         "attention_head_size", "qk_head_dim", "v_head_dim", "index_head_dim", "linear_key_head_dim",
         "linear_value_head_dim", "linear_head_dim"),
        HEAD_DIM,
    ),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    **dict.fromkeys(("kv_lora_rank", "o_lora_rank"), 16),
    "q_lora_rank": 32,
    **dict.fromkeys(("index_n_heads", "linear_num_key_heads"), 2),
    "linear_num_value_heads": 4,
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token"), 2),
    **dict.fromkeys(("n_group", "num_expert_group", "topk_group"), 1),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers"), 1),
    **dict.fromkeys(
        ("max_position_embeddings", "n_positions", "n_ctx", "max_source_positions", "max_target_positions",
         "context_length", "max_seq_len"),
        512,
    ),
    **dict.fromkeys(("mamba_d_state", "state_size", "ssm_state_size"), 16),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), 8),
    **dict.fromkeys(("mamba_d_head", "mamba_head_dim", "mamba_headdim"), 16),
    **dict.fromkeys(("mamba_n_groups", "mamba_ngroups", "n_groups"), 1),
    **dict.fromkeys(("time_step_rank", "mamba_dt_rank"), 8),
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "swa_num_key_value_heads": 2,
    "num_query_groups": 2,
    "laurel_rank": 8,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": VOCAB,
    "ple_embed_dim": 8,
}
# defaults some config classes leave at None although their model needs a number
_FILL_NONE = {"head_dim": HEAD_DIM, "num_key_value_heads": 2, "num_experts_per_tok": 2}
# BLT's hash n-gram table (500,002 rows by default: 192M parameters, ~12 s of the coverage sweep to build and copy)
_VOCABS = ("vocab_size", "decoder_vocab_size", "unpadded_vocab_size", "ngram_vocab_size_base",
           "encoder_hash_byte_group_vocab")
_WINDOWS = ("sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len")
WINDOW = 4
# config defaults transformers ships that cannot build a model as they are (checked on 5.24)
_TYPE_FIXES: dict[str, dict[str, Any]] = {
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},  # DbrxAttention reads both unguarded
    # the Lfm2Config default has attention layers only; LFM2 checkpoints interleave short-convolution layers
    "lfm2": {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3, "full_attn_idxs": [1]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"], "num_hidden_layers": 3, "num_dense_layers": 1},
    # at width 64 the default initialisation leaves attention nearly uniform: a cross-example leak would move the
    # loss by only 4e-4 (modernbert-decoder) / 6e-4 (hy_v4), below the sweep's negative-control floor
    "modernbert-decoder": {"initializer_range": 0.1},
    "hy_v4": {"initializer_range": 0.1},
    # layer kinds set by a period or a cycle, not by a per-layer list: keep one of each kind in the tiny model
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # default: attention every 8th layer (offset 4)
    "recurrent_gemma": {"num_hidden_layers": 3},  # default block cycle: recurrent, recurrent, attention
    # mRoPE vision-language types (swept on text): the three rotary sections split the 8 frequencies of head_dim 16
    **{t: {"text_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
                                               **({"mrope_interleaved": True} if t == "qwen3_vl" else {})}},
           "vision_config": {"depth": 1, **({"deepstack_visual_indexes": [0]} if t == "qwen3_vl" else {})}}
       for t in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")},
}
# Other layer kinds a type's config can switch on (its defaults leave them off): the coverage sweep builds each
# variant too and a type is exact only if every variant is. name -> config overrides (applied after the fixes).
TYPE_VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "granitemoehybrid": {
        "attention": {"layer_types": ["linear_attention", "attention"]},  # Granite 4.0-H: Mamba2 + attention
        # Granite 4.0-H-Micro: dense MLPs, no router (and no load-balancing loss to train)
        "dense": {"layer_types": ["linear_attention", "attention"], "num_local_experts": 0, "router_aux_loss_coef": 0.0},
    },
    "bamba": {"attention": {"attn_layer_indices": [1]}},
    "qwen3_5_text": {"all_linear": {"layer_types": ["linear_attention", "linear_attention"], "num_hidden_layers": 2}},
}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers")


def _is_random(key: str) -> bool:
    """Dropout-like settings (attn_pdrop, hidden_dropout_prob, router_jitter_noise...)."""
    return any(k in key for k in ("dropout", "pdrop", "drop_prob", "layerdrop", "jitter"))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_selection(values: dict[str, Any], n_layers: int) -> list[int] | None:
    """Indices of the layers to keep: the first layer of every kind any per-layer list holds (at least 2)."""
    if n_layers <= 2:
        return None
    keep: set[int] = set()
    for v in values.values():
        if isinstance(v, (list, tuple)) and len(v) == n_layers:
            seen: dict[str, int] = {}
            for i, item in enumerate(v):
                seen.setdefault(repr(item), i)
            keep.update(seen.values())
        elif _is_layer_index_list(v, n_layers):
            keep.add(v[0])
            rest = [i for i in range(n_layers) if i not in v]
            if rest:
                keep.add(rest[0])
    keep.update(range(2))
    picked = sorted(keep)
    return picked[:4]


def _is_layer_index_list(v: Any, n_layers: int) -> bool:
    return isinstance(v, (list, tuple)) and 0 < len(v) < n_layers and all(_is_int(i) and 0 <= i < n_layers for i in v)


def _token_id_names(values: dict[str, Any]) -> list[str]:
    return [k for k in values if k.endswith(("_token_id", "_token_index", "token_id", "_index")) and k != "layer_index"]


def shrink_values(values: dict[str, Any]) -> dict[str, Any]:
    """Tiny overrides for one config's ``to_dict()`` values (not recursing into sub-configs)."""
    out: dict[str, Any] = {}
    n_layers = next((values[k] for k in _LAYER_COUNTS if _is_int(values.get(k))), None)
    selection = _layer_selection(values, n_layers) if n_layers else None
    for key, value in values.items():
        if value is None and key in _FILL_NONE:
            out[key] = _FILL_NONE[key]
        elif _is_int(value) and key in _SIZES and value > _SIZES[key]:
            out[key] = _SIZES[key]
        elif _is_int(value) and key in _VOCABS and value > VOCAB:
            out[key] = VOCAB
        elif _is_int(value) and key in _WINDOWS and value > WINDOW:
            out[key] = WINDOW
        elif isinstance(value, float) and value > 0 and _is_random(key):
            out[key] = 0.0  # the sweep compares two forwards: no randomness
    if n_layers and selection is not None:
        for k in _LAYER_COUNTS:
            if _is_int(values.get(k)):
                out[k] = len(selection)
        remap = {old: new for new, old in enumerate(selection)}
        for key, value in values.items():
            if isinstance(value, (list, tuple)) and len(value) == n_layers:
                out[key] = [value[i] for i in selection]
            elif _is_layer_index_list(value, n_layers) and any(k in key for k in ("idx", "indices", "layers")):
                out[key] = [remap[i] for i in value if i in remap]
            elif key == "per_layer_config" and isinstance(value, dict):
                out[key] = {remap[int(i)]: {**c, **shrink_values(c)} for i, c in value.items() if int(i) in remap}
    if _is_int(values.get("qk_rope_head_dim")) and _is_int(values.get("head_dim")):
        out["head_dim"] = out.get("qk_rope_head_dim", values["qk_rope_head_dim"])  # MLA: head_dim is the rope part
    if _is_int(values.get("rotary_dim")) and values["rotary_dim"] > HEAD_DIM // 2:
        out["rotary_dim"] = HEAD_DIM // 2
    if _is_int(values.get("expand")) and _is_int(values.get("num_heads")) and _is_int(values.get("head_dim")):
        out["num_heads"] = values["expand"] * WIDTH // out.get("head_dim", values["head_dim"])  # SSM heads
    if values.get("num_key_value_heads") is not None and values.get("num_key_value_heads") == values.get(
        "num_attention_heads"
    ):
        out["num_key_value_heads"] = out.get("num_attention_heads", values["num_attention_heads"])
    for key in _token_id_names(values):
        v = values[key]
        if _is_int(v) and v >= VOCAB:
            out[key] = VOCAB - 1 - (abs(hash(key)) % 8)
        elif isinstance(v, list) and all(_is_int(x) for x in v) and any(x >= VOCAB for x in v):
            out[key] = [x if x < VOCAB else VOCAB - 1 - i for i, x in enumerate(v)]
    if "use_cache" in values:
        out["use_cache"] = True  # the config default of most causal LMs: the KV-cache hole must stay covered
    return out


def tiny_config(model_type: str, variant: str | None = None):
    """A tiny ``PreTrainedConfig`` of ``model_type`` (its defaults, shrunk; with the overrides of
    ``TYPE_VARIANTS[model_type][variant]`` when given); raises if the class rejects it."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    base = config_cls()
    fixes = dict(_TYPE_FIXES.get(model_type, {}))
    if variant is not None:
        fixes.update(TYPE_VARIANTS[model_type][variant])
    return _shrink_config(config_cls, base, fixes)


def _shrink_config(config_cls, base, fixes: dict[str, Any]):
    values = base.to_dict()
    overrides = shrink_values(values)
    for key, value in values.items():
        if isinstance(value, dict) and key.endswith("_config") and key != "per_layer_config":
            overrides[key] = shrink_values(value)  # the sub-config class fills in its own defaults
    for key, value in fixes.items():
        overrides[key] = {**overrides.get(key, {}), **value} if isinstance(value, dict) else value
    overrides.pop("model_type", None)
    overrides.pop("transformers_version", None)
    overrides.pop("architectures", None)
    config = config_cls(**overrides)
    config.use_cache = True if hasattr(config, "use_cache") else getattr(config, "use_cache", None)
    return config


def causal_lm_class(model_type: str):
    """The class ``AutoModelForCausalLM`` maps ``model_type`` to (for a vision-language type it does not map, the
    ``AutoModelForImageTextToText`` class: Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type]
    return getattr(transformers, name)


def tiny_model(model_type: str, *, seed: int = 0, variant: str | None = None):
    """A tiny, randomly initialised causal LM of ``model_type`` in float32 (``AutoModelForCausalLM``'s class).

    When that class takes another config class than the type's own (a multimodal wrapper type mapped to its text
    causal LM, e.g. ``qwen3_5`` -> ``Qwen3_5ForCausalLM``), the wrapper's text config is used, as
    ``AutoModelForCausalLM.from_config`` does.
    """
    import torch

    model_cls = causal_lm_class(model_type)
    config = tiny_config(model_type, variant)
    wanted = getattr(model_cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted) and hasattr(config, "get_text_config"):
        text = config.get_text_config()
        if isinstance(text, wanted):
            config = text
    torch.manual_seed(seed)
    model = model_cls(config)
    return model.float()
