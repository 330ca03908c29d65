"""Where each cloud's standard credential chain will find credentials, in words, for error messages.

pf-trl never takes credentials or endpoints as flags: s3fs / gcsfs / adlfs read them from the chain of each cloud
(environment, profile files, IRSA / Workload Identity tokens, instance metadata). When access fails, the message
says which link of the chain supplied them, so a wrong Secret or a missing ServiceAccount annotation is found at
once. Secrets are never printed; an access key id shows its last 4 characters.
"""

from __future__ import annotations

import os
from pathlib import Path


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _tail(value: str) -> str:
    return f"...{value[-4:]}" if len(value) > 4 else "..."


def aws_endpoint() -> str:
    """The S3 endpoint the AWS chain selects (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``) or AWS's own."""
    endpoint = _env("AWS_ENDPOINT_URL_S3") or _env("AWS_ENDPOINT_URL")
    if endpoint:
        return endpoint
    region = _env("AWS_REGION") or _env("AWS_DEFAULT_REGION")
    return f"AWS S3{f' ({region})' if region else ''}"


def aws_source() -> str:
    if _env("AWS_ACCESS_KEY_ID"):
        secret = "with AWS_SECRET_ACCESS_KEY" if _env("AWS_SECRET_ACCESS_KEY") else "without AWS_SECRET_ACCESS_KEY"
        return f"environment (AWS_ACCESS_KEY_ID {_tail(os.environ['AWS_ACCESS_KEY_ID'])} {secret})"
    if _env("AWS_WEB_IDENTITY_TOKEN_FILE") and _env("AWS_ROLE_ARN"):
        return (f"web identity (IRSA: role {os.environ['AWS_ROLE_ARN']}, token "
                f"{os.environ['AWS_WEB_IDENTITY_TOKEN_FILE']})")
    profile = _env("AWS_PROFILE") or "default"
    files = [Path(_env("AWS_SHARED_CREDENTIALS_FILE") or Path.home() / ".aws" / "credentials"),
             Path(_env("AWS_CONFIG_FILE") or Path.home() / ".aws" / "config")]
    present = [str(f) for f in files if f.is_file()]
    if present:
        return f"profile {profile!r} ({', '.join(present)})"
    return ("instance metadata (no AWS_ACCESS_KEY_ID, no AWS_ROLE_ARN + AWS_WEB_IDENTITY_TOKEN_FILE, no profile in "
            "the environment)")


def gcs_emulator() -> str | None:
    """The GCS emulator's address in ``STORAGE_EMULATOR_HOST`` (gcsfs's and Google's client libraries' variable),
    or None (``"default"`` and empty mean GCS itself)."""
    host = _env("STORAGE_EMULATOR_HOST")
    return None if host in (None, "default") else host


def gcs_source() -> str:
    path = _env("GOOGLE_APPLICATION_CREDENTIALS")
    if path:
        return f"GOOGLE_APPLICATION_CREDENTIALS ({path}{'' if Path(path).is_file() else ': no such file'})"
    adc = Path(_env("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud") / "application_default_credentials.json"
    if adc.is_file():
        return f"gcloud application-default credentials ({adc})"
    return "the metadata server (Workload Identity; GOOGLE_APPLICATION_CREDENTIALS is not set)"


def azure_source() -> str:
    account = _env("AZURE_STORAGE_ACCOUNT_NAME")
    if _env("AZURE_STORAGE_CONNECTION_STRING"):
        return "AZURE_STORAGE_CONNECTION_STRING"
    if account and _env("AZURE_STORAGE_KEY"):
        return f"the account key of {account} (AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_KEY)"
    named = account or "(AZURE_STORAGE_ACCOUNT_NAME unset)"
    if _env("AZURE_FEDERATED_TOKEN_FILE") and _env("AZURE_CLIENT_ID"):
        return (f"workload identity (AZURE_CLIENT_ID {os.environ['AZURE_CLIENT_ID']}, token "
                f"{os.environ['AZURE_FEDERATED_TOKEN_FILE']}) for account {named}")
    return (f"DefaultAzureCredential for account {named} (no "
            "AZURE_STORAGE_KEY, connection string or workload identity in the environment)")


def credential_source(protocol: str) -> str:
    """``"credentials from ...; endpoint ..."``: the link of the chain that supplies credentials for ``protocol``
    (``s3``, ``gcs``, ``az`` / ``abfs``)."""
    if protocol == "s3":
        return f"credentials from the {aws_source()}, endpoint {aws_endpoint()}"
    if protocol == "gcs":
        emulator = gcs_emulator()
        if emulator:  # gcsfs sends none to an emulator (pf_trl.storage.filesystem), as Google's own client does
            return f"no credentials, the emulator at STORAGE_EMULATOR_HOST={emulator}"
        return f"credentials from {gcs_source()}"
    return f"credentials from {azure_source()}"
