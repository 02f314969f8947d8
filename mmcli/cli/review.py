"""`mmcli review`: serve the page until Ctrl-C."""

from __future__ import annotations

from pathlib import Path

from mmcli.config import Config


def serve(
    files: list[Path], host: str, port: int, config: Config, allowed_hosts: tuple[str, ...] = ()
) -> None:
    from mmcli.review.server import ReviewServer
    from mmcli.review.store import ReviewStore

    store = ReviewStore(files)
    server = ReviewServer(store, host, port, config.image.max_decode_pixels, allowed_hosts)
    print(
        f"mmcli: {len(store.items)} items from {len(files)} file(s) at {server.url} (Ctrl-C stops)"
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
