"""The bind-address check of a dev-mode vLLM server: loopback unless the user consents.

Kept apart from ``vllm_server`` (which starts and supervises servers) so that configuration can
validate ``sampler.vllm_host`` without importing the server module: stdlib only.
"""

from __future__ import annotations

import ipaddress
import socket


class UnsafeBindError(ValueError):
    """A dev-mode server was asked to listen on a non-loopback address without consent."""


def is_loopback(host: str) -> bool:
    """True when ``host`` (an address or a name) only ever means this machine."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def check_bind_host(
    host: str,
    allow_remote: bool = False,
    *,
    key: str = "--host",
    allow_flag: str = "--allow-remote-dev-endpoints",
) -> None:
    """Refuses a non-loopback bind address for a dev-mode vLLM server unless ``allow_remote``.

    Dev mode (``VLLM_SERVER_DEV_MODE=1``, which per-step weight reload needs) serves
    ``/collective_rpc``, which runs methods on the workers: anyone who can reach the port can run
    code on this machine. ``key`` and ``allow_flag`` name the option and the consent switch in the
    one-line message (the CLI's flags by default, shown ``--host 0.0.0.0``; a config key such as
    ``sampler.vllm_host`` is shown ``sampler.vllm_host='0.0.0.0'``).

    Raises:
      UnsafeBindError: ``host`` is not loopback and ``allow_remote`` is False.
    """
    if allow_remote or is_loopback(host):
        return
    where = f"{key} {host}" if key.startswith("-") else f"{key}={host!r}"
    raise UnsafeBindError(
        f"{where}: refusing to expose a dev-mode vLLM server beyond this machine: its "
        "/collective_rpc endpoint runs methods on the workers, so anyone who can reach the port "
        f"can run code here; bind 127.0.0.1 (and tunnel, e.g. ssh -L) or pass {allow_flag} on "
        "a trusted network"
    )
