"""``pf-trl train --help`` without importing transformers: the full parser's help, kept as a table.

The flags of ``pf-trl train`` come from transformers' ``HfArgumentParser`` over TRL's and pf-trl's dataclasses;
building it imports transformers, TRL and torch (seconds to tens of seconds). Its help (each option's spellings,
help text, default, choices and ``nargs``) is written next to the flag table (:mod:`pf_trl.cli.flag_table`) under
the same stamp, and ``--help`` rebuilds a plain ``argparse`` parser from it with the same formatter, so it prints the
same text in a fraction of a second. With another stamp the full parser prints the help (and its table is kept in
the user cache for the next time).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from pf_trl._compat import is_help_action, parser_actions

SHIPPED_HELP = Path(__file__).with_name("train_help.json")


def _shown(value: Any) -> Any:
    """A default as the help formatter prints it (``%(default)s``: its ``__name__`` if it has one)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return getattr(value, "__name__", None) or str(value)


def help_rows(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """What ``parser.format_help()`` is made of: its description and, per option, what the formatter prints."""
    rows = []
    for action in parser_actions(parser):
        if is_help_action(action) or not action.option_strings:
            continue
        row: dict[str, Any] = {"flags": list(action.option_strings), "dest": action.dest, "help": action.help,
                               "default": _shown(action.default)}
        if action.nargs is not None:
            row["nargs"] = action.nargs
        if action.choices is not None:
            row["choices"] = [str(c) for c in action.choices]
        if action.metavar is not None:
            row["metavar"] = action.metavar
        rows.append(row)
    return {"description": parser.description, "epilog": parser.epilog, "options": rows}


def write(path: Path, parser: argparse.ArgumentParser, stamp: dict[str, str]) -> None:
    """Write the help table of ``parser`` with ``stamp`` (atomically; one option a line: a readable diff)."""
    body = help_rows(parser)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    rows = ",\n".join(f"  {json.dumps(row)}" for row in body.pop("options"))
    tmp.write_text(f'{{"stamp": {json.dumps(stamp)},\n "parser": {json.dumps(body)},\n "options": [\n{rows}\n]}}\n',
                   encoding="utf-8")
    os.replace(tmp, path)


def cached_path(table_path: Path) -> Path:
    """The user-cache help table next to the user-cache flag table ``table_path``."""
    return table_path.with_name(table_path.name.replace("train_flags", "train_help"))


def load(stamp: dict[str, str], cached: Path) -> dict[str, Any] | None:
    """The help table valid for ``stamp`` (shipped, else the user cache's), or None."""
    for path in (SHIPPED_HELP, cached):
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if body.get("stamp") == stamp:
            return body
    return None


def help_parser(body: dict[str, Any]) -> argparse.ArgumentParser:
    """A plain parser that formats the same help as the full parser the table was made from."""
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False,
                                     **{k: v for k, v in (body.get("parser") or {}).items() if v is not None})
    for row in body["options"]:
        kwargs: dict[str, Any] = {"dest": row["dest"], "help": row.get("help"), "default": row.get("default")}
        if row.get("nargs") == 0:
            kwargs.update(action="store_const", const=None)
        else:
            for key in ("nargs", "choices", "metavar"):
                if key in row:
                    kwargs[key] = row[key]
        parser.add_argument(*row["flags"], **kwargs)
    return parser
