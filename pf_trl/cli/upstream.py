"""What TRL / transformers would fail on late, checked before any tokenizing or model build, in one line each.

A reporter (``--report_to wandb``) or ``--use_liger_kernel`` without its package, ``--push_to_hub`` without a way to the
Hub, and a Hub id given where pf-trl wants a local folder: upstream finds these after the data is tokenized and the
model built, with a long traceback. Here they are found from the flags alone, without importing transformers or torch
(packages are looked up with ``importlib.util.find_spec``, never imported).
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from pf_trl.cli.train_args import TrainCLIError

# transformers' INTEGRATION_TO_CALLBACK names -> the packages its is_*_available() looks for (any one of them)
REPORTERS: dict[str, tuple[tuple[str, ...], str]] = {
    "azure_ml": (("azureml.core.run",), "azureml-core"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "mlflow": (("mlflow",), "mlflow"),
    "neptune": (("neptune",), "neptune"),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "trackio": (("trackio",), "trackio"),
    "wandb": (("wandb",), "wandb"),
    "codecarbon": (("codecarbon",), "codecarbon"),
    "clearml": (("clearml",), "clearml"),
    "dagshub": (("dagshub",), "dagshub mlflow"),
    "flyte": (("flytekit",), "flytekit"),
    "dvclive": (("dvclive",), "dvclive"),
    "swanlab": (("swanlab",), "swanlab"),
    "kubeflow": ((), ""),  # an environment variable, no package
}
_ALL_NEEDED = {"dagshub": ("dagshub", "mlflow")}  # reporters that need every package listed, not one of them

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class UpstreamError(TrainCLIError):
    """A flag upstream would fail on later; the message names the flag and the way out."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def report_to_names(value: Any) -> list[str]:
    """The reporters of ``--report_to`` (a name, a list, or names separated by commas), lower case."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    return [name.strip().lower() for item in items for name in str(item).replace(",", " ").split() if name.strip()]


def check_report_to(value: Any) -> None:
    """Each reporter named must be one transformers knows and have its package installed."""
    names = report_to_names(value)
    if names in (["none"], ["all"], []):
        return  # "all": transformers reports to what is installed
    for name in names:
        if name not in REPORTERS:
            raise UpstreamError(f"--report_to {name!r} is not a reporter transformers knows; use none, all or "
                                f"{', '.join(sorted(REPORTERS))}")
        modules, package = REPORTERS[name]
        if not modules:
            continue
        found = all(map(_installed, _ALL_NEEDED[name])) if name in _ALL_NEEDED else any(map(_installed, modules))
        if not found:
            raise UpstreamError(f"--report_to {name}: the {package!r} package is not installed; pip install {package}, "
                                "or pass --report_to none")


def check_liger(use_liger_kernel: Any) -> None:
    if _truthy(use_liger_kernel) and not _installed("liger_kernel"):
        raise UpstreamError("--use_liger_kernel True needs the liger-kernel package (CUDA only): pip install "
                            "liger-kernel, or drop the flag")


def _truthy(value: Any) -> bool:
    return value is True or str(value).strip().lower() in ("1", "true", "yes", "y", "t", "on")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def _have_token(hub_token: Any) -> bool:
    if hub_token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return True
    try:
        from huggingface_hub import get_token  # light: no torch, no transformers
    except ImportError:
        return False
    return bool(get_token())


def check_push_to_hub(push_to_hub: Any, hub_token: Any = None, *, timeout_s: float = 3.0) -> None:
    """``--push_to_hub True`` needs the Hub: not offline, a token, and the endpoint reachable."""
    if not _truthy(push_to_hub):
        return
    way_out = "or drop --push_to_hub (the model is saved in --output_dir)"
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _truthy(os.environ.get(var, "")):
            raise UpstreamError(f"--push_to_hub True needs the Hugging Face Hub, but {var}={os.environ[var]} "
                                f"(offline); unset it, {way_out}")
    if not _have_token(hub_token):
        raise UpstreamError(f"--push_to_hub True needs a Hugging Face token and none is set; run `hf auth login`, set "
                            f"HF_TOKEN or pass --hub_token, {way_out}")
    url = urlparse(hub_endpoint())
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise UpstreamError(f"--push_to_hub True needs the Hugging Face Hub, but {hub_endpoint()} cannot be reached "
                            f"({exc.strerror or type(exc).__name__}); connect this machine, "
                            f"{way_out}") from None


def looks_like_hub_id(value: Any) -> bool:
    """``org/name`` that is not a local path (and not one of pf-trl's embedded names)."""
    text = str(value or "")
    return bool(HUB_ID.match(text)) and not text.startswith("pf-trl/") and not Path(text).expanduser().exists()


def hub_id_message(flag: str, value: str) -> str:
    """The one line for a Hub dataset id given to a flag that takes a local file or folder."""
    return (f"{flag} {value!r} is no local file or folder and looks like a Hugging Face Hub id; a Hub dataset is "
            f"named with --dataset_name {value} (its splits with --dataset_train_split / --dataset_test_split)")


def check_hub_ids(values: dict[str, Any]) -> None:
    """``{flag: value}`` of pf-trl's data path flags: a Hub id is refused, naming --dataset_name."""
    for flag, value in values.items():
        if value and looks_like_hub_id(value):
            raise UpstreamError(hub_id_message(flag, str(value)))


def check_upstream(get: Callable[..., Any]) -> None:
    """Every check of this module from ``get(flag, default)`` (the flag table's values before the import, the parsed
    config after it)."""
    check_report_to(get("report_to"))
    check_liger(get("use_liger_kernel", False))
    check_push_to_hub(get("push_to_hub", False), get("hub_token"))
