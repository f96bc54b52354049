"""The W&B server an online run talks to: its address, whether this process has an API key
for it, and whether it can be reached at all before ``wandb.init`` tries.

Why a reachability check of our own: on a node without network, ``wandb.init`` retries its
first request with back-off well past ``init_timeout`` (88 s of
"wandb: setting up run" with ``init_timeout=30``; 41 s measured with wandb 0.31 and
an unresolvable host). A DNS lookup and one TCP connection say the same in milliseconds.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.request
from urllib.parse import urlparse

from hdet_scale.errors import HDETConfigError

FALLBACK_BASE_URL = "https://api.wandb.ai"  # W&B's default before it moved to CoreWeave Forge
CONNECT_TIMEOUT_S = 5.0


def base_url() -> str:
    """The W&B server URL: ``WANDB_BASE_URL``, else the installed W&B's default
    (``https://api.forge.coreweave.com`` from wandb 0.31 on, ``https://api.wandb.ai``
    before). A ``base_url`` that ``wandb login --host`` wrote to W&B's settings file is not
    read (the environment variable is W&B's documented override)."""
    url = os.environ.get("WANDB_BASE_URL")
    if url:
        return url
    try:
        from wandb.sdk.lib.urls import DEFAULT_BASE_URL  # not public: absent in older wandb
    except ImportError:
        return FALLBACK_BASE_URL
    return DEFAULT_BASE_URL


def _hosts(url: str) -> list[str]:
    """``url``'s host and, for a CoreWeave Forge URL, the W&B API host behind it: W&B reads
    a ``~/.netrc`` entry for either (``wbnetrc.read_netrc_auth_with_source``)."""
    hosts = [urlparse(url).hostname or ""]
    try:
        from wandb.sdk.lib.urls import forge_upstream_url
    except ImportError:
        return hosts
    try:
        upstream = urlparse(forge_upstream_url(url)).hostname
    except (ValueError, KeyError):
        return hosts
    return hosts + [upstream] if upstream and upstream not in hosts else hosts


def has_credentials() -> bool:
    """An API key in ``WANDB_API_KEY``, or a ``~/.netrc`` (``NETRC``; ``wandb login``'s
    file) entry for the W&B server (:func:`base_url`'s host, or the API host behind a Forge
    URL). wandb 0.31's ``wandb login`` writes ``api.forge.coreweave.com``, older ones
    ``api.wandb.ai``: with no ``WANDB_BASE_URL`` both are taken."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    hosts = _hosts(base_url())
    if not os.environ.get("WANDB_BASE_URL"):
        hosts.append(urlparse(FALLBACK_BASE_URL).hostname)
    netrc = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        with open(netrc) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return False
    return any(h and h in text for h in hosts)


def unreachable(url: str, timeout: float = CONNECT_TIMEOUT_S) -> str | None:
    """Why ``url``'s server cannot be reached from here (one phrase), or ``None`` when a
    TCP connection to its host and port opened, or when ``url`` has no host (W&B's own
    validation names it). When a proxy applies (``HTTPS_PROXY``/``HTTP_PROXY``/
    ``ALL_PROXY`` not bypassed by ``NO_PROXY``), W&B connects through it: the connection
    tried is to the proxy.

    Takes at most ``2 * timeout`` seconds: the lookup runs in a daemon thread, since
    ``getaddrinfo`` has no timeout of its own (a DNS server that never answers).
    Opens and closes one connection; sends nothing."""
    parsed = urlparse(url)
    host = parsed.hostname
    if not host:
        return None
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parsed.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(host):
        # W&B connects through the proxy: the proxy is what must answer (a refusing
        # HTTPS_PROXY costs 64 s of W&B's retries)
        return _proxy_unreachable(proxy, timeout)
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:  # a port out of range: W&B's validation names it
        return None
    return _connect(host, port, timeout)


def _proxy_unreachable(proxy: str, timeout: float) -> str | None:
    """Why the proxy ``proxy`` (a ``*_PROXY`` value) cannot be reached, or ``None``. A
    value without a scheme is read as ``http://`` (as ``requests`` does)."""
    parsed = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    try:
        host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        host = None
    if not host:
        return f"the proxy {proxy!r} from the environment (HTTPS_PROXY, HTTP_PROXY or ALL_PROXY) names no host"
    why = _connect(host, port, timeout)
    return None if why is None else f"through the proxy {proxy} from the environment: {why}"


def _connect(host: str, port: int, timeout: float) -> str | None:
    """Why one TCP connection to ``host:port`` did not open, or ``None``; at most
    ``2 * timeout`` seconds (the lookup has no timeout of its own: a daemon thread)."""
    outcome: dict[str, BaseException] = {}

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as e:
            outcome["error"] = e

    worker = threading.Thread(target=attempt, name="hdet-wandb-reach", daemon=True)
    worker.start()
    worker.join(2 * timeout)
    if worker.is_alive():
        return f"no answer from {host}:{port} within {2 * timeout:.0f} s"
    error = outcome.get("error")
    if error is None:
        return None
    if isinstance(error, socket.gaierror):
        return f"the host {host} cannot be resolved ({error.strerror or error})"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return f"no connection to {host}:{port} within {timeout:.0f} s"
    return f"no connection to {host}:{port} ({error.strerror or error})"


def run_mode(mode: str | None) -> str:
    """The mode a W&B run opened with ``mode`` takes: ``mode``, else ``WANDB_MODE``, else
    online with credentials (:func:`has_credentials`), else offline."""
    return mode or os.environ.get("WANDB_MODE") or ("online" if has_credentials() else "offline")


def refuse_unreachable(mode: str | None, prefix: str = "wandb.") -> None:
    """Raise :class:`~hdet_scale.errors.HDETConfigError` when a run in ``mode``
    (:func:`run_mode`) would talk to a W&B server that :func:`unreachable` cannot reach,
    naming the server, the cause and the way out; nothing for offline or disabled runs.
    At most ``2 * CONNECT_TIMEOUT_S`` seconds. ``prefix``: the keys' place in the user's
    config. hdet-train calls it before any rank starts, :class:`MetricsLogger` before
    ``wandb.init``."""
    if run_mode(mode) not in ("online", "run", "shared"):  # W&B's names for an online run
        return
    server = base_url()
    why = unreachable(server)
    if why is not None:
        raise HDETConfigError(f"{prefix.rstrip('.')}: the online W&B run cannot start: the W&B server {server} cannot "
                              f"be reached ({why}); check the network (WANDB_BASE_URL, HTTPS_PROXY), or set "
                              f"{prefix}mode=offline (wandb sync uploads it later) or {prefix}enabled=false")
