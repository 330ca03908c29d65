"""Vision-language examples: TRL's VLM data format -> shard rows with their images -> model features.

Pretokenize (:func:`tokenize_batch`, called by :func:`pf_trl.data.pretokenize.pretokenize` for a source with an
``images`` or ``image`` column) runs each row through TRL's own ``DataCollatorForVisionLanguageModeling`` with the
model's processor, one example at a time, so the token ids, the expanded image placeholders and the labels are what a
padded TRL run computes:

- ``messages`` (+ ``images``): the chat rendered by the processor's template; with ``assistant_only_loss`` (pf-trl's
  default) loss on the assistant turns (its ``{% generation %}`` blocks; a template without them is replaced by TRL's
  training variant of it when TRL knows it, else refused); with ``assistant_only_loss=False`` (TRL's default) on
  every token, as TRL's collator computes it, with the processor's own template;
- ``prompt`` / ``completion`` (conversational or plain strings, + ``images``): loss on the completion
  (``completion_only_loss=False``: on everything).

Each shard row keeps ``input_ids``, ``labels``, ``length`` (image tokens included: the token budget counts what the
model processes), the row's images as encoded bytes (``images``: the original file bytes, or PNG for decoded
images; a path is read only inside the allowed roots and below a size limit) and the processor's per-token modality
ids (``mm_token_type_ids`` for Qwen-VL, ``token_type_ids`` for Gemma 3). A row whose truncation would cut an image is
dropped (counted as too long), never cut through.

Training (:class:`VisionFeatures`, in the DataLoader) decodes a row's images and runs the processor's image processor
on them: ``pixel_values`` / ``image_grid_thw`` per example, checked against the row's image tokens; the collator then
concatenates them in example order.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pf_trl.data.bookkeeping import KEEP, TOO_LONG, append_row, bookkeeping_features, new_batch, supervised
from pf_trl.data.formats import FormatError
from pf_trl.data.image_tokens import IMAGE_KEYS, TOKEN_TYPE_KEYS, image_groups
from pf_trl.data.options import PretokenizeError
from pf_trl.data.processor import is_processor, text_tokenizer  # noqa: F401 (text_tokenizer re-exported)

IMAGE_COLUMNS = ("images", "image")
# columns a vision shard carries besides input_ids / labels / length
VISION_COLUMNS = ("images", *TOKEN_TYPE_KEYS)
MAX_IMAGE_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1024 * 1024



class VisionDataError(FormatError):
    """A vision-language row cannot be used; the message names the row and the fix."""


def image_column(column_names: Sequence[str]) -> str | None:
    """``images`` or ``image`` when present (TRL's rule for a vision dataset), else None."""
    return next((c for c in IMAGE_COLUMNS if c in column_names), None)


# ------------------------------------------------------------------------------------------------ images


@dataclass(frozen=True)
class ImagePolicy:
    """Where image files may be read from and how large they may be.

    Attributes:
        roots: directories an image path must resolve into (symlinks followed); relative paths are resolved against
            the first one (the data file's directory).
        max_bytes: largest encoded image accepted.
        max_pixels: largest decoded image (width x height) accepted.
    """

    roots: tuple[str, ...] = ()
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS

    def read_path(self, value: str, index: int) -> bytes:
        if not self.roots:
            raise VisionDataError(f"row {index}: image {value!r} is a path, but this source has no data root to read "
                                  "it from; embed the image (bytes or a datasets Image column)")
        base = Path(self.roots[0])
        try:
            path = (base / value).resolve() if not os.path.isabs(value) else Path(value).resolve()
        except (OSError, ValueError) as exc:  # a NUL byte, a symlink loop...
            raise VisionDataError(f"row {index}: image path {value!r:.200} is not usable ({exc})") from exc
        if not any(path.is_relative_to(Path(root).resolve()) for root in self.roots):
            raise VisionDataError(f"row {index}: image {value!r} lies outside the data roots "
                                  f"({', '.join(self.roots)}); keep images under the data directory")
        if not path.is_file():
            raise VisionDataError(f"row {index}: image {value!r} not found (looked at {path})")
        size = path.stat().st_size
        if size > self.max_bytes:
            raise VisionDataError(f"row {index}: image {value!r} has {size} bytes, above the {self.max_bytes}-byte "
                                  "limit; downscale it")
        try:
            return path.read_bytes()
        except OSError as exc:
            raise VisionDataError(f"row {index}: image {value!r} cannot be read ({exc})") from exc


def image_bytes(value: Any, index: int, policy: ImagePolicy) -> bytes:
    """Encoded bytes of one image given as bytes, a datasets ``{"bytes", "path"}`` dict, a PIL image or a path."""
    from PIL import Image

    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        value = data if data is not None else path
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")  # lossless: decoding gives back the same pixels
        data = buffer.getvalue()
    elif isinstance(value, str):
        data = policy.read_path(value, index)
    else:
        raise VisionDataError(f"row {index}: an image must be a path, bytes or a PIL image, got {type(value).__name__}")
    if len(data) > policy.max_bytes:
        raise VisionDataError(f"row {index}: an image has {len(data)} bytes, above the {policy.max_bytes}-byte limit")
    return data


def decode_image(data: bytes, index: int, policy: ImagePolicy | None = None):
    """A PIL image (RGB kept as stored) from encoded bytes, refused beyond ``policy.max_pixels``."""
    from PIL import Image, UnidentifiedImageError

    limit = (policy or ImagePolicy()).max_pixels
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > limit:
            raise VisionDataError(f"row {index}: an image of {image.width}x{image.height} pixels is above the "
                                  f"{limit}-pixel limit; downscale it")
        image.load()
    except VisionDataError:
        raise
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise VisionDataError(f"row {index}: an image cannot be decoded ({exc})") from exc
    return image


def row_images(value: Any) -> list:
    """The images of one row's ``images`` (a list) or ``image`` (one) value."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


# ------------------------------------------------------------------------------------------ pretokenize


def arrow_features(token_type_key: str | None):
    """The Arrow schema of a vision shard (the text columns + ``images`` + the modality ids)."""
    from datasets import Sequence as Seq
    from datasets import Value

    from pf_trl.data.shards import shard_features

    features = shard_features()
    features["images"] = Seq(Value("large_binary"))  # 64-bit offsets: a chunk of large images passes 2 GiB
    if token_type_key is not None:
        features[token_type_key] = Seq(Value("int8"))
    return features


def token_type_key(processor) -> str | None:
    """Which per-token modality ids the processor emits (``mm_token_type_ids``, ``token_type_ids`` or none)."""
    out = processor(text=["a"], return_tensors="np")
    return next((k for k in TOKEN_TYPE_KEYS if k in out), None)


def _collator(processor, *, assistant_only: bool, completion_only: bool, text_field: str, chat_template: str | None):
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    return DataCollatorForVisionLanguageModeling(
        processor=processor, max_length=None, completion_only_loss=completion_only, dataset_text_field=text_field,
        assistant_only_loss=assistant_only, chat_template=chat_template)


def training_chat_template(processor) -> str | None:
    """The template whose ``{% generation %}`` blocks mark the assistant turns: the processor's own, else TRL's
    training variant of it; None (refused by the caller) when neither exists."""
    from pf_trl.data.formats import has_generation_blocks

    if has_generation_blocks(getattr(processor, "chat_template", None)):
        return None  # the processor's own
    try:
        from trl.chat_template_utils import get_training_chat_template

        template = get_training_chat_template(processor)
    except Exception as exc:  # an unknown template: TRL has no training variant
        raise VisionDataError(
            "the processor's chat template has no {% generation %} blocks, so the assistant turns of a multimodal "
            "conversation cannot be told apart, and TRL has no training variant of it "
            f"({str(exc).splitlines()[0][:120]}); pass a template with generation blocks (--chat_template FILE), or "
            "--assistant_only_loss False (TRL's default) to train every token"
        ) from exc
    return template


@dataclass
class VisionTokenizer:
    """One batch of source rows -> shard rows, through TRL's VLM collator (see the module docstring)."""

    processor: Any
    image_column: str
    token_type_key: str | None
    policy: ImagePolicy = field(default_factory=ImagePolicy)
    chat_template: str | None = None  # :func:`training_chat_template` (None: the processor's own)
    completion_only_loss: bool = True
    text_field: str = "text"
    assistant_only_loss: bool = True  # False: every token of a conversation (TRL's default)

    def row(self, example: dict[str, Any], index: int) -> tuple[list[int], list[int], list[bytes], list[int] | None]:
        """``(input_ids, labels, image bytes, modality ids)`` of one source row."""
        import copy

        images = [image_bytes(v, index, self.policy) for v in row_images(example.get(self.image_column))]
        decoded = [decode_image(b, index, self.policy) for b in images]
        if "messages" in example and example["messages"] is not None:
            data = {"messages": copy.deepcopy(example["messages"]), "images": decoded}
            collator = _collator(self.processor, assistant_only=self.assistant_only_loss, completion_only=False,
                                 text_field=self.text_field,
                                 chat_template=self.chat_template if self.assistant_only_loss else None)
        elif example.get("prompt") is not None and example.get("completion") is not None:
            data = {"prompt": copy.deepcopy(example["prompt"]), "completion": copy.deepcopy(example["completion"]),
                    "images": decoded}
            collator = _collator(self.processor, assistant_only=False, completion_only=self.completion_only_loss,
                                 text_field=self.text_field, chat_template=None)
        else:
            raise VisionDataError(
                f"row {index}: a vision row needs 'messages' or 'prompt' + 'completion' beside its "
                f"{self.image_column!r} (TRL's vision-language formats)")
        try:
            out = collator([data])
        except VisionDataError:
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise VisionDataError(
                f"row {index}: the processor rejects it ({type(exc).__name__}: {first[:200]})") from exc
        ids = out["input_ids"][0].tolist()
        labels = out["labels"][0].tolist()
        types = out[self.token_type_key][0].tolist() if self.token_type_key in out else None
        return ids, labels, images, types


def cuts_an_image(types: list[int] | None, keep: int) -> bool:
    """True when keeping the first ``keep`` tokens would cut off (part of) an image."""
    return types is not None and any(t != 0 for t in types[keep:])


# ------------------------------------------------------------------------------------------------ training


def expected_image_tokens(processor, pixel_outputs: dict[str, Any], count: int) -> int | None:
    """Image placeholder tokens the model expects for ``count`` images (None when the processor does not say)."""
    grid = pixel_outputs.get("image_grid_thw")
    merge = getattr(processor.image_processor, "merge_size", None)
    if grid is not None and merge:
        return int(grid.prod(-1).sum()) // int(merge) ** 2
    per_image = getattr(processor, "image_seq_length", None)
    return None if per_image is None else int(per_image) * count


class VisionFeatures:
    """A shard row -> the features the model reads: images decoded and run through the processor's image processor.

    Called on each row in the DataLoader (workers included), before
    :class:`~pf_trl.batching.collator.PaddingFreeCollator` packs the batch. A row whose image tokens do not match its
    images is refused with its index.
    """

    def __init__(self, processor, policy: ImagePolicy | None = None) -> None:
        if not is_processor(processor):
            raise VisionDataError(
                f"the data has images, but processing_class is a {type(processor).__name__}: pass the model's "
                "processor (AutoProcessor) so that its images become pixel values")
        self.processor = processor
        self.policy = policy or ImagePolicy()

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in row.items() if k != "images"}
        images = row.get("images") or []
        types_key = next((k for k in TOKEN_TYPE_KEYS if k in row), None)
        if not images:
            return out
        decoded = [decode_image(b, -1, self.policy) for b in images]
        pixels = self.processor.image_processor(images=decoded, return_tensors="pt")
        out.update({k: pixels[k] for k in IMAGE_KEYS if k in pixels})
        if types_key is not None:
            import torch

            types = torch.as_tensor(row[types_key])
            found, tokens = image_groups(types), int((types == 1).sum())
            expected = expected_image_tokens(self.processor, pixels, len(decoded))
            if found != len(decoded) or (expected is not None and expected != tokens):
                raise VisionDataError(
                    f"a shard row has {len(decoded)} images but {found} image spans ({tokens} image tokens, expected "
                    f"{expected}): the shards were made with another processor; re-run pretokenize with the model's")
        return out


# ------------------------------------------------------------------------------- pretokenize: one batch


def undecoded(dataset, column: str):
    """``dataset`` with its datasets ``Image`` column left encoded (the original bytes are stored, not re-encoded)."""
    from datasets import Image, List

    feature = dataset.features.get(column)
    inner = getattr(feature, "feature", feature)
    if isinstance(inner, Image) and inner.decode:
        target = List(Image(decode=False)) if feature is not inner else Image(decode=False)
        return dataset.cast_column(column, target)
    return dataset


def tokenize_batch(batch: dict[str, list], indices: list[int], *, vision: VisionTokenizer, config,
                   index_offset: int):
    """``datasets.map`` function of a vision source: rows -> shard rows plus the bookkeeping columns of
    :mod:`pf_trl.data.bookkeeping` (as :func:`pf_trl.data.pretokenize._tokenize_batch` writes them)."""
    import pyarrow as pa

    keys = list(batch)
    extra = ("images",) if vision.token_type_key is None else ("images", vision.token_type_key)
    out = new_batch(*extra)
    limit = config.max_seq_len
    for pos, index in enumerate(i + index_offset for i in indices):
        ids, labels, images, types = vision.row({k: batch[k][pos] for k in keys}, index)
        drop, truncated = KEEP, False
        before = supervised(labels)
        if len(ids) > limit:
            if config.truncation in ("refuse", "error"):
                raise PretokenizeError(f"row {index} has {len(ids)} tokens (images included) > max_seq_len {limit} and "
                                       "truncation='refuse'; raise max_seq_len or use truncation 'truncate' or 'drop'",
                                       "max_seq_len")
            if config.truncation == "truncate" and getattr(config, "truncation_mode", "keep_start") != "keep_start":
                raise PretokenizeError(f"row {index} has {len(ids)} tokens (images included) > max_seq_len {limit}: "
                                       "vision rows are cut at the end only (truncation_mode 'keep_start'; keeping the "
                                       "end would cut the prompt's images); use keep_start, drop, or a larger "
                                       "max_seq_len", "truncation_mode")
            if config.truncation == "drop" or cuts_an_image(types, limit):
                drop = TOO_LONG  # never cut through an image: its pixels would have no tokens left
            else:
                ids, labels, truncated = ids[:limit], labels[:limit], True
                types = types[:limit] if types is not None else None
        values = {"images": images}
        if vision.token_type_key is not None:
            values[vision.token_type_key] = types if types is not None else [0] * len(ids)
        # vision rows are tokenized whole (cut=False)
        append_row(out, ids, labels, drop=drop, truncated=truncated, before=before, drop_no_loss=config.drop_no_loss,
                   cut=False, **values)
    return pa.Table.from_pydict(out, schema=processing_features(vision.token_type_key).arrow_schema)


def processing_features(token_type_key: str | None):
    """:func:`arrow_features` plus the bookkeeping columns."""
    features = arrow_features(token_type_key)
    features.update(bookkeeping_features())
    return features
