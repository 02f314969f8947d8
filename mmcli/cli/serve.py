"""`mmcli serve`: the model loaded once behind the OpenAI API, on uvicorn, until SIGTERM or Ctrl-C
(then it admits nothing more, finishes what is in flight and exits 0), or until the engine gives
up (it failed again and again: exit 1, for a supervisor to restart it)."""

from __future__ import annotations

import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mmcli.config import Config
from mmcli.errors import ConfigError, MmcliError
from mmcli.hosts import is_loopback, serving_hosts

if TYPE_CHECKING:
    from mmcli.api.labeler import Labeler


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model: str | None = None
    media_dir: Path | None = None
    media_domains: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    max_images: int = 16
    max_body_mb: int = 64
    max_queue: int = 64
    max_videos: int = 2
    max_preparing: int = 4
    max_media_mb: int = 2048
    request_timeout: float = 600.0

    def limits(self):
        from mmcli.serve.chat import Limits

        return Limits(
            max_images=self.max_images,
            max_videos=self.max_videos,
            max_body_bytes=self.max_body_mb << 20,
            max_queue=self.max_queue,
            max_preparing=self.max_preparing,
            max_media_bytes=self.max_media_mb << 20,
            request_timeout=self.request_timeout,
        )


class EngineGaveUp(MmcliError):
    """The engine failed again and again: the server stops (exit 1) for a supervisor to restart
    it."""


def serve(cfg: Config, options: ServeOptions) -> None:
    """Serve until stopped; EngineGaveUp once the engine gave up."""
    try:
        import uvicorn

        from mmcli.serve.app import ServeSettings, create_app
    except ImportError:
        raise ConfigError("mmcli serve needs its extra: pip install 'mmcli[serve]'") from None
    from mmcli.api.labeler import Labeler
    from mmcli.serve.media import MediaPolicy
    from mmcli.serve.service import EngineService

    labeler = Labeler.from_pretrained(config=cfg)
    if options.port == 0:  # any free one, known before the Host check is set up
        options.port = free_port(options.host)
    settings = ServeSettings(
        served_model=options.served_model or cfg.model,
        hosts=serving_hosts(options.host, options.port, options.allowed_hosts, options.api_key),
        api_key=options.api_key,
        media=MediaPolicy(options.media_dir, tuple(d.lower() for d in options.media_domains)),
        limits=options.limits(),
    )
    service = EngineService(labeler, options.max_queue).start()
    app = create_app(labeler, service, settings)
    _announce(labeler, settings, options)
    # uvicorn drains on SIGTERM and Ctrl-C, then raises the signal again under the handlers it
    # found: these, so that a server stopped on purpose exits 0
    stopped = {sig: signal.signal(sig, _noted) for sig in (signal.SIGINT, signal.SIGTERM)}
    config = uvicorn.Config(
        app, host=options.host, port=options.port, log_level="warning", access_log=False
    )
    server = uvicorn.Server(config)
    service.on_fatal = lambda why: setattr(server, "should_exit", True)
    try:
        server.run()
    finally:
        for sig, handler in stopped.items():
            signal.signal(sig, handler)
        service.close()
        labeler.prepared_weights_report()
    if service.failure is not None:
        raise EngineGaveUp(f"stopping: {service.failure}")


def _announce(labeler: Labeler, settings, options: ServeOptions) -> None:
    print(
        f"mmcli: serving {settings.served_model} at http://{options.host}:{options.port}/v1 "
        f"({labeler.precision.weights} weights, {labeler.precision.compute} compute; "
        f"{labeler.kernels})",
        file=sys.stderr,
        flush=True,
    )
    if not is_loopback(options.host) and options.api_key is None:
        print(
            f"mmcli: WARNING: listening on {options.host} WITHOUT an API key: anyone who can "
            "reach this port can use the model. Set --api-key (or MMCLI_API_KEY).",
            file=sys.stderr,
            flush=True,
        )


def _noted(signum, frame) -> None:
    """A stop signal after the drain: the server has already stopped."""


def free_port(host: str) -> int:
    """A port free on `host` now (--port 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
