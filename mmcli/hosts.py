"""The Host header values a local server accepts: its own address, never another site's name, so
that a page which rebinds its name to this machine (DNS rebinding) is refused (no torch)."""

from __future__ import annotations

import socket
import struct

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


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def machine_names() -> set[str]:
    """This machine's names and the addresses they resolve to: the Host values a client on the
    network (or a probe) sends to a server bound to every interface."""
    names = {socket.gethostname(), socket.getfqdn()}
    for name in list(names):
        try:
            names |= {info[4][0] for info in socket.getaddrinfo(name, None)}
        except OSError:
            pass
    return {n.split("%")[0] for n in names | interface_addresses() if n}


def interface_addresses() -> set[str]:
    """Each network interface's IPv4 address (Linux's SIOCGIFADDR; none elsewhere)."""
    try:
        import fcntl
    except ImportError:
        return set()
    found = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name[:15].encode())
            try:
                reply = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
            except OSError:  # an interface without an IPv4 address
                continue
            found.add(socket.inet_ntoa(reply[20:24]))
    return found


def serving_hosts(
    host: str, port: int, names: list[str] | tuple[str, ...], api_key: str | None
) -> frozenset[str] | None:
    """The Host values a server bound to `host` accepts; None for any. A loopback server keeps
    the check (DNS rebinding reaches it from any web page); a server on other interfaces with a
    key accepts any Host (the key is what guards it, and load balancers and probes send names
    of their own); one without a key accepts the machine's own names and addresses."""
    if is_loopback(host):
        return accepted_hosts(host, port, names)
    if api_key is not None:
        return None
    everywhere = host in ("0.0.0.0", "::", "")
    extra = machine_names() | set(LOOPBACK) if everywhere else set()
    return accepted_hosts(host, port, [*names, *sorted(extra)])
