"""The review page's server: the standard library's threading HTTP server on 127.0.0.1.

No route takes a file path: media are asked for by item number and served only from inside the
labeled roots; changes need the token the page was given, sent in a header a cross-site form
cannot set.
"""

from __future__ import annotations

import json
import secrets
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

from mmcli.errors import ImageError, MmcliError
from mmcli.hosts import accepted_hosts
from mmcli.review.media import SIZES, Thumbnails
from mmcli.review.store import ReviewStore

STATIC = {"app.js": "text/javascript", "style.css": "text/css"}
PAGE_SIZE = 60
DETAIL_FIELDS = (
    "text",
    "raw_text",
    "prompt",
    "finish_reason",
    "precision",
    "model",
    "latency_ms",
    "error",
    "json",
    "boxes",
    "review",
    "note",
    "status",
    "num_output_tokens",
)


class ReviewServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        store: ReviewStore,
        host: str,
        port: int,
        max_decode_pixels: int,
        allowed_hosts: tuple[str, ...] = (),
    ):
        self.store, self.token = store, secrets.token_urlsafe(24)
        self.thumbnails = Thumbnails(max_decode_pixels)
        super().__init__((host, port), Handler)
        # the port bound (0 asks for any): only now known
        self.hosts = accepted_hosts(host, self.server_address[1], allowed_hosts)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/"


class Handler(BaseHTTPRequestHandler):
    server: ReviewServer

    def log_message(self, format, *args) -> None:  # the terminal shows the URL, not every request
        pass

    def _foreign_host(self) -> bool:
        """A Host that is not this server's (a page rebinding its own name to this machine):
        refused, before the page, its token or any label is sent."""
        if self.headers.get("Host", "") in self.server.hosts:
            return False
        self._send_json({"error": "Host is not this server's address"}, HTTPStatus.BAD_REQUEST)
        return True

    def do_GET(self) -> None:
        if self._foreign_host():
            return
        url = urlparse(self.path)
        parts = [p for p in url.path.split("/") if p]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            self._get(parts, query)
        except (KeyError, IndexError, ValueError) as e:
            self._send_json({"error": str(e)}, HTTPStatus.BAD_REQUEST)

    def _get(self, parts: list[str], query: dict) -> None:
        if not parts:
            return self._page()
        if parts[0] == "static" and len(parts) == 2 and parts[1] in STATIC:
            data = resources.files("mmcli.review").joinpath("static", parts[1]).read_bytes()
            return self._send(data, STATIC[parts[1]])
        if parts == ["api", "items"]:
            return self._send_json(self._items(query))
        if parts[:2] == ["api", "item"] and len(parts) == 3:
            return self._send_json(self._detail(int(parts[2])))
        if parts[0] == "media" and len(parts) in (2, 4):
            return self._media(int(parts[1]), int(parts[3]) if len(parts) == 4 else None, query)
        self._send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)

    def do_POST(self) -> None:
        if self._foreign_host():
            return
        if urlparse(self.path).path != "/api/review":
            return self._send_json({"error": "not found"}, HTTPStatus.NOT_FOUND)
        if not secrets.compare_digest(self.headers.get("X-Review-Token", ""), self.server.token):
            return self._send_json({"error": "bad or missing token"}, HTTPStatus.FORBIDDEN)
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            record = self.server.store.review(
                int(body["id"]), str(body["task"]), str(body["action"]), body.get("value")
            )
        except MmcliError as e:  # another run holds the file's lock, a full disk
            return self._send_json({"error": str(e)}, HTTPStatus.CONFLICT)
        except (KeyError, IndexError, ValueError, TypeError) as e:
            return self._send_json({"error": str(e)}, HTTPStatus.BAD_REQUEST)
        self._send_json({"label": _label(body["task"], record)})

    def _page(self) -> None:
        page = resources.files("mmcli.review").joinpath("static", "index.html").read_text()
        self._send(page.replace("{{TOKEN}}", self.server.token).encode(), "text/html")

    def _items(self, query: dict) -> dict:
        store = self.server.store
        found, counts = store.query(
            task=query.get("task", ""),
            status=query.get("status", ""),
            text=query.get("q", ""),
            regex=query.get("regex") == "1",
            sort=query.get("sort", "key"),
        )
        offset = max(0, int(query.get("offset", 0)))
        limit = min(200, int(query.get("limit", PAGE_SIZE)))
        items = [_summary(n, store.items[n]) for n in found[offset : offset + limit]]
        return {
            "total": len(store.items),
            "matches": len(found),
            "counts": counts,
            "tasks": store.tasks,
            "offset": offset,
            "items": items,
        }

    def _detail(self, item_id: int) -> dict:
        item = self.server.store.items[item_id]
        labels = {t: {k: r.get(k) for k in DETAIL_FIELDS} for t, r in item.labels.items()}
        return {**_summary(item_id, item), "labels": labels}

    def _media(self, item_id: int, frame: int | None, query: dict) -> None:
        store = self.server.store
        item = store.items[item_id]
        path = store.media_source(item)
        if path is None:
            return self._send_json({"error": "outside the labeled folders"}, HTTPStatus.FORBIDDEN)
        size = int(query.get("size", SIZES[0]))
        if size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}")
        times = (item.record.get("video") or {}).get("frame_times") or []
        try:
            if times:
                data = self.server.thumbnails.frame(path, times[frame or 0], size)
            else:
                data = self.server.thumbnails.image(path, size)
        except ImageError as e:
            return self._send_json({"error": f"missing or unreadable: {e}"}, HTTPStatus.NOT_FOUND)
        self._send(data, "image/jpeg")

    def _send_json(self, value, status: HTTPStatus = HTTPStatus.OK) -> None:
        self._send(json.dumps(value, ensure_ascii=False).encode(), "application/json", status)

    def _send(self, data: bytes, kind: str, status: HTTPStatus = HTTPStatus.OK) -> None:
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=utf-8" if kind != "image/jpeg" else kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(data)


def _summary(item_id: int, item) -> dict:
    record = item.record
    video = record.get("video") or {}
    return {
        "id": item_id,
        "key": item.key,
        "width": record.get("width"),
        "height": record.get("height"),
        "frames": [round(t, 2) for t in video.get("frame_times") or []],
        "labels": [_label(task, r) for task, r in item.labels.items()],
    }


def _label(task: str, record: dict) -> dict:
    return {
        "task": task,
        "status": record.get("status"),
        "text": record.get("text"),
        "json": record.get("json"),
        "boxes": record.get("boxes"),
        "error": (record.get("error") or {}).get("message"),
        "review": record.get("review"),
    }
