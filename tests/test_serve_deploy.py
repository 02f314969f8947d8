"""`mmcli serve` as an operator deploys it: admission before any work and the memory it bounds,
work nobody will read not done (a dropped client, a stop string, a deadline, a dripping media
host), the bind behind a load balancer (Host, /health), an engine that fails, the metrics and the
access log. Raw HTTP and the `openai` SDK against live servers (in this process or its own)."""

import base64
import concurrent.futures
import http.server
import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from conftest import encoded, photo

from mmcli.testing import live_server, peak_rss_mb, served_process

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from mmcli.serve.chat import Limits  # noqa: E402
from mmcli.serve.media import MediaPolicy  # noqa: E402
from mmcli.serve.service import EngineService  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def labeler(tiny_dir):
    from mmcli import Labeler
    from mmcli.config import load_config

    settings = {"device": "cpu", "dtype": "float32", "engine": {"max_len": 512}}
    return Labeler.from_pretrained(str(tiny_dir), config=load_config(None, settings))


@pytest.fixture
def service(labeler):
    service = EngineService(labeler, max_queue=64).start()
    yield service
    service.close()


def user(*urls, text="Describe this image."):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def post(url: str, body: dict, headers=None, timeout=120) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a POST to `url`."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def get(url: str, headers=None) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), response.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers


def chat(base: str, messages, **fields):
    return post(f"{base}/v1/chat/completions", {"model": MODEL, "messages": messages, **fields})


def wait_idle(service, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while (service.handles or service.admitted) and time.time() < deadline:
        time.sleep(0.05)


class Counting(http.server.BaseHTTPRequestHandler):
    """A media host that counts its hits and answers with a small PNG (or drips it)."""

    hits = 0
    drip = False

    def do_GET(self):
        type(self).hits += 1
        data = encoded(photo("coffee.jpg", (32, 32)), "PNG")
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        for byte in data if self.drip else [data]:
            self.wfile.write(bytes([byte]) if self.drip else byte)
            self.wfile.flush()
            if self.drip:
                time.sleep(0.2)

    def log_message(self, *args):
        pass


@pytest.fixture
def media_host(monkeypatch):
    """A local media host the server may fetch from (its address check bypassed)."""
    import mmcli.serve.media as media

    Counting.hits, Counting.drip = 0, False
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Counting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(media, "public_address", lambda host, port, param: "127.0.0.1")
    yield f"http://127.0.0.1:{server.server_address[1]}/a.png", Counting
    server.shutdown()


# Admission before work, and the memory it bounds


def test_a_full_queue_is_a_429_with_retry_after_before_any_medium_is_fetched(
    labeler, service, media_host, monkeypatch
):
    url, host = media_host
    policy = MediaPolicy(allowed_domains=("127.0.0.1",))
    with live_server(labeler, service, media=policy) as base:
        assert chat(base, user(url), max_tokens=2)[0] == 200 and host.hits == 1
        monkeypatch.setattr(service, "max_queue", 0)
        status, body, headers = chat(base, user(url), max_tokens=2)
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        assert headers["Retry-After"] == "1" and host.hits == 1  # nothing fetched
        service.closing.set()  # shutting down: a 503, and /health says so
        status, body, headers = chat(base, user(url), max_tokens=2)
        assert status == 503 and "shutting down" in body["error"]["message"]
        assert get(f"{base}/health")[0] == 503 and host.hits == 1


def test_a_medium_larger_than_the_media_budget_is_refused_before_decoding(labeler, service):
    big = encoded(photo("coffee.jpg", (2000, 2000)), "PNG")
    url = "data:image/png;base64," + base64.b64encode(big).decode()
    with live_server(labeler, service, limits=Limits(max_media_bytes=16 << 20)) as base:
        status, body, _ = chat(base, user(url), max_tokens=2)
    assert status == 400 and "over --max-media-mb 16" in body["error"]["message"]


@pytest.mark.slow
def test_many_large_image_requests_at_once_keep_the_servers_memory_bounded(tiny_dir):
    """24 requests at once, each of two 12-megapixel PNGs (a few KB each, 49 MB each decoded):
    decoded all at once they would take over 2 GB; under a 160 MB media budget the server's
    peak resident memory grows by less than 400 MB over its warm state."""
    buffer = io.BytesIO()
    from PIL import Image

    Image.new("L", (3500, 3500), 128).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    flags = ["--max-preparing", "2", "--max-media-mb", "160", "--max-images", "2"]
    with served_process(tiny_dir, *flags) as (base, process):
        small = (
            "data:image/png;base64,"
            + base64.b64encode(encoded(photo("coffee.jpg", (64, 64)), "PNG")).decode()
        )
        assert chat(base, user(small), max_tokens=2)[0] == 200
        warm = peak_rss_mb(process.pid)
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            codes = list(pool.map(lambda _: chat(base, user(url, url), max_tokens=2)[0], range(24)))
        grown = peak_rss_mb(process.pid) - warm
    print(f"peak RSS warm {warm:.0f} MB, grown by {grown:.0f} MB; statuses {set(codes)}")
    assert codes == [200] * 24 and grown < 400


# Work nobody will read


def test_a_dropped_non_streamed_client_frees_its_sequence(labeler, service, monkeypatch):
    """The client leaves mid-answer: the sequence is dropped within a step or two, far short of
    the 400 tokens it asked for, and the server is idle after."""
    from mmcli.serve.service import Handle

    made, send = [], Handle.send
    monkeypatch.setattr(Handle, "send", lambda h, kind, v: made.append(kind) or send(h, kind, v))
    with live_server(labeler, service) as base:
        port = int(base.rsplit(":", 1)[1])
        body = json.dumps({"model": MODEL, "messages": user(), "max_tokens": 400}).encode()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (port, len(body), body)
            )
            deadline = time.time() + 30
            while made.count("token") < 3 and time.time() < deadline:
                time.sleep(0.01)
        wait_idle(service)
    tokens = made.count("token")
    assert not service.handles and 3 <= tokens < 100 and made[-1] == "done", tokens


def test_a_stop_string_ends_a_non_streamed_sequence_and_usage_counts_what_came(
    labeler, service, monkeypatch
):
    from mmcli.serve.service import Handle

    with live_server(labeler, service) as base:
        status, whole, _ = chat(base, user(), max_tokens=60, logprobs=True)
        tokens = whole["choices"][0]["logprobs"]["content"]
        text = whole["choices"][0]["message"]["content"]
        # a stop string that first appears where the 6th token's text ends
        upto = "".join(t["token"] for t in tokens[:6])
        stop = next(upto[i:] for i in range(len(upto) - 1, -1, -1) if upto[i:] not in upto[:i])
        made, send = [], Handle.send
        monkeypatch.setattr(Handle, "send", lambda h, k, v: made.append(k) or send(h, k, v))
        status, cut, _ = chat(base, user(), max_tokens=60, logprobs=True, stop=[stop])
    choice = cut["choices"][0]
    assert status == 200 and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.find(stop)]
    returned = len(choice["logprobs"]["content"])
    assert cut["usage"]["completion_tokens"] == returned <= 6
    assert made.count("token") < 20  # the sequence ended there, not at max_tokens (60)


def test_a_request_past_its_deadline_is_a_504_and_its_sequence_is_dropped(labeler, service):
    with live_server(labeler, service, limits=Limits(request_timeout=0.5)) as base:
        started = time.time()
        status, body, _ = chat(base, user(), max_tokens=400)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=400, stream=True
        )
        with pytest.raises(openai.APIError, match="--request-timeout 0.5 s"):  # its error event
            list(stream)
        wait_idle(service)
    assert status == 504 and body["error"]["code"] == "timeout" and time.time() - started < 20
    assert not service.handles


def test_a_media_host_that_drips_bytes_is_cut_at_the_fetch_deadline(media_host):
    url, host = media_host
    host.drip = True
    policy = MediaPolicy(allowed_domains=("127.0.0.1",), timeout=1.0)
    from mmcli.serve.protocol import APIError

    started = time.monotonic()
    with pytest.raises(APIError, match="took over 1.0 s"):
        policy.fetch(url, "messages[0].content[0]")
    assert time.monotonic() - started < 3


# The bind, health, the engine's failures


def test_a_server_on_every_interface_with_a_key_accepts_any_host(labeler, service):
    from mmcli.hosts import serving_hosts

    assert serving_hosts("0.0.0.0", 8000, [], "key") is None
    keyless = serving_hosts("0.0.0.0", 8000, [], None)
    assert "127.0.0.1:8000" in keyless and "evil.example:8000" not in keyless
    assert serving_hosts("127.0.0.1", 8000, [], "key") == serving_hosts("127.0.0.1", 8000, [], None)
    with live_server(labeler, service, hosts=None, api_key="k") as base:
        keyed = {"Host": "10.0.0.7:8000", "Authorization": "Bearer k"}
        assert get(f"{base}/v1/models", keyed)[0] == 200
        assert get(f"{base}/v1/models", {"Host": "10.0.0.7:8000"})[0] == 401
    with live_server(labeler, service) as base:  # loopback: the Host check, but not for probes
        assert get(f"{base}/v1/models", {"Host": "lb.internal"})[0] == 400
        status, body, _ = get(f"{base}/health", {"Host": "lb.internal"})
        assert status == 200 and json.loads(body)["status"] == "ok"


@pytest.mark.slow
def test_a_keyless_server_on_every_interface_warns_loudly(tiny_dir):
    with served_process(tiny_dir, "--host", "0.0.0.0") as (base, process):
        assert get(f"{base}/v1/models")[0] == 200  # its own addresses
        assert get(f"{base}/v1/models", {"Host": "evil.example"})[0] == 400
    assert any("WITHOUT an API key" in line for line in process.log)


def test_an_engine_failure_fails_its_sequences_and_the_server_goes_on(labeler, monkeypatch):
    service = EngineService(labeler, max_queue=64, max_failures=2).start()
    fatal = []
    service.on_fatal = fatal.append
    real = labeler.runner.decode
    failing = {"left": 1}

    def decode(items):
        if failing["left"]:
            failing["left"] -= 1
            raise RuntimeError("device lost")
        return real(items)

    monkeypatch.setattr(labeler.runner, "decode", decode)
    try:
        with live_server(labeler, service) as base:
            status, body, _ = chat(base, user(), max_tokens=4)
            assert status == 500 and "device lost" in body["error"]["message"]
            assert chat(base, user(), max_tokens=4)[0] == 200  # the loop went on
            assert get(f"{base}/health")[0] == 200 and not fatal
            failing["left"] = 1
            assert chat(base, user(), max_tokens=4)[0] == 500  # twice in a minute: it gives up
            status, body, _ = get(f"{base}/health")
            assert status == 503 and "failed 2 times" in json.loads(body)["reason"]
            assert fatal and chat(base, user(), max_tokens=4)[0] == 503
    finally:
        service.close()


# What an operator reads


def test_metrics_the_request_id_and_the_access_log(labeler, service):
    from mmcli.serve.app import create_app  # noqa: F401 - the app the live server runs

    lines = []
    with live_server(labeler, service, log=lines.append) as base:
        url = (
            "data:image/png;base64,"
            + base64.b64encode(encoded(photo("chelsea.jpg", (64, 48)), "PNG")).decode()
        )
        status, _, headers = post(
            f"{base}/v1/chat/completions",
            {"model": MODEL, "messages": user(url), "max_tokens": 3},
            {"x-request-id": "job-42"},
        )
        assert status == 200 and headers["x-request-id"] == "job-42"
        assert chat(base, user(), model_extra=1)[0] == 200  # an unknown field: ignored
        assert get(f"{base}/nowhere")[0] == 404
        status, text, headers = get(f"{base}/metrics")
    text = text.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for sample in (
        'mmcli_requests_total{route="/v1/chat/completions",status="200"} 2.0',
        'mmcli_requests_total{route="other",status="404"} 1.0',
        "mmcli_images_total 1.0",
        "mmcli_generation_tokens_total",
        "mmcli_time_to_first_token_seconds_count 2.0",
        "mmcli_request_latency_seconds_bucket",
        "mmcli_queued_requests 0.0",
        "mmcli_running_sequences 0.0",
    ):
        assert sample in text, sample
    assert any('"POST /v1/chat/completions" 200' in line and "id=job-42" in line for line in lines)
