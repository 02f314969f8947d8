"""The media a request names, fetched under the server's rules, each refusal a 400 naming why:

- `data:` URLs (base64), always, up to the byte limit;
- `file://` paths only inside `--allowed-media-dir` (off by default), symlinks resolved first;
- http(s) only for a host `--allow-media-url` names (or a subdomain of one; off by default):
  every address the name resolves to must be public (no loopback, private, link-local, metadata,
  reserved or multicast range), the connection is made to the address checked (a second lookup
  cannot rebind it), no redirect is followed, and the body is cut at the byte limit and at one
  deadline for the whole fetch (a server that drips bytes is cut too).

Each medium reserves its bytes in the request's `Hold` (serve/admission.py) before it is read."""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mmcli.inputs.sources import Received
from mmcli.serve.admission import Hold
from mmcli.serve.protocol import APIError


@dataclass(frozen=True)
class MediaPolicy:
    allowed_dir: Path | None = None
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = 32 << 20
    timeout: float = 10.0

    def fetch(self, url: str, param: str, hold: Hold | None = None) -> Received:
        """The bytes `url` names, as an input named for errors, reserved in `hold` before they
        are read; APIError(400) otherwise."""
        hold = hold or _Unbounded()
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        try:
            if scheme == "data":
                return Received("data URL", self._data(url, param, hold))
            if scheme == "file":
                return self._read(self._file(url, param), param, hold)
            if scheme in ("http", "https"):
                return Received(url, self._http(url, param, hold))
            if not scheme and self.allowed_dir is not None:  # relative to the allowed folder
                path = self._file((self.allowed_dir / url).resolve().as_uri(), param)
                return self._read(path, param, hold)
        except ValueError as e:  # a NUL byte in a path, a port that is no number
            raise APIError(400, f"{param}: not a URL mmcli can read ({e})", param) from None
        raise APIError(
            400, f"{param}: {scheme or 'no'} scheme: use a data:, file: or http(s) URL", param
        )

    def _data(self, url: str, param: str, hold: Hold) -> bytes:
        header, _, payload = url[5:].partition(",")
        if not header.endswith(";base64"):
            raise APIError(
                400, f"{param}: a data URL must be base64 (data:<type>;base64,...)", param
            )
        if len(payload) > self.max_bytes * 4 // 3 + 4:
            raise APIError(
                400, f"{param}: over the {self.max_bytes} bytes a medium may have", param
            )
        hold.reserve(len(payload) * 3 // 4, param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{param}: the data URL is not valid base64", param) from None

    def _file(self, url: str, param: str) -> Path:
        if self.allowed_dir is None:
            raise APIError(
                400, f"{param}: file URLs are off (start with --allowed-media-dir)", param
            )
        path = Path(unquote(urlsplit(url).path)).resolve()
        root = self.allowed_dir.resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise APIError(400, f"{param}: no such file inside the allowed media folder", param)
        return path

    def _read(self, path: Path, param: str, hold: Hold) -> Received:
        try:
            size = path.stat().st_size
            if size > self.max_bytes:
                raise APIError(
                    400, f"{param}: over the {self.max_bytes} bytes a medium may have", param
                )
            hold.reserve(size, param)
            return Received(str(path), path.read_bytes())
        except OSError as e:
            raise APIError(
                400, f"{param}: cannot read the file ({e.strerror or e})", param
            ) from None

    def _http(self, url: str, param: str, hold: Hold) -> bytes:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        if not any(host == d or host.endswith("." + d) for d in self.allowed_domains):
            raise APIError(
                400,
                f"{param}: media URLs from {host or 'this host'} are not allowed "
                "(--allow-media-url DOMAIN)",
                param,
            )
        port = parts.port or (443 if parts.scheme == "https" else 80)
        deadline = time.monotonic() + self.timeout
        address = public_address(host, port, param)
        hold.reserve(self.max_bytes, param)  # what the body may reach; the rest given back
        connection = None
        try:
            connection = PinnedConnection(parts.scheme, host, address, port, deadline)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            response = connection.get(target, {"Host": parts.netloc, "User-Agent": "mmcli"})
            if response.status != 200:
                raise APIError(
                    400,
                    f"{param}: the media URL answered {response.status} "
                    "(redirects are not followed)",
                    param,
                )
            body = self._body(response, param)
            if connection.expired:  # the timer cut the body short
                raise TimeoutError
            hold.shrink(self.max_bytes, len(body))
            return body
        except (OSError, http.client.HTTPException) as e:  # refused, reset, TLS, a timeout
            if isinstance(e, TimeoutError) or (connection is not None and connection.expired):
                raise APIError(
                    400, f"{param}: the media URL took over {self.timeout} s", param
                ) from None
            raise APIError(400, f"{param}: cannot fetch the media URL ({e})", param) from None
        finally:
            if connection is not None:
                connection.close()

    def _body(self, response, param: str) -> bytes:
        chunks, size = [], 0
        while chunk := response.read1(1 << 16):
            size += len(chunk)
            if size > self.max_bytes:
                raise APIError(
                    400, f"{param}: over the {self.max_bytes} bytes a medium may have", param
                )
            chunks.append(chunk)
        return b"".join(chunks)


class _Unbounded:
    """No budget: what a caller without one (a test, a tool) reserves against."""

    def reserve(self, size: int, what: str) -> None:
        pass

    def shrink(self, reserved: int, used: int) -> None:
        pass


def public_address(host: str, port: int, param: str) -> str:
    """The address to connect to for `host`: every address it resolves to must be public."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise APIError(400, f"{param}: cannot resolve {host} ({e})", param) from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if not ip.is_global or ip.is_multicast:
            raise APIError(
                400, f"{param}: {host} resolves to {ip}, which is not a public address", param
            )
    return addresses[0]


class PinnedConnection:
    """An HTTP(S) connection to an address already checked, with the host's name for its Host
    header and TLS (certificate and SNI). At the deadline a timer shuts the socket down, so no
    step (connecting, the headers, a body dripped a byte at a time) outlasts it."""

    def __init__(self, scheme: str, host: str, address: str, port: int, deadline: float):
        timeout = max(deadline - time.monotonic(), 0.001)
        self.expired = False
        self.connection = http.client.HTTPConnection(address, port, timeout=timeout)
        raw = socket.create_connection((address, port), timeout=timeout)
        self.timer = threading.Timer(max(deadline - time.monotonic(), 0), self._expire, [raw])
        self.timer.daemon = True
        self.timer.start()
        if scheme == "https":
            try:
                raw = ssl.create_default_context().wrap_socket(raw, server_hostname=host)
            except OSError:
                self.timer.cancel()
                raw.close()
                raise
        self.connection.sock = raw

    def _expire(self, raw: socket.socket) -> None:
        self.expired = True
        try:
            raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def get(self, target: str, headers: dict):
        self.connection.request("GET", target, headers=headers)
        return self.connection.getresponse()

    def close(self) -> None:
        self.timer.cancel()
        self.connection.close()
