"""``pf-trl train --config FILE.yaml``: TRL's ``TrlParser`` config files, read as ``trl sft`` reads them.

A TRL config is a YAML mapping whose keys are the fields of ``ScriptArguments``, ``SFTConfig``, ``ModelConfig`` and
``DatasetMixtureConfig`` (every one of them is a ``pf-trl train`` flag: :mod:`pf_trl.cli.trl_fields`), plus an
``env:`` mapping of environment variables, set before anything else runs. As in ``TrlParser``, the file's values
replace the defaults and the command line overrides the file.

pf-trl turns the file into command-line tokens placed before the user's own (:func:`expand_config`), so a value from
the file goes through exactly the checks of the same flag typed by hand (the flag table, before anything heavy is
imported). A key the command line also sets is dropped from the file's tokens (the command line wins, as in TRL),
including keys that are one setting under two names (``max_length`` / ``max_seq_len``, ``dtype`` / ``torch_dtype``,
``lora_r`` / ``r``...). A key that is no flag of ``pf-trl train`` is refused by name: ``trl sft`` hands such keys to
``accelerate launch``; with pf-trl they go on the launcher's own command line (``torchrun``, ``accelerate launch``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pf_trl.cli.train_args import TrainCLIError

CONFIG_FLAG = "--config"

# One setting under two names: a command line giving either overrides the file's key for the other.
SAME_SETTING = (
    frozenset({"max_length", "max_seq_len", "max_seq_length"}),
    frozenset({"dtype", "torch_dtype"}),
    frozenset({"lora_r", "r"}),
    frozenset({"lora_target_modules", "target_modules"}),
    frozenset({"chat_template_path", "chat_template"}),
    frozenset({"use_peft", "peft_method"}),
)


def config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """``(the --config file, argv without it)``; ``(None, argv)`` when none is given. ``--config`` twice is refused."""
    path, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="):
            if path is not None:
                raise TrainCLIError("--config is given twice; pass one config file (the command line overrides it)")
            if "=" in arg:
                path = arg.partition("=")[2]
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                path = argv[i + 1]
                i += 1
            else:
                raise TrainCLIError("--config needs a file: --config FILE.yaml (TRL's config format)")
            i += 1
            continue
        rest.append(arg)
        i += 1
    return path, rest


def read_config(path: str) -> dict[str, Any]:
    """The YAML mapping of a TRL config file; TrainCLIError when it cannot be read or is not a mapping."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise TrainCLIError(f"--config {path}: no such file")
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise TrainCLIError(f"--config {path}: not valid YAML ({' '.join(str(exc).split())[:200]})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise TrainCLIError(f"--config {path}: the file must hold a mapping of flag names to values (TRL's format)")
    return raw


def apply_env(raw: dict[str, Any], path: str) -> dict[str, Any]:
    """Set the ``env:`` section's variables (TrlParser's rule: values as strings); the mapping without it."""
    raw = dict(raw)
    env = raw.pop("env", None)
    if env is None:
        return raw
    if not isinstance(env, dict):
        raise TrainCLIError(f"--config {path}: `env` must be a mapping of variable names to values")
    for key, value in env.items():
        os.environ[str(key)] = str(value)
    return raw


def _rows() -> list[dict[str, Any]]:
    from pf_trl.cli import flag_table

    rows = flag_table.load()
    if rows is None:  # no table for these versions: the full parser's own (slow once, then cached)
        from pf_trl.cli.train_args import full_parser

        parser = full_parser()
        flag_table.remember(parser)
        rows = flag_table.table_from_parser(parser)
    return rows


def _defaults() -> dict[str, Any]:
    from pf_trl._compat import parser_actions
    from pf_trl.cli.train_args import full_parser

    return {a.dest: a.default for a in parser_actions(full_parser())}


def _canonical(dest: str) -> str:
    from pf_trl.cli.flags import ALIASES

    dest = ALIASES.get(f"--{dest}", f"--{dest}")[2:]
    for group in SAME_SETTING:
        if dest in group:
            return min(group)
    return dest


def _tokens(key: str, value: Any, row: dict[str, Any], path: str) -> list[str]:
    flag = f"--{key}"
    nargs = row.get("nargs")
    if isinstance(value, bool):
        return [flag, "true" if value else "false"]
    if isinstance(value, (list, tuple)):
        if nargs in ("+", "*"):
            if key == "datasets":  # TRL's DatasetConfig entries: one JSON object (or a path) per token
                return [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
            if not value:
                raise TrainCLIError(f"--config {path}: {key}: [] (an empty list) cannot be given; remove the key")
            return [flag, *(str(v) for v in value)]
        if key == "report_to":  # one token; split again after parsing (split_report_to), as TrlParser keeps the list
            return [flag, ",".join(str(v) for v in value)]
        if key == "fsdp":  # transformers splits the string on spaces
            return [flag, " ".join(map(str, value))]
        return [flag, json.dumps(list(value))]
    if isinstance(value, dict):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def config_tokens(raw: dict[str, Any], path: str, overridden: set[str]) -> list[str]:
    """The file's keys as command-line tokens, except those the command line sets (``overridden``: canonical
    names). A key that is no flag of ``pf-trl train`` is refused by name."""
    from pf_trl.cli.flags import ALIASES

    rows = _rows()
    by_flag = {flag: row for row in rows for flag in row["flags"] if row["kind"] != "flag"}

    def row_for(key: str) -> dict[str, Any] | None:
        return by_flag.get(f"--{key}") or by_flag.get(ALIASES.get(f"--{key}", ""))

    unknown = [str(k) for k in raw if row_for(str(k).replace("-", "_")) is None]
    if unknown:
        raise TrainCLIError(
            f"--config {path}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} no flag of pf-trl train "
            "(trl sft hands such keys to accelerate launch: put launcher settings on the launcher's command line, "
            "torchrun or accelerate launch)")
    defaults = None
    tokens: list[str] = []
    for key, value in raw.items():
        key = str(key).replace("-", "_")
        if _canonical(key) in overridden:
            continue
        row = row_for(key)
        if value is None:
            defaults = _defaults() if defaults is None else defaults
            if defaults.get(row["dest"]) is not None:
                raise TrainCLIError(f"--config {path}: {key}: null cannot be given to pf-trl train (its default is "
                                    f"{defaults[row['dest']]!r}); give a value or remove the key")
            continue  # null where the default is None: the default
        tokens += _tokens(key, value, row, path)
    return tokens


def expand_config(argv: list[str]) -> list[str]:
    """``argv`` with ``--config FILE`` replaced by the file's flags (before the command line's own, which override
    them; ``env:`` applied now). Returns ``argv`` unchanged when no ``--config`` is given."""
    path, rest = config_path(argv)
    if path is None:
        return list(argv)
    raw = apply_env(read_config(path), path)
    from pf_trl.cli.flags import normalize_flags

    given = {a.split("=", 1)[0][2:] for a in normalize_flags(rest, command="train") if a.startswith("--") and a != "--"}
    overridden = {_canonical(name) for name in given}
    return [*config_tokens(raw, path, overridden), *rest]


def split_report_to(config) -> None:
    """A config file's ``report_to: [a, b]`` arrives as one token ``a,b`` (the flag takes one value): the list again,
    as TrlParser hands it to the config."""
    value = getattr(config, "report_to", None)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and "," in value[0]:
        config.report_to = [v.strip() for v in value[0].split(",") if v.strip()]
