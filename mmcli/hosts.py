"""The Host header values a local server accepts: its own address, never another site's name, so
that a page which rebinds its name to this machine (DNS rebinding) is refused (no torch)."""

from __future__ import annotations

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def accepted_hosts(host: str, port: int, names: list[str] | tuple[str, ...] = ()) -> frozenset[str]:
    """The Host values a request may carry: the address served on (with `localhost` for a
    loopback one: no other site's name can rebind to it), and the names given, with the port
    (and without it for port 80)."""
    bare = {host, *names}
    if host in LOOPBACK:
        bare |= {"127.0.0.1", "localhost", "::1"}
    bracketed = {f"[{h}]" if ":" in h and not h.startswith("[") else h for h in bare}
    values = {f"{h}:{port}" for h in bracketed}
    return frozenset(values | (bracketed if port == 80 else set()))
