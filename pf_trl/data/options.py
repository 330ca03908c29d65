"""The data options, declared once: :class:`PretokenizeConfig`.

Every door to :func:`~pf_trl.data.pretokenize.pretokenize` is built from this one dataclass:

- Python: ``PretokenizeConfig(...)`` itself (validated from the declaration in ``__post_init__``);
- ``pf-trl pretokenize``: one flag per field (:func:`add_cli_arguments`);
- ``pf-trl train``: the same flags, except the ones TRL's ``SFTConfig`` already has (``--dataset_text_field``,
  ``--completion_only_loss``), in :func:`train_data_fields`;
- the preprocessing service: the ``options`` object of ``POST /v1/datasets`` (``preprocess_service.schemas``
  builds its pydantic model from :func:`option_specs`).

Each field carries an :class:`OptionSpec` (help, allowed values, bounds) in its metadata. Messages about an option
are written once, with the CLI spelling (``--chat_template FILE``); :func:`for_service` turns them into the request
field (``options.chat_template``) for the service.

This module imports nothing heavy (no pyarrow, datasets or transformers): the CLI checks flags with it first.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pf_trl.data.formats import FORMATS, FieldNames
from pf_trl.data.truncation import POLICY_HELP, TRUNCATION_MODES, TRUNCATION_POLICIES, normalize_policy
from pf_trl.errors import PfTrlError

# `error` is the older spelling of `refuse`, still accepted
_TRUNCATION_CHOICES = (*TRUNCATION_POLICIES, "error")
SHARD_SIZE_PATTERN = r"^[1-9][0-9]{0,6}(MB|GB|MiB|GiB)$"
CHAT_TEMPLATE_MAX_CHARS = 1 << 16


class PretokenizeError(PfTrlError, ValueError):
    """Bad input to pretokenize. The message names the problem and the fix; nothing was written. ``option`` names
    the data option at fault, when one is."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class OptionError(PretokenizeError):
    """A data option has a value it cannot take."""


@dataclass(frozen=True)
class OptionSpec:
    """What one data option accepts, for every door.

    Attributes:
        help: one sentence for ``--help``, the API schema and the docs.
        choices: the allowed values (strings), or None.
        positive: an integer > 0.
        maximum: the largest integer accepted.
        min_length / max_length: bounds on a string's length.
        pattern: a regular expression a string must match.
        trl_field: on ``pf-trl train`` the value comes from this ``SFTConfig`` field (no second flag).
        file: the CLI flag takes a FILE whose text is the value (Python and the service take the text itself).
    """

    help: str
    choices: tuple[str, ...] | None = None
    positive: bool = False
    maximum: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    trl_field: str | None = None
    file: bool = False


def _option(default: Any, help: str, **spec: Any) -> Any:
    return field(default=default, metadata={"pf_option": OptionSpec(help=help, **spec)})


def _column(default: str, what: str) -> Any:
    return _option(default, f"Column of {what}.", min_length=1, max_length=256)


@dataclass
class PretokenizeConfig:
    """What to tokenize and how: the one declaration of pf-trl's data options. Every field is part of the output's
    content address (and of the service's dataset id).

    Attributes:
        input_format: ``auto`` | one of :data:`pf_trl.data.formats.FORMATS` (``pretokenized``, ``text``,
            ``prompt_completion``, ``messages``, ``conversational_prompt_completion``, ``alpaca``, ``sharegpt``).
        text_field: column names read by the formats, like ``prompt_field``, ``completion_field``,
            ``messages_field``, ``input_ids_field``, ``labels_field``, ``instruction_field``, ``input_field``,
            ``output_field`` and ``conversations_field``.
        response_template: for ``text``: loss starts after its last occurrence.
        max_seq_len: longest example kept, in tokens.
        truncation: the policy for longer examples (:mod:`pf_trl.data.truncation`): ``truncate`` (TRL's behaviour,
            the default) | ``drop`` | ``refuse`` (``error`` is accepted for ``refuse``).
        truncation_mode: which tokens ``truncate`` keeps: ``keep_start`` (the first max_seq_len, TRL's default) or
            ``keep_end`` (the last).
        assistant_only_loss: chat formats: loss on assistant turns only (pf-trl's default); False: on every token of
            the rendered conversation (TRL's ``assistant_only_loss=False``).
        add_eos: append EOS (supervised) to ``text`` and ``prompt_completion`` rows.
        drop_no_loss: drop rows left with no supervised token (they cost compute and teach nothing).
        shard_size: ``save_to_disk(max_shard_size=...)``, e.g. ``"500MB"``.
        completion_only_loss: prompt-completion formats and TRL's ``completion_mask`` column: loss on the
            completion only (TRL's default); False: on the whole sequence (``assistant_masks`` still applies).
        chat_template: the Jinja text of a chat template for the chat formats, replacing the tokenizer's own (the
            CLI flag ``--chat_template FILE`` reads it from a file). None: the tokenizer's template.
    """

    input_format: str = _option("auto", "Input format; auto detects it from the columns.",
                                choices=("auto", *FORMATS))
    text_field: str = _option(FieldNames.text, "Column of the text format (with --response_template).", min_length=1,
                              max_length=256, trl_field="dataset_text_field")
    prompt_field: str = _column(FieldNames.prompt, "the prompt (prompt-completion formats)")
    completion_field: str = _column(FieldNames.completion, "the completion (prompt-completion formats)")
    messages_field: str = _column(FieldNames.messages, "chat messages")
    input_ids_field: str = _column(FieldNames.input_ids, "token ids (pretokenized format)")
    labels_field: str = _column(FieldNames.labels, "labels (pretokenized format; optional per source)")
    response_template: str | None = _option(None, "Text format: the loss starts after its last occurrence.",
                                            min_length=1, max_length=1024)
    max_seq_len: int = _option(1024, "Longest example kept, in tokens.", positive=True, maximum=1 << 20)
    truncation: str = _option("truncate", POLICY_HELP + " ('error' is accepted for 'refuse'.)",
                              choices=_TRUNCATION_CHOICES, trl_field="truncation")
    add_eos: bool = _option(True, "Append EOS (supervised) to text and prompt-completion rows.")
    drop_no_loss: bool = _option(True, "Drop rows left without a supervised token.")
    shard_size: str = _option("500MB", "Arrow shard size: 1MB .. 9999999MB (MB, GB, MiB, GiB).",
                              pattern=SHARD_SIZE_PATTERN)
    instruction_field: str = _column(FieldNames.instruction, "the Alpaca instruction")
    input_field: str = _column(FieldNames.input, "the Alpaca input (optional per row)")
    output_field: str = _column(FieldNames.output, "the Alpaca output (the supervised answer)")
    conversations_field: str = _column(FieldNames.conversations, "ShareGPT conversations")
    completion_only_loss: bool = _option(True, "Prompt-completion formats and TRL's completion_mask: loss on the "
                                         "completion only.", trl_field="completion_only_loss")
    chat_template: str | None = _option(None, "Jinja chat template for the chat formats, replacing the tokenizer's "
                                        "own (the CLI reads it from a FILE).", min_length=1,
                                        max_length=CHAT_TEMPLATE_MAX_CHARS, file=True)
    truncation_mode: str = _option("keep_start", "Which tokens 'truncate' keeps: keep_start (the first "
                                   "--max_seq_len, TRL's default) or keep_end (the last).", choices=TRUNCATION_MODES,
                                   trl_field="truncation_mode")
    assistant_only_loss: bool = _option(True, "Chat formats: loss on assistant turns only; false: on every token of "
                                        "the conversation (TRL's assistant_only_loss=False).",
                                        trl_field="assistant_only_loss")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_option(f.name, getattr(self, f.name))
        self.truncation = normalize_policy(self.truncation)
        if self.input_format == "text" and not self.response_template:
            raise OptionError("input_format 'text' needs a response_template (e.g. '### Response:')",
                              "response_template")

    @property
    def fields(self) -> FieldNames:
        """The column names, as the formats read them."""
        return FieldNames(**{f.name: getattr(self, f"{f.name}_field") for f in dataclasses.fields(FieldNames)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def option_specs() -> dict[str, tuple[dataclasses.Field, OptionSpec]]:
    """``{name: (dataclass field, OptionSpec)}`` in declaration order."""
    return {f.name: (f, f.metadata["pf_option"]) for f in dataclasses.fields(PretokenizeConfig)}


def option_type(f: dataclasses.Field) -> type:
    """The value type of an option (``str | None`` -> ``str``; the annotations are strings here)."""
    return {"str": str, "int": int, "bool": bool}[str(f.type).replace(" | None", "")]


def check_option(name: str, value: Any) -> None:
    """Raise :class:`OptionError` when ``value`` is not allowed for option ``name`` (one line, names the fix)."""
    f, spec = option_specs()[name]
    if value is None:
        if f.default is None:
            return
        raise OptionError(f"{name} must not be null (default {f.default!r})", name)
    kind = option_type(f)
    if kind is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise OptionError(f"{name} must be an integer, got {value!r}", name)
    if kind is bool and not isinstance(value, bool):
        raise OptionError(f"{name} must be true or false, got {value!r}", name)
    if kind is str and not isinstance(value, str):
        raise OptionError(f"{name} must be a string, got {type(value).__name__}", name)
    if spec.choices is not None and value not in spec.choices:
        raise OptionError(f"{name} {value!r} is unknown; use one of {', '.join(spec.choices)}", name)
    if spec.positive and value <= 0:
        raise OptionError(f"{name} must be a positive integer, got {value!r}", name)
    if spec.maximum is not None and value > spec.maximum:
        raise OptionError(f"{name} must be at most {spec.maximum}, got {value!r}", name)
    if spec.min_length is not None and len(value) < spec.min_length:
        raise OptionError(f"{name} must not be empty", name)
    if spec.max_length is not None and len(value) > spec.max_length:
        raise OptionError(f"{name} is {len(value)} characters long; at most {spec.max_length}", name)
    if spec.pattern is not None and not re.fullmatch(spec.pattern, value):
        raise OptionError(f"{name} {value!r} is not valid ({spec.help})", name)
    if name == "chat_template" and "{%" not in value and "{{" not in value:
        raise OptionError("chat_template is not a Jinja template (no {% or {{ in it); pass the template's text "
                          "(--chat_template FILE reads it from a file)", name)


# ------------------------------------------------------------------------------------------------ the CLI door


def parse_bool(value: str) -> bool:
    """``true/false``, ``yes/no``, ``1/0`` (any case), as the CLI flags take them."""
    lowered = str(value).lower()
    if lowered in ("1", "true", "yes", "y"):
        return True
    if lowered in ("0", "false", "no", "n"):
        return False
    import argparse

    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def read_template_file(path: str | Path, *, flag: str = "--chat_template") -> str:
    """The text of a chat template FILE (checked like the option itself)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise OptionError(f"{flag} {path}: no such file; pass a Jinja template file", "chat_template")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(f"{flag} {path}: cannot read it as UTF-8 text ({exc})", "chat_template") from exc
    try:
        check_option("chat_template", text)
    except OptionError as exc:
        raise OptionError(f"{flag} {path}: {exc}", "chat_template") from exc
    return text


def add_cli_arguments(parser, *, train: bool = False) -> None:
    """One argparse flag per option (``pf-trl pretokenize``); ``train=True`` leaves out the options that TRL's
    config carries under its own name."""
    for name, (f, spec) in option_specs().items():
        if train and spec.trl_field:
            continue
        kind = option_type(f)
        shown = "none" if f.default is None else f.default
        help_ = f"{spec.help} (default {shown})"
        if spec.file:
            parser.add_argument(f"--{name}", default=None, metavar="FILE", help=help_)
        elif kind is bool:
            parser.add_argument(f"--{name}", type=parse_bool, default=f.default, metavar="BOOL", help=help_)
        elif spec.choices is not None:  # checked by PretokenizeConfig, with the same message on every door
            parser.add_argument(f"--{name}", default=f.default, metavar="{" + ",".join(spec.choices) + "}",
                                help=help_)
        else:
            parser.add_argument(f"--{name}", type=kind, default=f.default, help=help_)


def train_data_fields() -> list[tuple[str, type, dataclasses.Field]]:
    """The options as ``dataclasses.make_dataclass`` fields for ``pf-trl train`` (HfArgumentParser reads
    ``help`` / ``choices`` from the metadata); a ``file`` option holds the FILE path there."""
    out = []
    for name, (f, spec) in option_specs().items():
        if spec.trl_field:
            continue
        kind = option_type(f)
        meta: dict[str, Any] = {"help": spec.help}
        if spec.choices is not None:
            meta["choices"] = list(spec.choices)
        typ = (kind | None) if (f.default is None or spec.file) else kind
        out.append((name, typ, field(default=f.default, metadata=meta)))
    return out


def config_from_values(values: dict[str, Any], *, files: bool = True) -> PretokenizeConfig:
    """A :class:`PretokenizeConfig` from CLI values (a ``file`` option's value is a path, read here when ``files``)."""
    kwargs = {}
    for name, (_, spec) in option_specs().items():
        if name not in values:
            continue
        value = values[name]
        if spec.file and files and value is not None:
            value = read_template_file(value, flag=f"--{name}")
        kwargs[name] = value
    return PretokenizeConfig(**kwargs)


def option_differences(made_with: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """``["max_seq_len 512 (not 2048)", ...]`` for the options of ``wanted`` whose value differs from ``made_with``
    (a manifest's ``options``); a chat template is named by its sha256, not its text."""
    import hashlib

    def shown(name: str, value: Any) -> str:
        if name == "chat_template" and isinstance(value, str):
            return f"sha256 {hashlib.sha256(value.encode()).hexdigest()[:12]}"
        return repr(value)

    return [f"{name} {shown(name, made_with[name])} (not {shown(name, value)})" for name, value in wanted.items()
            if name in made_with and made_with[name] != value]


# -------------------------------------------------------------------------------------------- the service door

_FLAG = re.compile(r"--([a-z][a-z0-9_]*)( FILE)?")
# `pf-trl train` spellings of options that live in TRL's config
_TRAIN_SPELLINGS = {"dataset_text_field": "text_field"}


def for_service(message: str) -> str:
    """A message written for the CLI, spoken to a service client: ``--max_seq_len`` becomes ``options.max_seq_len``,
    ``--chat_template FILE`` becomes ``options.chat_template (the template text)``; other flags stay."""
    names = option_specs()

    def spell(match: re.Match) -> str:
        name = _TRAIN_SPELLINGS.get(match.group(1), match.group(1))
        if name not in names:
            return match.group(0)
        return f"options.{name}" + (" (the template text)" if match.group(2) else "")

    return _FLAG.sub(spell, message)


def service_field(message: str) -> str | None:
    """The first ``options.<name>`` a service message names, if any."""
    found = re.search(r"options\.([a-z][a-z0-9_]*)", message)
    return found.group(0) if found and found.group(1) in option_specs() else None
