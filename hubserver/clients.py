"""Who a client is, for per-client limits and logs: an IPv4 address, or an IPv6 /64."""

from __future__ import annotations

import ipaddress

from aiohttp import web


def client_of(host: str) -> str:
    """The client a connection's address belongs to: an IPv4 address (also one a
    dual-stack socket shows as ::ffff:a.b.c.d), or an IPv6 address's /64 (one host or
    LAN gets a whole /64 and picks addresses in it at will)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def request_client(request: web.BaseRequest) -> str:
    """The client a request comes from."""
    return client_of(request.remote or "-")
