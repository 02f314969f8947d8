"""`mmcli serve` through the `openai` SDK against a live server on a tiny checkpoint: answers equal
to `ask`'s whatever else is in flight, streaming, JSON under a schema, log-probabilities, every
error in OpenAI's shape with its status, the key, the Host check and the media rules."""

import base64
import concurrent.futures
import http.server
import io
import json
import socket
import threading
import time

import jsonschema
import pytest
from conftest import SAMPLES, encoded, photo

from mmcli.testing import live_server

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from mmcli.serve.chat import Limits  # noqa: E402
from mmcli.serve.media import MediaPolicy  # noqa: E402
from mmcli.serve.service import EngineService  # noqa: E402

MODEL = "tiny"
QUESTION = "Describe this image."


def _labeler(tiny_dir):
    from mmcli import Labeler
    from mmcli.config import load_config

    settings = {"device": "cpu", "dtype": "float32", "engine": {"max_len": 512}}
    return Labeler.from_pretrained(str(tiny_dir), config=load_config(None, settings))


@pytest.fixture(scope="module")
def labeler(tiny_dir):
    """The server's: its engine runs in the service's thread alone."""
    return _labeler(tiny_dir)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Another load of the same checkpoint, for `ask`'s answers."""
    return _labeler(tiny_dir)


@pytest.fixture(scope="module")
def service(labeler):
    service = EngineService(labeler, max_queue=64).start()
    yield service
    service.close()


@pytest.fixture(scope="module")
def base(labeler, service, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    (media / "coffee.jpg").write_bytes((SAMPLES / "coffee.jpg").read_bytes())
    policy = MediaPolicy(allowed_dir=media, allowed_domains=("127.0.0.1",))
    with live_server(labeler, service, media=policy, limits=Limits(max_images=2)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def data_url(name: str, size=None) -> str:
    data = encoded(photo(name, size), "JPEG") if size else (SAMPLES / name).read_bytes()
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def user(*images, text=QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def ask(labeler, names, text=QUESTION, **sampling):
    """What `ask` answers about these samples."""
    return labeler.ask([str(SAMPLES / n) for n in names], text, **sampling)


@pytest.mark.parametrize("names", [[], ["coffee.jpg"], ["coffee.jpg", "chelsea.jpg"]])
def test_an_answer_is_asks_with_its_logprobs(client, reference, names):
    reply = client.chat.completions.create(
        model=MODEL, messages=user(*map(data_url, names)), max_tokens=12, logprobs=True
    )
    expected = ask(reference, names, max_new_tokens=12)
    choice = reply.choices[0]
    assert choice.message.content == expected.text and choice.finish_reason == "length"
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(expected.logprobs)
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == expected.num_input_tokens


def test_top_logprobs_are_the_most_likely_tokens_at_each_step(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=user(), max_tokens=6, logprobs=True, top_logprobs=3
    )
    for token in reply.choices[0].logprobs.content:  # greedy: the chosen token is the top one
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)


def test_stream_and_non_stream_give_the_same_text_and_usage(client):
    messages = user(data_url("chelsea.jpg"))
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_sampled_answers_are_asks_and_n_gives_several(client, reference):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 5}
    reply = client.chat.completions.create(
        model=MODEL, messages=user(data_url("coffee.jpg")), max_tokens=10, n=3, **sampling
    )
    expected = ask(reference, ["coffee.jpg"], max_new_tokens=10, **sampling)
    assert reply.choices[0].message.content == expected.text
    assert len(reply.choices) == 3 and len({c.message.content for c in reply.choices}) > 1


def test_a_stop_string_cuts_the_answer_before_it_streamed_or_not(client):
    messages = user(data_url("astronaut.jpg"))
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24)
    text = whole.choices[0].message.content
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text.find(text[i : i + 2]) == i)
    cut = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, stop=[stop, "never"]
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, stop=stop, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.find(stop)]


def test_json_schema_answers_parse_and_validate(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 8}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=user(data_url("coffee.jpg"), text="The main colour, as JSON."),
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_eight_concurrent_clients_each_get_their_single_run(client, reference):
    names = ["coffee.jpg", "chelsea.jpg", "astronaut.jpg", "rocket.jpg"] * 2
    questions = [f"{QUESTION} ({i})" for i in range(8)]
    alone = [ask(reference, [n], q, max_new_tokens=10).text for n, q in zip(names, questions)]

    def one(i):
        messages = user(data_url(names[i]), text=questions[i])
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    assert [r.choices[0].message.content for r in replies] == alone


def test_a_request_that_fails_fails_alone(client, reference):
    """A bad request among good ones in flight: the good ones get their answers."""
    good = user(data_url("rocket.jpg"))
    bad = user("data:image/png;base64,aGVsbG8=")

    def one(messages):
        try:
            reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
            return reply.choices[0].message.content
        except openai.BadRequestError as e:
            return e.status_code

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        answers = list(pool.map(one, [good, good, bad, good, good]))
    expected = ask(reference, ["rocket.jpg"], max_new_tokens=8).text
    assert answers == [expected, expected, 400, expected, expected]


def test_a_client_that_disconnects_mid_stream_frees_its_sequence(base, service, monkeypatch):
    """The sequence is dropped at the next step once the client is gone: far fewer tokens are
    made than it asked for (the engine's max_len allows all 400)."""
    from mmcli.serve.service import Handle

    made, send = [], Handle.send
    monkeypatch.setattr(Handle, "send", lambda h, kind, v: made.append(kind) or send(h, kind, v))
    body = json.dumps({"model": MODEL, "messages": user(), "max_tokens": 400, "stream": True})
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (port, len(body), body.encode())
        )
        received = b""
        while received.count(b"data:") < 3:
            received += conn.recv(4096)
    deadline = time.time() + 30
    while service.handles and time.time() < deadline:
        time.sleep(0.05)
    tokens = made.count("token")
    assert not service.handles and 3 <= tokens < 100 and made[-1] == "done", tokens


def _status(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value.status_code, caught.value.body


@pytest.mark.parametrize(
    "messages, extra, status, says",
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}],
            {},
            400,
            "base64",
        ),
        (user("data:image/png;base64,aGVsbG8="), {}, 400, "not an image"),
        (user(*[data_url("coffee.jpg")] * 3), {}, 400, "over --max-images 2"),
        (user(text="word " * 600), {}, 400, "does not fit engine.max_len"),
        (
            user(),
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 7}},
                }
            },
            400,
            "cannot be compiled",
        ),
        (user(), {"extra_body": {"logit_bias": {"5": 1}}}, 400, "logit_bias: not implemented"),
        (user(), {"presence_penalty": 2.5}, 400, "presence_penalty"),
        (user(), {"top_logprobs": 2}, 400, "top_logprobs: needs logprobs"),
        (user(f"file://{SAMPLES / 'coffee.jpg'}"), {}, 400, "no such file inside"),
        (user("http://127.0.0.1:1/x.jpg"), {}, 400, "not a public address"),
        (user("http://example.com/x.jpg"), {}, 400, "not allowed"),
    ],
)
def test_bad_requests_are_400s_in_openais_shape(client, messages, extra, status, says):
    code, body = _status(
        lambda: client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, **extra
        )
    )
    assert code == status and says in body["message"], body
    assert set(body) == {"message", "type", "param", "code"} and body["type"]


def test_a_file_inside_the_allowed_folder_is_read(client, reference, tmp_path_factory):
    media = next(p for p in tmp_path_factory.getbasetemp().glob("media*"))
    reply = client.chat.completions.create(
        model=MODEL, messages=user(f"file://{media / 'coffee.jpg'}"), max_tokens=8
    )
    assert reply.choices[0].message.content == ask(reference, ["coffee.jpg"], max_new_tokens=8).text


def test_a_redirect_is_not_followed(client, monkeypatch):
    """A permitted host that redirects (here to loopback) is refused, not followed."""
    import mmcli.serve.media as media

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:9/secret")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(media, "public_address", lambda host, port, param: "127.0.0.1")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/a.jpg"
        code, body = _status(
            lambda: client.chat.completions.create(model=MODEL, messages=user(url), max_tokens=4)
        )
    finally:
        server.shutdown()
    assert code == 400 and "redirects are not followed" in body["message"]


def test_malformed_body_wrong_model_and_host_are_refused(base):
    import urllib.error
    import urllib.request

    def post(data: bytes, headers=None):
        request = urllib.request.Request(
            f"{base}/v1/chat/completions",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert post(b"{not json")[0] == 400
    code, body = post(json.dumps({"model": MODEL, "messages": []}).encode())
    assert code == 400 and body["error"]["param"] == "messages"
    code, body = post(json.dumps({"model": "other", "messages": user()}).encode())
    assert code == 404 and body["error"]["code"] == "model_not_found"
    code, body = post(b"{}", {"Host": "evil.example:8000"})
    assert code == 400 and "not this server's address" in body["error"]["message"]


def test_the_key_body_limit_and_queue_limit(labeler, service, monkeypatch):
    limits = Limits(max_body_bytes=1 << 20, max_queue=64)
    with live_server(labeler, service, api_key="s3cret", limits=limits) as url:
        keyless = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        code, body = _status(lambda: keyless.models.list())
        assert code == 401 and body["code"] == "invalid_api_key"
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in keyed.models.list()] == [MODEL]
        big = user(*[data_url("astronaut.jpg", (1200, 1200))] * 8)
        assert len(json.dumps(big)) > 1 << 20
        code, _ = _status(lambda: keyed.chat.completions.create(model=MODEL, messages=big))
        assert code == 413
        monkeypatch.setattr(service, "max_queue", 0)
        code, body = _status(
            lambda: keyed.chat.completions.create(model=MODEL, messages=user(), max_tokens=2)
        )
        assert code == 429 and body["type"] == "rate_limit_error"


def test_an_image_over_the_decode_limit_is_refused(client):
    """A decompression bomb: a small file of many pixels, refused before it is decoded."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (12000, 12000)).save(buffer, "PNG")  # 144 Mpx in a few hundred KB
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    code, body = _status(
        lambda: client.chat.completions.create(model=MODEL, messages=user(url), max_tokens=2)
    )
    assert code == 400 and "decode limit" in body["message"]


def test_a_video_as_a_data_url_is_asks_answer(client, reference, tmp_path):
    from mmcli.testing import make_test_video

    video = make_test_video(tmp_path / "clip.mp4", seconds=2, fps=8)
    url = "data:video/mp4;base64," + base64.b64encode(video.read_bytes()).decode()
    parts = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=10
    )
    expected = reference.ask([], QUESTION, videos=[str(video)], max_new_tokens=10)
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.num_input_tokens


@pytest.mark.slow
def test_sigterm_stops_admitting_finishes_in_flight_and_exits_0(tiny_dir):
    """A streaming answer in flight when SIGTERM comes is finished; then the process exits 0."""
    import signal

    from mmcli.testing import served_process

    with served_process(tiny_dir) as (base, server):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=400, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)
        server.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(openai.APIConnectionError):  # admits nothing more
            client.models.list()
        rest = list(chunks)
        assert first.choices[0].delta.role == "assistant"
        assert rest[-1].choices[0].finish_reason == "length"  # every token asked for came
        assert server.wait(timeout=60) == 0, "".join(server.log)


def test_a_chunked_body_over_the_limit_is_a_413(labeler, service):
    """No Content-Length to refuse it by: the body is cut as it arrives."""
    import http.client

    with live_server(labeler, service, limits=Limits(max_body_bytes=1 << 16)) as url:
        port = int(url.rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port)
        body = json.dumps({"model": MODEL, "messages": user(text="x" * (1 << 17))}).encode()
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=iter([body[:1000], body[1000:]]),
            headers={"Content-Type": "application/json"},
            encode_chunked=True,
        )
        response = conn.getresponse()
        assert (
            response.status == 413
            and "max-body-mb" in json.loads(response.read())["error"]["message"]
        )


# What clients send


def test_penalties_and_min_p_are_asks_and_developer_is_system(client, reference):
    for fields in (
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.8, "presence_penalty": -0.5},
        {"temperature": 0.9, "min_p": 0.2, "seed": 5},
    ):
        sdk = {k: v for k, v in fields.items() if k != "min_p"}  # the SDK's own arguments
        extra = {"min_p": fields["min_p"]} if "min_p" in fields else None
        reply = client.chat.completions.create(
            model=MODEL,
            messages=user(data_url("coffee.jpg")),
            max_tokens=12,
            extra_body=extra,
            **sdk,
        )
        expected = ask(reference, ["coffee.jpg"], max_new_tokens=12, **fields)
        assert reply.choices[0].message.content == expected.text, fields
    turns = [{"role": "system", "content": "Be brief."}, *user()]
    as_developer = [{"role": "developer", "content": "Be brief."}, *user()]
    answers = [
        client.chat.completions.create(model=MODEL, messages=m, max_tokens=8, logprobs=True)
        for m in (turns, as_developer)
    ]
    assert answers[0].usage == answers[1].usage
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


def test_sampled_requests_without_a_seed_differ_and_unknown_fields_are_ignored(client):
    def sampled(**extra):
        reply = client.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=16, temperature=1.0, **extra
        )
        return reply.choices[0].message.content

    assert len({sampled() for _ in range(3)}) > 1  # a fresh seed each
    assert sampled(seed=11) == sampled(seed=11)
    assert sampled(seed=11, extra_body={"guided_choice": None, "ignore_eos": False})


def test_reasoning_effort_needs_a_model_that_thinks(client):
    code, body = _status(
        lambda: client.chat.completions.create(
            model=MODEL, messages=user(), max_tokens=4, reasoning_effort="high"
        )
    )
    assert code == 400 and body["param"] == "reasoning_effort" and "<think>" in body["message"]
    reply = client.chat.completions.create(  # "none": thinking off, as this model already is
        model=MODEL, messages=user(), max_tokens=4, reasoning_effort="none"
    )
    assert reply.choices[0].finish_reason == "length"


# Every error in OpenAI's shape


@pytest.mark.parametrize(
    "url, says",
    [
        ("http://127.0.0.1:99999/x.jpg", "not a URL mmcli can read"),
        ("file:///tmp/a%00b.jpg", "not a URL mmcli can read"),
        ("https://127.0.0.1:1/x.jpg", "cannot fetch the media URL"),
    ],
)
def test_bad_urls_are_400s_not_500s(client, monkeypatch, url, says):
    import mmcli.serve.media as media

    monkeypatch.setattr(media, "public_address", lambda host, port, param: "127.0.0.1")
    code, body = _status(
        lambda: client.chat.completions.create(model=MODEL, messages=user(url), max_tokens=2)
    )
    assert code == 400 and says in body["message"], body


def test_an_unreadable_file_and_a_template_refusal_are_400s(
    client, labeler, monkeypatch, tmp_path_factory
):
    from pathlib import Path

    from jinja2 import TemplateError

    media = next(p for p in tmp_path_factory.getbasetemp().glob("media*"))

    def unreadable(self):
        raise PermissionError(13, "Permission denied")

    with monkeypatch.context() as patched:
        patched.setattr(Path, "read_bytes", unreadable)
        code, body = _status(
            lambda: client.chat.completions.create(
                model=MODEL, messages=user(f"file://{media / 'coffee.jpg'}"), max_tokens=2
            )
        )
    assert code == 400 and "cannot read the file (Permission denied)" in body["message"]

    def refuse(*args, **kwargs):
        raise TemplateError("Unexpected message role.")

    monkeypatch.setattr(labeler.requests, "build_messages", refuse)
    code, body = _status(
        lambda: client.chat.completions.create(model=MODEL, messages=user(), max_tokens=2)
    )
    assert (
        code == 400
        and "the chat template refuses them (Unexpected message role.)" in (body["message"])
    )


def test_unknown_routes_and_methods_and_failures_answer_in_openais_shape(
    base, labeler, monkeypatch
):
    import urllib.error
    import urllib.request

    def call(path, method="GET"):
        request = urllib.request.Request(f"{base}{path}", method=method)
        try:
            with urllib.request.urlopen(request) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for path, method, status in (("/v1/embeddings", "POST", 404), ("/v1/models", "POST", 405)):
        code, body = call(path, method)
        assert code == status and set(body["error"]) == {"message", "type", "param", "code"}

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(labeler.requests, "build_messages", broken)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    code, body = _status(
        lambda: client.chat.completions.create(model=MODEL, messages=user(), max_tokens=2)
    )
    assert code == 500 and body["type"] == "server_error" and "KeyError" in body["message"]


def test_reasoning_effort_maps_to_thinking_and_chat_template_kwargs_win():
    from mmcli.serve.protocol import ChatCompletionRequest

    def thinking(**fields):
        return ChatCompletionRequest(model=MODEL, messages=user(), **fields).thinking

    assert thinking() is None  # the server's --thinking
    assert [thinking(reasoning_effort=e) for e in ("none", "minimal", "low", "medium", "high")] == [
        False,
        False,
        True,
        True,
        True,
    ]
    kwargs = {"enable_thinking": False}
    assert thinking(reasoning_effort="high", chat_template_kwargs=kwargs) is False


def test_the_compiled_schemas_kept_are_bounded(labeler, monkeypatch):
    import mmcli.api.labeler as labeler_module

    monkeypatch.setattr(labeler_module, "JSON_GRAMMARS_KEPT", 2)
    monkeypatch.setattr(labeler, "_json_grammars", type(labeler._json_grammars)())
    schemas = [json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
               for i in range(3)]  # fmt: skip
    first = labeler.json_grammar(schemas[0], None)
    for schema in schemas[1:]:
        labeler.json_grammar(schema, None)
    assert len(labeler._json_grammars) == 2
    assert labeler.json_grammar(schemas[0], None) is not first  # dropped, compiled again
