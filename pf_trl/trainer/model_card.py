"""The model card written next to the trained model (``README.md`` in ``output_dir``): what it was fine-tuned from,
on which data, with which versions.

TRL's card links the base model to the Hugging Face Hub by its config's ``_name_or_path`` and writes ``None`` when
that is a local folder or empty; pf-trl trains local folders and embedded configs, so the card names them as they
are and links only a Hub id. Its "Use" snippet loads what the folder holds, with relative names only (the folder
by its own name, a local base folder by its name): the model itself, or an adapter on its base model (a Hub id, a
local folder, or an embedded config rebuilt with the same seed, which gives the same initial weights). PEFT rewrites
the card when it saves an adapter (``base_model: ''`` for a model without a Hub id); the trainer writes it again
after each save (:meth:`~pf_trl.trainer.PaddingFreeSFTTrainer.save_model`).
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path
from typing import Any

TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ origin }}

Fine-tuned with pf-trl {{ pf_trl_version }}: supervised fine-tuning with TRL's
`SFTTrainer`, padding-free (`padding_free_mode={{ mode }}`; every example of a batch in one packed row, the loss as a
padded run computes it).

## Training data

{{ data }}

## Use

Run from the folder that contains `{{ folder }}` (or set `model_dir` to its path, or to its Hub id once uploaded).

```python
{{ use }}
```

## Framework versions

{{ versions }}
"""

EMBEDDED_PREFIX = "pf-trl/"


def base_model_of(model: Any) -> str | None:
    """What ``model`` was loaded from: a local folder (absolute), a Hub id, an embedded pf-trl name, or None (built
    from a config in memory)."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    name = getattr(inner, "pf_trl_base", None) or getattr(getattr(inner, "config", None), "_name_or_path", None)
    if not name:
        return None
    return str(Path(name).resolve()) if os.path.isdir(name) else str(name)


def describe_origin(base: str | None, model_type: str | None) -> tuple[str, str | None]:
    """(a sentence on where the weights came from, the Hub id for the card's ``base_model`` metadata or None)."""
    if base is None:
        return f"Trained from a `{model_type or 'transformers'}` model built from its config (random initial weights).", None
    if base.startswith(EMBEDDED_PREFIX):
        return (f"Trained from pf-trl's embedded `{base}` config (random initial weights, `{model_type}`).", None)
    if os.path.isabs(base) or os.path.isdir(base):
        return f"Fine-tuned from the local model folder `{base}` (`{model_type}`).", None
    return f"Fine-tuned from [{base}](https://huggingface.co/{base}) (`{model_type}`).", base


def is_adapter(model: Any) -> bool:
    """True for a PEFT model (the folder then holds an adapter, not the whole model)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def use_snippet(model: Any, folder: str, base: str | None, hub_id: str | None) -> str:
    """Python that loads the saved folder ``folder`` (its own name, relative): the model, or ``model``'s adapter on
    its base (a Hub id, a local folder by its name, or an embedded config rebuilt with its seed)."""
    from pf_trl.remote_code import is_custom_class

    lines = []
    adapter = is_adapter(model)
    inner = model.get_base_model() if adapter else model
    build = getattr(inner, "pf_trl_build", None)
    # a class of the repository's own code (trust_remote_code): the saved folder carries that code and its auto_map,
    # which transformers runs only when asked to
    trust = ", trust_remote_code=True" if is_custom_class(inner) else ""
    if adapter:
        lines.append("from peft import PeftModel")
    if adapter and base is not None and base.startswith(EMBEDDED_PREFIX) and build is not None:
        lines.append("from transformers import AutoTokenizer")
        lines.append("")
        lines.append("from pf_trl.models import build_model")
    else:
        lines.append("from transformers import AutoModelForCausalLM, AutoTokenizer")
    lines += ["", f'model_dir = "{folder}"']
    if not adapter:
        lines.append(f"model = AutoModelForCausalLM.from_pretrained(model_dir{trust})")
    else:
        if hub_id is not None:
            lines.append(f'base = AutoModelForCausalLM.from_pretrained("{hub_id}"{trust})')
        elif base is not None and base.startswith(EMBEDDED_PREFIX) and build is not None:
            args = ", ".join([repr(base), f"seed={build['seed']}", *(f"{k}={v!r}" for k, v in build["overrides"].items())])
            lines.append(f"base = build_model({args})  # the embedded config's initial weights, rebuilt")
        elif base is not None:
            lines.append(f'base = AutoModelForCausalLM.from_pretrained("{Path(base).name}"{trust})  # the base '
                         "model's folder")
        else:
            lines.append("base = ...  # the base model the adapter was trained on (built in memory, not saved)")
        lines.append("model = PeftModel.from_pretrained(base, model_dir)")
    lines.append(f"tokenizer = AutoTokenizer.from_pretrained(model_dir{trust})")
    return "\n".join(lines)


def describe_data(dataset: Any) -> str:
    """One line per fact of the training data's manifest (pf-trl shards), or what is known of another dataset."""
    manifest = getattr(dataset, "pf_manifest", None)
    if not manifest:
        rows = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
        return f"- {rows} tokenized examples" if rows is not None else "- not recorded"
    source, counts = manifest.get("source", {}), manifest.get("counts", {})
    tok = manifest.get("tokenizer", {})
    lines = [
        f"- source: `{source.get('path')}` (sha256 `{str(source.get('sha256'))[:16]}`), format "
        f"`{source.get('input_format')}`",
        f"- {counts.get('examples')} examples, {counts.get('tokens')} tokens, {counts.get('loss_tokens')} supervised; "
        f"max_seq_len {manifest.get('max_seq_len')}, {counts.get('truncated')} truncated, "
        f"{counts.get('dropped')} dropped",
        f"- tokenizer `{tok.get('name')}` (vocab {tok.get('vocab_size')}, sha256 `{str(tok.get('sha256'))[:16]}`)",
    ]
    return "\n".join(lines)


def _versions() -> str:
    out = []
    for dist, shown in (("pf-trl", "pf-trl"), ("trl", "TRL"), ("transformers", "Transformers"), ("torch", "PyTorch"),
                        ("datasets", "Datasets"), ("tokenizers", "Tokenizers"), ("peft", "PEFT")):
        try:
            out.append(f"- {shown}: {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return "\n".join(out)


def write_model_card(trainer, model_name: str | None = None, tags: list[str] | None = None,
                     output_dir: str | None = None) -> Path:
    """Render the card for ``trainer`` into ``<output_dir>/README.md`` (default: the run's) and return its path."""
    from huggingface_hub import ModelCard, ModelCardData

    from pf_trl._version import __version__

    config = getattr(trainer.model, "config", None)
    model_type = getattr(config, "model_type", None)
    base = base_model_of(trainer.model)
    origin, hub_id = describe_origin(base, model_type)
    output_dir = Path(output_dir or trainer.args.output_dir)
    adapter = is_adapter(trainer.model)
    extra = {"peft", "lora", *([f"base_model:adapter:{hub_id}"] if hub_id else [])} if adapter else set()
    card_tags = sorted({"pf-trl", "padding-free", "sft", "trl", *extra, *(tags or [])})
    data = ModelCardData(library_name="peft" if adapter else "transformers", base_model=hub_id,
                         model_name=model_name or output_dir.name, tags=card_tags,
                         pipeline_tag="text-generation" if adapter else None)
    folder = output_dir.resolve().name
    card = ModelCard.from_template(
        data, template_str=TEMPLATE, model_name=model_name or output_dir.name, origin=origin,
        pf_trl_version=__version__, mode=getattr(trainer.args, "padding_free_mode", "huggingface"),
        data=describe_data(trainer.train_dataset), folder=folder,
        use=use_snippet(trainer.model, folder, base, hub_id), versions=_versions(),
    )
    path = output_dir / "README.md"
    card.save(str(path))
    return path
