"""Model and tokenizer sources named by Hugging Face hub id, turned into local directories.

A source that is a local directory is used as it is. Any other value is a hub id: a copy in the
local hub cache is used when there is one; otherwise the hub is asked only when it is reachable
(not with ``HF_HUB_OFFLINE=1``, and after a short connection probe), and the error says what was
tried (one line naming the key, ``configlib.PreflightError``). ``preflight.check`` calls
``resolve_hf_source`` for ``model.path`` and ``model.tokenizer`` so that the loaders (which read
local directories only) see what was checked. Not here: hub *datasets* (``datasets`` resolves
``data.train`` names when it loads them) and what a directory must hold (``preflight``).
"""

from __future__ import annotations

import os

from jaxrlvr import configlib

HUB_ENDPOINT = "https://huggingface.co"


def hub_offline() -> bool:
    """True when the environment forbids hub access (``HF_HUB_OFFLINE``)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", HUB_ENDPOINT).rstrip("/")


def hub_unreachable_reason(timeout_s: float = 3.0) -> str | None:
    """None when the hub answers within ``timeout_s``; else why not, as a short phrase."""
    if hub_offline():
        return "HF_HUB_OFFLINE is set"
    import httpx

    endpoint = hub_endpoint()
    try:
        httpx.head(endpoint, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        return f"tried {endpoint}: {type(e).__name__}{': ' + detail if detail else ''}"
    return None


def _cached_snapshot(repo_id: str) -> str | None:
    """The local hub cache's snapshot of ``repo_id``, or None (no network access)."""
    try:
        import huggingface_hub
    except ImportError:
        return None
    try:
        return huggingface_hub.snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, or an invalid id: the caller reports it
        return None


def _download_snapshot(repo_id: str, key: str) -> str:
    import huggingface_hub

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
    try:
        return huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        raise configlib.PreflightError(
            f"{key}={repo_id!r}: not a local directory, and the Hugging Face hub did not "
            f"provide it ({type(e).__name__}: {detail})"
        ) from None


def _looks_local(value: str) -> bool:
    """A path the user meant as local: absolute, ./ ../ ~, or with more than one separator."""
    return (
        os.path.isabs(value)
        or value.startswith(("./", "../", "~", "." + os.sep))
        or value.count("/") > 1
        or os.path.exists(value)
    )


def resolve_hf_source(value: str, key: str, *, hub_timeout_s: float = 3.0) -> str:
    """``value`` (a local directory or a hub id) as a local directory, or PreflightError.

    A hub id is looked up in the local hub cache first; the hub is asked only when reachable.
    """
    if os.path.isdir(os.path.expanduser(value)):
        return os.path.expanduser(value)
    if os.path.exists(os.path.expanduser(value)):
        raise configlib.PreflightError(f"{key}={value!r}: is a file, expected a model directory")
    if _looks_local(value):
        raise configlib.PreflightError(f"{key}={value!r}: no such directory")
    cached = _cached_snapshot(value)
    if cached is not None:
        return cached
    reason = hub_unreachable_reason(hub_timeout_s)
    if reason is not None:
        raise configlib.PreflightError(
            f"{key}={value!r}: not a local directory and the Hugging Face hub is unreachable "
            f"({reason})"
        )
    return _download_snapshot(value, key)
