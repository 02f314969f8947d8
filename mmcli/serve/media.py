"""The media a request names, fetched under the server's rules, each refusal a 400 naming why:

- `data:` URLs (base64), always, up to the byte limit;
- `file://` paths only inside `--allowed-media-dir` (off by default), symlinks resolved first;
- http(s) only for a host `--allow-media-url` names (or a subdomain of one; off by default):
  every address the name resolves to must be public (no loopback, private, link-local, metadata,
  reserved or multicast range), the connection is made to the address checked (a second lookup
  cannot rebind it), no redirect is followed, and the body is cut at the byte and time limits."""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mmcli.inputs.sources import Received
from mmcli.serve.protocol import APIError


@dataclass(frozen=True)
class MediaPolicy:
    allowed_dir: Path | None = None
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = 32 << 20
    timeout: float = 10.0

    def fetch(self, url: str, param: str) -> Received:
        """The bytes `url` names, as an input named for errors; APIError(400) otherwise."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return Received("data URL", self._data(url, param))
        if scheme == "file":
            path = self._file(url, param)
            return Received(str(path), path.read_bytes())
        if scheme in ("http", "https"):
            return Received(url, self._http(url, param))
        if not scheme and self.allowed_dir is not None:  # a path, relative to the allowed folder
            path = self._file((self.allowed_dir / url).resolve().as_uri(), param)
            return Received(str(path), path.read_bytes())
        raise APIError(
            400, f"{param}: {scheme or 'no'} scheme: use a data:, file: or http(s) URL", param
        )

    def _data(self, url: str, param: str) -> bytes:
        header, _, payload = url[5:].partition(",")
        if not header.endswith(";base64"):
            raise APIError(
                400, f"{param}: a data URL must be base64 (data:<type>;base64,...)", param
            )
        if len(payload) > self.max_bytes * 4 // 3 + 4:
            raise APIError(
                400, f"{param}: over the {self.max_bytes} bytes a medium may have", param
            )
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
        if path.stat().st_size > self.max_bytes:
            raise APIError(
                400, f"{param}: over the {self.max_bytes} bytes a medium may have", param
            )
        return path

    def _http(self, url: str, param: str) -> bytes:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        if not any(host == d or host.endswith("." + d) for d in self.allowed_domains):
            raise APIError(
                400,
                f"{param}: media URLs from {host or 'this host'} are not allowed "
                "(--allow-media-url DOMAIN)",
                param,
            )
        address = public_address(
            host, parts.port or (443 if parts.scheme == "https" else 80), param
        )
        deadline = time.monotonic() + self.timeout
        connection = PinnedConnection(parts.scheme, host, address, parts.port, self.timeout)
        try:
            target = parts.path or "/"
            connection.request(
                "GET",
                target + (f"?{parts.query}" if parts.query else ""),
                headers={"Host": parts.netloc, "User-Agent": "mmcli"},
            )
            response = connection.getresponse()
            if response.status != 200:
                raise APIError(
                    400,
                    f"{param}: the media URL answered {response.status} "
                    "(redirects are not followed)",
                    param,
                )
            return self._body(response, deadline, param)
        except (OSError, http.client.HTTPException) as e:
            raise APIError(400, f"{param}: cannot fetch the media URL ({e})", param) from None
        finally:
            connection.close()

    def _body(self, response, deadline: float, param: str) -> bytes:
        chunks, size = [], 0
        while chunk := response.read(1 << 16):
            size += len(chunk)
            if size > self.max_bytes:
                raise APIError(
                    400, f"{param}: over the {self.max_bytes} bytes a medium may have", param
                )
            if time.monotonic() > deadline:
                raise APIError(400, f"{param}: the media URL took over {self.timeout} s", param)
            chunks.append(chunk)
        return b"".join(chunks)


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
    header and TLS (certificate and SNI)."""

    def __init__(self, scheme: str, host: str, address: str, port: int | None, timeout: float):
        port = port or (443 if scheme == "https" else 80)
        self.connection = http.client.HTTPConnection(address, port, timeout=timeout)
        if scheme == "https":
            context = ssl.create_default_context()
            raw = socket.create_connection((address, port), timeout=timeout)
            self.connection.sock = context.wrap_socket(raw, server_hostname=host)

    def request(self, method: str, target: str, headers: dict) -> None:
        self.connection.request(method, target, headers=headers)

    def getresponse(self):
        return self.connection.getresponse()

    def close(self) -> None:
        self.connection.close()
