"""The key per-source-address caps count under: one host's worth of addresses.

An IPv4 host has one address; an IPv6 host is usually given a whole /64 and can pick any
address in it, so IPv6 counts by its /64 prefix. An IPv4 address mapped into IPv6
(``::ffff:a.b.c.d``, as a dual-stack socket reports it) counts as that IPv4 address.
"""

from __future__ import annotations

import ipaddress

__all__ = ["address_key", "remote_host"]


def address_key(host: str) -> str:
    """``"203.0.113.7"`` -> ``"203.0.113.7"``; ``"2001:db8:1:2:3::4"`` -> ``"2001:db8:1:2::/64"``;
    ``"::ffff:203.0.113.7"`` -> ``"203.0.113.7"``. Brackets and an IPv6 zone are ignored.
    A host that is not an IP address (a Unix socket path, a name) is its own key."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    text = text.split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((int(ip) >> 64 << 64, 64)))
    return str(ip)


def remote_host(remote: str) -> str:
    """The host of a ``HOST:PORT`` remote (IPv6 as ``[h]:p`` or bare ``h:p``), with the
    hub's ``gateway:`` prefix (a session paired through a gateway) removed."""
    text = remote.removeprefix("gateway:")
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return text
    return host
