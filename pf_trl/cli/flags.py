"""Flag spelling shared by every `pf-trl` subcommand: `--max-seq-len` and `--max_seq_len` are the same flag."""

from __future__ import annotations

# Other names users type for pf-trl's flags (TRL / fms-hf-tuning spellings).
ALIASES = {
    "--evaluation_strategy": "--eval_strategy",
    "--max_seq_length": "--max_seq_len",
    "--max_eval_samples": "--eval_max_examples",
    "--data_config_path": "--data_config",
}


def normalize_flags(argv: list[str], aliases: dict[str, str] | None = None) -> list[str]:
    """Dashes inside flag names become underscores and known aliases map onto pf-trl's names.

    Only tokens that start with ``--`` are touched (values such as ``'### Response:'`` are left alone), and
    nothing after a bare ``--``.
    """
    aliases = {**ALIASES, **(aliases or {})}
    out: list[str] = []
    passthrough = False
    for arg in argv:
        if passthrough or not arg.startswith("--") or arg == "--":
            passthrough = passthrough or arg == "--"
            out.append(arg)
            continue
        head, eq, tail = arg.partition("=")
        head = "--" + head[2:].replace("-", "_")
        head = aliases.get(head, head)
        out.append(head + (eq + tail if eq else ""))
    return out


def one_line(message: object) -> str:
    """A message on one line (user errors are one line on stderr)."""
    return " ".join(str(message).split())
