"""Who is asking, by network address: the peer, or — only behind a proxy named in
NEXTSTATE_TRUSTED_PROXIES — the client that proxy says it forwards (X-Forwarded-For).

uvicorn's own proxy-header handling trusts X-Forwarded-For from loopback by default, so anyone
on the machine could claim any address (the dashboard's sign-in throttle, keyed on it, let 14
wrong keys through, each with a new header). The server runs with it off and decides here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from fastapi import Request

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def trusted_networks(entries: Iterable[str]) -> list[Network]:
    """Addresses or CIDR ranges, as NEXTSTATE_TRUSTED_PROXIES lists them."""
    return [ipaddress.ip_network(entry.strip(), strict=False) for entry in entries if entry.strip()]


def _trusted(address: str, networks: list[Network]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def client_address(request: Request, networks: list[Network]) -> str:
    """The peer's address; behind a trusted proxy, the nearest address in X-Forwarded-For that
    is not itself a trusted proxy (what a client wrote further left is its own claim)."""
    peer = request.client.host if request.client else "?"
    if not networks or not _trusted(peer, networks):
        return peer
    forwarded = [a.strip() for a in request.headers.get("x-forwarded-for", "").split(",") if a.strip()]
    for address in reversed(forwarded):
        if not _trusted(address, networks):
            return address
    return forwarded[0] if forwarded else peer
