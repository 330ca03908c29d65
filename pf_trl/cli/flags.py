"""Flag spelling shared by every `pf-trl` subcommand: `--max-seq-len` and `--max_seq_len` are the same flag, and
the one table of other spellings (:data:`FLAG_ALIASES`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from pf_trl.errors import PfTrlError
from pf_trl.trainer.modes import PADDING_FREE_MODES, deprecation_message


class FlagAliasError(PfTrlError, ValueError):
    """An alias and the flag it stands for, given with two different values."""


@dataclass(frozen=True)
class FlagAlias:
    """Another spelling of a flag: ``flag`` is read as ``target``.

    ``origin``: whose spelling it is. ``commands``: the subcommands it applies to (``None``: every one). ``values``:
    only these values make ``flag`` an alias (``--padding_free internal``); other values keep ``flag``'s own meaning
    (``--padding_free true`` is TRL's switch). ``deprecated``: one ``FutureWarning`` naming ``target``.
    """

    flag: str
    target: str
    origin: str
    commands: tuple[str, ...] | None = None
    values: tuple[str, ...] | None = None
    deprecated: bool = False


# Every other spelling pf-trl's commands accept, in one table. A flag's own name is TRL's / transformers' where they
# have one. fms-hf-tuning's sft_trainer flags that have no TRL name are pf-trl flags of their own (docs/training.md):
# --training_data_path, --validation_data_path, --use_flash_attn, --torch_dtype, --response_template, and
# --max_seq_len, which is one limit with TRL's --max_length (pf_trl.cli.train.one_sequence_limit).
FLAG_ALIASES: tuple[FlagAlias, ...] = (
    FlagAlias("--evaluation_strategy", "--eval_strategy", "transformers before 4.46"),
    FlagAlias("--max_seq_length", "--max_seq_len", "TRL before 0.20, fms-hf-tuning"),
    FlagAlias("--max_eval_samples", "--eval_max_examples", "transformers' example scripts"),
    FlagAlias("--data_config_path", "--data_config", "fms-hf-tuning"),
    FlagAlias("--padding_free", "--padding_free_mode", "fms-hf-tuning's sft_trainer and pf-trl before "
              "padding_free_mode (`--padding_free huggingface`)", commands=("train",), values=PADDING_FREE_MODES,
              deprecated=True),
    FlagAlias("--dataset_text_field", "--text_field", "`pf-trl train` (TRL's name)", commands=("pretokenize",)),
    FlagAlias("--tokenizer", "--tokenizer_name_or_path", "short form", commands=("pretokenize",)),
)

# The renames every command accepts (the table's rows without a command or value condition).
ALIASES = {a.flag: a.target for a in FLAG_ALIASES if a.commands is None and a.values is None}


def _applies(alias: FlagAlias, command: str | None) -> bool:
    return alias.commands is None or (command is not None and command in alias.commands)


def normalize_flags(argv: list[str], aliases: dict[str, str] | None = None, *, command: str | None = None) -> list[str]:
    """Dashes inside flag names become underscores and the aliases of :data:`FLAG_ALIASES` that apply to ``command``
    (plus ``aliases``) map onto the names they stand for.

    Only tokens that start with ``--`` are touched (values such as ``'### Response:'`` are left alone), and
    nothing after a bare ``--``. Idempotent: a normalized command line is returned as it is, without warnings. An
    alias and its target given with different values raise :class:`FlagAliasError`.
    """
    table = [a for a in FLAG_ALIASES if _applies(a, command)]
    renames = {a.flag: a.target for a in table if a.values is None}
    renames.update(aliases or {})
    by_value = {a.flag: a for a in table if a.values is not None}
    out: list[str] = []
    given: dict[str, tuple[str, str | None]] = {}  # target flag -> (spelling used, value) for conflict checks
    passthrough = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if passthrough or not arg.startswith("--") or arg == "--":
            passthrough = passthrough or arg == "--"
            out.append(arg)
            continue
        head, eq, tail = arg.partition("=")
        head = "--" + head[2:].replace("-", "_")
        spelled = head
        value = tail if eq else (argv[i] if i < len(argv) and not argv[i].startswith("--") else None)
        head = renames.get(head, head)
        alias = by_value.get(head)
        if alias is not None and value is not None and value.strip().lower() in alias.values:
            value = value.strip().lower()
            if alias.deprecated:
                warnings.warn(_deprecated(alias, value), FutureWarning, stacklevel=2)
            head = alias.target
            _check_conflict(given, head, spelled, value)
            if eq:
                out.append(f"{head}={value}")
            else:
                out += [head, value]
                i += 1  # the value, consumed here
            continue
        _check_conflict(given, head, spelled, value)
        out.append(head + (eq + tail if eq else ""))
    return out


def _deprecated(alias: FlagAlias, value: str) -> str:
    if alias.flag == "--padding_free":
        return deprecation_message(value, cli=True)
    return f"{alias.flag} {value} is deprecated: pass {alias.target} {value}"


def _check_conflict(given: dict[str, tuple[str, str | None]], target: str, spelled: str, value: str | None) -> None:
    before = given.get(target)
    if before is not None and before[0] != spelled and before[1] != value:
        first = f"{before[0]} {before[1]}" if before[1] is not None else before[0]
        second = f"{spelled} {value}" if value is not None else spelled
        raise FlagAliasError(f"{first} and {second} both set {target} (one is an alias of the other), to different "
                             f"values; pass {target} once")
    given.setdefault(target, (spelled, value))


def one_line(message: object) -> str:
    """A message on one line (user errors are one line on stderr). An error a DataLoader worker raised comes back
    wrapped in the worker's traceback (torch's ``ExceptionWrapper``): its own message is kept, not the traceback."""
    text = str(message)
    if "in DataLoader worker process" in text and "Original Traceback" in text:
        import re

        raised = list(re.finditer(r"^[A-Za-z_][\w.]*: ", text, re.M))  # "pf_trl....StorageError: ", after the frames
        if raised:
            text = text[raised[-1].end():]
    return " ".join(text.split())
