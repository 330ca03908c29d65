"""Input formats -> (input_ids, labels).

Every text format is reduced to the same shape: a rendered string plus the character spans that carry
loss. The string is tokenized once with offsets, and a token is supervised when its first character lies
inside a supervised span. Character-level matching is robust where token-level template matching (TRL's
completion-only collator) is not: sentencepiece tokenizes "### Response:" differently after a newline.

Formats:
- ``pretokenized``: ``input_ids`` and optional ``labels`` columns (the fms-acceleration
  ``alpaca-pretokenized-mistral.json`` shape);
- ``text``: one text field plus ``response_template``: loss on everything after the *last* occurrence of
  the template (what TRL's ``DataCollatorForCompletionOnlyLM`` does);
- ``prompt_completion``: ``prompt`` and ``completion`` columns: loss on the completion;
- ``messages``: chat ``messages`` (``role``/``content``, or ShareGPT's ``from``/``value``) rendered with the
  tokenizer's chat template: loss on assistant turns only;
- ``conversational_prompt_completion``: TRL's conversational prompt-completion (``prompt`` and ``completion`` are
  lists of messages): loss on the completion's assistant turns;
- ``alpaca``: ``instruction`` / optional ``input`` / ``output``, rendered with the standard Alpaca prompt (the
  variant with or without ``### Input:``): loss on ``output``;
- ``sharegpt``: ``conversations`` (``from``: system/human/gpt, ``value``; ``role``/``content`` spellings too),
  rendered like ``messages``.

Chat masks: when the chat template marks assistant text with ``{% generation %}`` blocks, those blocks are the
supervised spans (what TRL's ``assistant_only_loss`` uses); otherwise each assistant turn's span is what rendering
it adds to the rendering of the conversation before it (prefix rendering).

TRL's mask columns on tokenized rows (``completion_mask``, ``assistant_masks``: 1 = loss) become labels: a token
keeps its label only where every mask present is 1 and ``labels`` (when given) is not -100 (the intersection).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pf_trl.data.labels import IGNORE_INDEX
from pf_trl.errors import PfTrlError

FORMATS = ("pretokenized", "text", "prompt_completion", "messages", "conversational_prompt_completion", "alpaca",
           "sharegpt")
MASK_COLUMNS = ("completion_mask", "assistant_masks")

# The standard Stanford Alpaca prompts (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT).
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
# ShareGPT speaker names -> chat roles.
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant", "tool": "tool",
}
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class FormatError(PfTrlError, ValueError):
    """A row does not fit the declared input format. The message names the row and the fix; ``option`` names the
    data option to change, when one is the fix."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class FieldNames:
    """Column names read by each format."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"
    input_ids: str = "input_ids"
    labels: str = "labels"
    instruction: str = "instruction"
    input: str = "input"
    output: str = "output"
    conversations: str = "conversations"


def required_columns(input_format: str, fields: FieldNames) -> tuple[str, ...]:
    """Columns a source must have for ``input_format``."""
    return {
        "pretokenized": (fields.input_ids,),
        "text": (fields.text,),
        "prompt_completion": (fields.prompt, fields.completion),
        "conversational_prompt_completion": (fields.prompt, fields.completion),
        "messages": (fields.messages,),
        "alpaca": (fields.instruction, fields.output),
        "sharegpt": (fields.conversations,),
    }[input_format]


def detect_format(
    columns: Sequence[str], fields: FieldNames, response_template: str | None, first_row: dict[str, Any] | None = None
) -> str:
    """Pick the input format from the columns present (and the first row's shape for prompt/completion)."""
    cols = set(columns)
    if fields.input_ids in cols:
        return "pretokenized"
    if fields.messages in cols:
        return "messages"
    if fields.conversations in cols:
        return "sharegpt"
    if fields.prompt in cols and fields.completion in cols:
        if first_row is not None and isinstance(first_row.get(fields.prompt), list):
            return "conversational_prompt_completion"
        return "prompt_completion"
    if fields.instruction in cols and fields.output in cols:
        return "alpaca"
    if fields.text in cols:
        if not response_template:
            raise FormatError(
                f"column {fields.text!r} found but no response_template: pass --response_template "
                "(e.g. '### Response:'; in Python PretokenizeConfig(response_template=...)) so pf-trl knows where the "
                "loss starts", "response_template"
            )
        return "text"
    raise FormatError(
        f"cannot detect the input format from columns {sorted(cols)}: expected {fields.input_ids!r}, "
        f"{fields.messages!r}, {fields.conversations!r} (ShareGPT), {fields.prompt!r}+{fields.completion!r}, "
        f"{fields.instruction!r}+{fields.output!r} (Alpaca), or a text column with --response_template; "
        "name the columns with --text_field / --prompt_field / ... or pass --input_format"
    )


def _span_token_range(encoding, start: int, end: int) -> tuple[int, int]:
    """Token indices [a, b) whose first character lies in [start, end) (offsets are monotonic).

    Uses the Rust-side char -> token map, so it costs O(1) per span instead of a Python pass over tokens.
    """
    n = len(encoding.ids)
    a = None
    for c in range(start, end):  # the first characters may be whitespace that no token covers
        t = encoding.char_to_token(c)
        if t is not None:
            a = t if encoding.token_to_chars(t)[0] >= start else t + 1  # a token straddling `start` is prompt
            break
    if a is None:
        return 0, 0
    b = None
    for c in range(end - 1, start - 1, -1):
        t = encoding.char_to_token(c)
        if t is not None:
            b = t + 1
            break
    return a, max(a, min(b if b is not None else a, n))


def encode_spans(
    tokenizer, texts: list[str], spans: list[list[tuple[int, int]]], *, add_special_tokens: bool
) -> tuple[list[list[int]], list[list[int]]]:
    """Tokenize rendered texts and supervise the tokens whose first character is inside a span.

    Calls the fast tokenizer's Rust backend directly: the same ids as ``tokenizer(texts)`` without
    transformers' per-row Python conversion, which made up a third of the time.
    """
    ids, labels, _ = encode_spans_capped(tokenizer, texts, spans, add_special_tokens=add_special_tokens)
    return ids, labels


# A text is cut before tokenizing when it is far longer than `max_tokens` tokens can span: tokenizing 5 MB to keep
# 1,024 tokens took minutes (BPE over one long pre-token). The cut is checked, not assumed (see _encode_prefix).
_CUT_MARGIN_TOKENS = 16
_max_token_chars_memo: dict[int, tuple[object, int]] = {}


def _max_token_chars(tokenizer) -> int:
    """The longest vocabulary entry in characters (clamped to 8..256): how many characters one token can span."""
    backend = tokenizer.backend_tokenizer
    hit = _max_token_chars_memo.get(id(tokenizer))
    if hit is not None and hit[0] is backend:
        return hit[1]
    longest = max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=64)
    value = min(max(longest, 8), 256)
    _max_token_chars_memo[id(tokenizer)] = (backend, value)
    return value


def _encode_prefix(backend, text: str, max_tokens: int, token_chars: int, add_special_tokens: bool):
    """An encoding of a prefix of ``text`` whose first ``max_tokens`` tokens (ids and offsets) are those of the whole
    text, or None when the text is short enough to tokenize whole or the cut cannot be shown harmless.

    The prefix spans ``max_tokens + 16`` tokens of the longest kind. It is accepted only when it yields more than
    that many tokens and a prefix twice as long yields the same first ones: what lies past the cut did not change
    them (a normalizer that deletes text, a merge reaching across the cut: the whole text is tokenized instead).
    """
    need = max_tokens + _CUT_MARGIN_TOKENS
    cut = need * token_chars + 256
    if len(text) <= 2 * cut:
        return None
    short = backend.encode(text[:cut], add_special_tokens=add_special_tokens)
    if len(short.ids) < need + 2:
        return None
    longer = backend.encode(text[: 2 * cut], add_special_tokens=add_special_tokens)
    if short.ids[:need] != longer.ids[:need] or short.offsets[:need] != longer.offsets[:need]:
        return None
    return short


def encode_spans_capped(
    tokenizer, texts: list[str], spans: list[list[tuple[int, int]]], *, add_special_tokens: bool,
    max_tokens: int | None = None,
) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """:func:`encode_spans`, plus ``max_tokens``: a text much longer than that is tokenized only as far as its first
    ``max_tokens`` tokens need (their ids and labels are those of the whole text; the row then holds more than
    ``max_tokens`` tokens, so truncation and length checks treat it as the whole row). Returns ``(ids, labels,
    cut)``, ``cut[i]`` saying that row ``i`` was tokenized from a prefix (its length is a lower bound)."""
    backend = tokenizer.backend_tokenizer
    encodings: list = [None] * len(texts)
    if max_tokens is not None:
        chars = _max_token_chars(tokenizer)
        for i, text in enumerate(texts):
            if len(text) > 2 * ((max_tokens + _CUT_MARGIN_TOKENS) * chars + 256):
                encodings[i] = _encode_prefix(backend, text, max_tokens, chars, add_special_tokens)
    cut = [e is not None for e in encodings]
    whole = [i for i, e in enumerate(encodings) if e is None]
    if whole:
        for i, enc in zip(whole, backend.encode_batch([texts[i] for i in whole], add_special_tokens=add_special_tokens)):
            encodings[i] = enc
    all_ids, all_labels = [], []
    for enc, row_spans, was_cut in zip(encodings, spans, cut):
        ids = enc.ids
        labels = [IGNORE_INDEX] * len(ids)
        end = enc.offsets[-1][1] if (was_cut and ids) else None
        for s, e in row_spans:
            if end is not None:
                if s >= end:
                    continue
                e = min(e, end)
            a, b = _span_token_range(enc, s, e)
            labels[a:b] = ids[a:b]
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels, cut


def _str_field(row_value: Any, column: str, index: int) -> str:
    if row_value is None:
        raise FormatError(f"row {index}: column {column!r} is null; fill or drop such rows")
    if not isinstance(row_value, str):
        raise FormatError(f"row {index}: column {column!r} must be a string, got {type(row_value).__name__}")
    return row_value


def render_text(
    batch: dict[str, list], indices: list[int], fields: FieldNames, response_template: str
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    texts, spans = [], []
    for value, index in zip(batch[fields.text], indices):
        text = _str_field(value, fields.text, index)
        at = text.rfind(response_template)
        if at < 0:
            raise FormatError(
                f"row {index}: response template {response_template!r} not found in column {fields.text!r}; "
                "check --response_template (exact characters, including spaces) or the text field", "response_template"
            )
        texts.append(text)
        spans.append([(at + len(response_template), len(text))])
    return texts, spans


def render_prompt_completion(
    batch: dict[str, list], indices: list[int], fields: FieldNames
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    texts, spans = [], []
    for prompt, completion, index in zip(batch[fields.prompt], batch[fields.completion], indices):
        p = _str_field(prompt, fields.prompt, index)
        c = _str_field(completion, fields.completion, index)
        texts.append(p + c)
        spans.append([(len(p), len(p) + len(c))])
    return texts, spans


def render_alpaca(
    batch: dict[str, list], indices: list[int], fields: FieldNames
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """The standard Alpaca prompt (with ``### Input:`` when ``input`` is non-empty) + ``output``: loss on ``output``."""
    texts, spans = [], []
    inputs = batch.get(fields.input) or [None] * len(indices)
    for instruction, extra, output, index in zip(batch[fields.instruction], inputs, batch[fields.output], indices):
        instruction = _str_field(instruction, fields.instruction, index)
        output = _str_field(output, fields.output, index)
        if extra is not None and not isinstance(extra, str):
            raise FormatError(f"row {index}: column {fields.input!r} must be a string, got {type(extra).__name__}")
        if extra and extra.strip():
            prompt = ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra)
        else:
            prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)
        texts.append(prompt + output)
        spans.append([(len(prompt), len(prompt) + len(output))])
    return texts, spans


def normalize_messages(messages: Any, column: str, index: int) -> list[dict[str, str]]:
    """Chat messages as ``{"role", "content"}`` dicts; ShareGPT's ``from``/``value`` and speaker names mapped."""
    if not isinstance(messages, list) or not messages:
        raise FormatError(f"row {index}: column {column!r} must be a non-empty list of messages")
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise FormatError(f"row {index}: each message must be an object, got {m!r:.80}")
        role = m.get("role") if m.get("role") is not None else m.get("from")
        content = m.get("content") if m.get("content") is not None else m.get("value")
        if not isinstance(role, str) or not isinstance(content, str):
            raise FormatError(
                f"row {index}: each message needs string 'role' and 'content' (or ShareGPT 'from' and 'value'), "
                f"got {m!r:.80}"
            )
        mapped = SHAREGPT_ROLES.get(role.lower())
        if mapped is None:
            raise FormatError(
                f"row {index}: unknown speaker {role!r}; use one of {', '.join(sorted(SHAREGPT_ROLES))}"
            )
        out.append({"role": mapped, "content": content})
    return out


def has_generation_blocks(chat_template: str | None) -> bool:
    """True when the template marks assistant text with ``{% generation %}`` (TRL's assistant_only_loss needs it)."""
    return bool(chat_template and _GENERATION_TAG.search(chat_template))


def chat_mask_method(tokenizer) -> str:
    """``generation`` (the template's ``{% generation %}`` blocks) or ``prefix`` (prefix rendering)."""
    return "generation" if has_generation_blocks(getattr(tokenizer, "chat_template", None)) else "prefix"


def _render_chat(tokenizer, messages: list[dict[str, str]], first_supervised: int, index: int) -> tuple[str, list]:
    """Render one conversation; spans of the assistant turns at positions >= ``first_supervised``."""
    template = tokenizer.chat_template
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if has_generation_blocks(template):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, indices = render_jinja_template(
            conversations=[messages], chat_template=template, return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        )
        if rendered[0] != full:
            raise FormatError(f"row {index}: the chat template renders differently with generation tracking")
        floor = 0
        if first_supervised:
            floor = len(tokenizer.apply_chat_template(messages[:first_supervised], tokenize=False,
                                                      add_generation_prompt=True))
        return full, [(a, b) for a, b in indices[0] if a >= floor and b > a]
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first_supervised:
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not upto.startswith(before) or not full.startswith(upto):
            raise FormatError(
                f"row {index}: the chat template is not prefix-consistent at message {i}, so the "
                "assistant loss mask cannot be derived; use a template that renders turns in order, or one with "
                "{% generation %} blocks (--chat_template FILE)"
            )
        spans.append((len(before), len(upto)))
    return full, spans


def render_messages(
    tokenizer, batch: dict[str, list], indices: list[int], fields: FieldNames, *, column: str | None = None,
    supervise_all: bool = False,
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """Render chats with the tokenizer's template: loss on assistant turns (see the module docstring for how), or
    with ``supervise_all`` on every character (TRL's ``assistant_only_loss=False``: any template, no mask to derive)."""
    column = column or fields.messages
    _need_template(tokenizer)
    texts, spans = [], []
    for messages, index in zip(batch[column], indices):
        messages = normalize_messages(messages, column, index)
        if supervise_all:
            text = _guard_template(lambda: tokenizer.apply_chat_template(messages, tokenize=False), index)
            texts.append(text)
            spans.append([(0, len(text))])
            continue
        text, row_spans = _guard_template(lambda: _render_chat(tokenizer, messages, 0, index), index)
        if not row_spans:
            raise FormatError(f"row {index}: no assistant message, so nothing to learn; drop the row or add a reply")
        texts.append(text)
        spans.append(row_spans)
    return texts, spans


def render_conversational_prompt_completion(
    tokenizer, batch: dict[str, list], indices: list[int], fields: FieldNames, *, completion_only_loss: bool = True
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """TRL's conversational prompt-completion: ``prompt + completion`` rendered; loss on the completion's replies."""
    _need_template(tokenizer)
    texts, spans = [], []
    for prompt, completion, index in zip(batch[fields.prompt], batch[fields.completion], indices):
        prompt = normalize_messages(prompt, fields.prompt, index)
        completion = normalize_messages(completion, fields.completion, index)
        messages = prompt + completion
        first = len(prompt) if completion_only_loss else 0
        text, row_spans = _guard_template(lambda: _render_chat(tokenizer, messages, first, index), index)
        if not row_spans:
            raise FormatError(f"row {index}: the completion has no assistant message, so nothing to learn")
        texts.append(text)
        spans.append(row_spans)
    return texts, spans


def _need_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise FormatError(
            "chat data needs a chat template and the tokenizer has none; pass one with --chat_template FILE "
            "(in Python PretokenizeConfig(chat_template=...)) or use another format", "chat_template"
        )


def _guard_template(render, index: int):
    try:
        return render()
    except FormatError:
        raise
    except Exception as exc:
        raise FormatError(f"row {index}: chat template failed: {exc}") from exc


def labels_from_masks(ids: list[int], labels: list[int] | None, masks: list[list[int]]) -> list[int]:
    """Labels where every mask is 1 and ``labels`` (if given) is not -100; -100 elsewhere (the intersection)."""
    base = list(ids) if labels is None else list(labels)
    for mask in masks:
        for t, bit in enumerate(mask):
            if not bit:
                base[t] = IGNORE_INDEX
    return base


def read_pretokenized(
    batch: dict[str, list], indices: list[int], fields: FieldNames, vocab_size: int | None,
    mask_columns: Sequence[str] = MASK_COLUMNS,
) -> tuple[list[list[int]], list[list[int]]]:
    """Token rows as given; TRL's mask columns present in ``batch`` are folded into the labels."""
    all_ids, all_labels = [], []
    has_labels = fields.labels in batch
    masks_present = [c for c in mask_columns if c in batch]
    for pos, index in enumerate(indices):
        ids = batch[fields.input_ids][pos]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise FormatError(f"row {index}: {fields.input_ids!r} must be a list of integers")
        if vocab_size is not None and any(t < 0 or t >= vocab_size for t in ids):
            bad = next(t for t in ids if t < 0 or t >= vocab_size)
            raise FormatError(
                f"row {index}: token id {bad} is outside the tokenizer's vocabulary (size {vocab_size}); "
                "the data was tokenized with another tokenizer"
            )
        labels = batch[fields.labels][pos] if has_labels else None
        if labels is None:
            labels = list(ids)
        elif not isinstance(labels, list) or len(labels) != len(ids):
            raise FormatError(
                f"row {index}: {fields.labels!r} must be a list as long as {fields.input_ids!r} "
                f"({len(ids)} tokens), got {len(labels) if isinstance(labels, list) else type(labels).__name__}"
            )
        masks = []
        for column in masks_present:
            mask = batch[column][pos]
            if not isinstance(mask, list) or len(mask) != len(ids):
                raise FormatError(f"row {index}: {column!r} must be a list as long as {fields.input_ids!r} ({len(ids)})")
            masks.append(mask)
        if masks:
            labels = labels_from_masks(ids, labels, masks)
        all_ids.append(ids)
        all_labels.append(labels)
    return all_ids, all_labels
