"""Tiny vision-language models and their processors, built offline (tests, benchmarks, the coverage sweep).

Each processor is the model family's own processor class with a small PIL/numpy image processor, the Mistral-7B
v0.1 sentencepiece tokenizer shipped in ``mistral-common`` with the family's special image tokens added, and the
family's real chat template as TRL ships it (its training variant, with ``{% generation %}`` blocks). The model is
built from the family's config with tiny sizes and the token ids of that processor, so
``processor -> model`` works exactly as with a downloaded checkpoint, and nothing touches a hub.

Families: ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl`` (3-D mRoPE, images as patch sequences with ``image_grid_thw``)
and ``gemma3`` (SigLIP tower, a fixed number of tokens per image, bidirectional attention inside an image).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3")

_QWEN_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_GEMMA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
_GEMMA_TURN = ["<start_of_turn>", "<end_of_turn>"]
# TRL's copy of each family's chat template (training variant: assistant turns inside {% generation %} blocks)
_TEMPLATES = {"qwen2_vl": "qwen2_5_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "gemma3": "gemma3"}
# weights large enough that a tiny random model depends visibly on its context (positions, images, neighbours)
INIT_RANGE = 0.2
# Gemma 3: a 28x28 image, 14-pixel patches -> 2x2 patches, pooled to 4 tokens per image
GEMMA_IMAGE_SIZE = 28
GEMMA_TOKENS_PER_IMAGE = 4


def _check_type(model_type: str) -> None:
    if model_type not in VLM_TYPES:
        raise ValueError(f"no tiny vision-language builder for {model_type!r}; choose one of {', '.join(VLM_TYPES)}")


def chat_template(model_type: str, *, training: bool = True) -> str:
    """The family's chat template as TRL ships it (``training``: the variant with ``{% generation %}`` blocks)."""
    import trl

    _check_type(model_type)
    name = _TEMPLATES[model_type] + ("_training" if training else "")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def _qwen_processor_class(model_type: str):
    """The family's processor class, accepting ``video_processor=None``.

    The Qwen processors declare a video processor, whose classes need torchvision; pf-trl's environments run without
    it (PyPI's torchvision does not load beside the CPU torch build). Images never touch the video processor, so the
    subclass only lets the missing one through the constructor's type check.
    """
    import transformers

    base = {
        "qwen2_vl": transformers.Qwen2VLProcessor,
        "qwen2_5_vl": transformers.Qwen2_5_VLProcessor,
        "qwen3_vl": transformers.Qwen3VLProcessor,
    }[model_type]

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return base.check_argument_for_proper_class(self, argument_name, argument)

    return type(base.__name__, (base,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                         "__module__": base.__module__})


def _with_named_tokens(tokenizer, named: dict[str, str], extra: list[str]):
    """``tokenizer`` with ``named`` special tokens (``tokenizer.boi_token`` ...) and ``extra`` ones added, the way a
    checkpoint declares them: ``extra_special_tokens`` in its ``tokenizer_config.json``, saved and reloaded."""
    import json
    import tempfile

    from transformers import AutoTokenizer

    tokenizer.add_tokens([*named.values(), *extra], special_tokens=True)
    with tempfile.TemporaryDirectory(prefix="pf-trl-tiny-vlm-") as folder:
        tokenizer.save_pretrained(folder)
        config_path = Path(folder) / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8"))
        config["extra_special_tokens"] = dict(named)
        config_path.write_text(json.dumps(config), encoding="utf-8")
        loaded = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        loaded.pad_token = tokenizer.pad_token
        return loaded


def tiny_processor(model_type: str):
    """The family's processor: a small PIL image processor, the Mistral v1 tokenizer + the family's image tokens,
    and the family's chat template (TRL's training variant)."""
    from pf_trl.data.tokenizer import load_tokenizer

    _check_type(model_type)
    tokenizer = load_tokenizer()
    tokenizer.pad_token = tokenizer.unk_token
    if model_type == "gemma3":
        from transformers import Gemma3Processor
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        tokenizer = _with_named_tokens(tokenizer, _GEMMA_TOKENS, _GEMMA_TURN)
        image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA_IMAGE_SIZE, "width": GEMMA_IMAGE_SIZE})
        return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                               chat_template=chat_template(model_type), image_seq_length=GEMMA_TOKENS_PER_IMAGE)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer.add_special_tokens({"additional_special_tokens": _QWEN_TOKENS})
    patch = 16 if model_type == "qwen3_vl" else 14
    unit = (patch * 2) ** 2  # one merged token
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                               size={"shortest_edge": 4 * unit, "longest_edge": 24 * unit})
    return _qwen_processor_class(model_type)(image_processor=image_processor, tokenizer=tokenizer,
                                             video_processor=None, chat_template=chat_template(model_type))


def tiny_vlm_config(model_type: str, processor, *, hidden_size: int = 64, num_hidden_layers: int = 2):
    """A tiny config of ``model_type`` whose special token ids are those of ``processor``'s tokenizer (the language
    model's width and depth can be raised, e.g. for a benchmark)."""
    import transformers

    _check_type(model_type)
    tok = processor.tokenizer
    vocab = len(tok)
    text: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                                num_hidden_layers=num_hidden_layers,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, initializer_range=INIT_RANGE)
    if model_type == "gemma3":
        text.update(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                    query_pre_attn_scalar=16)
        vision = dict(initializer_range=INIT_RANGE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=GEMMA_IMAGE_SIZE, patch_size=14)
        return transformers.Gemma3Config(
            text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA_TOKENS_PER_IMAGE,
            boi_token_index=tok.convert_tokens_to_ids(_GEMMA_TOKENS["boi_token"]),
            eoi_token_index=tok.convert_tokens_to_ids(_GEMMA_TOKENS["eoi_token"]),
            image_token_index=tok.convert_tokens_to_ids(_GEMMA_TOKENS["image_token"]),
            initializer_range=INIT_RANGE,
        )
    ids = dict(
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    # the three mRoPE sections (temporal, height, width) split the rotary frequencies of a head
    if model_type == "qwen3_vl":
        text.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3], "mrope_interleaved": True})
        vision = dict(initializer_range=INIT_RANGE, depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      patch_size=16, out_hidden_size=hidden_size, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, initializer_range=INIT_RANGE, **ids)
    half = hidden_size // 4 // 2  # rotary frequencies of one head (4 heads), split 1:1.5:1.5 as Qwen2-VL's 16/24/24
    section = [half // 4, (half - half // 4) // 2, half - half // 4 - (half - half // 4) // 2]
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    if model_type == "qwen2_5_vl":
        vision = dict(initializer_range=INIT_RANGE, depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=hidden_size, window_size=56, fullatt_block_indexes=[1])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, initializer_range=INIT_RANGE,
                                             **ids)
    vision = dict(initializer_range=INIT_RANGE, depth=1, embed_dim=32, hidden_size=hidden_size, num_heads=2)
    return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, initializer_range=INIT_RANGE, **ids)


def tiny_vlm(model_type: str, processor=None, *, seed: int = 0, **sizes: int):
    """A tiny, randomly initialised ``<Family>ForConditionalGeneration`` in float32 (and its processor when none is
    given): ``(model, processor)``. ``sizes``: ``hidden_size`` / ``num_hidden_layers`` of the language model."""
    import torch
    import transformers

    processor = processor if processor is not None else tiny_processor(model_type)
    config = tiny_vlm_config(model_type, processor, **sizes)
    cls = {
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "gemma3": transformers.Gemma3ForConditionalGeneration,
    }[model_type]
    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    model = cls(config).float()
    if model_type == "gemma3":  # its projector starts at zero (images would not reach the text): give it weights
        with torch.no_grad():
            model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, INIT_RANGE)
    return model, processor


def random_images(count: int, *, seed: int = 0, sizes: tuple[tuple[int, int], ...] = ((56, 84), (84, 56), (56, 56),
                                                                                       (112, 84))):
    """``count`` small RGB PIL images of varied sizes (random pixels, reproducible)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)
    out = []
    for i in range(count):
        h, w = sizes[i % len(sizes)]
        out.append(Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)))
    return out
