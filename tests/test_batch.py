"""`mmcli batch`: an OpenAI Batch API file run offline through the engine, its output lines in the
Batch API's format, resumable; a bad line is its own error, a repeated custom_id refused."""

import json

import pytest
from conftest import SAMPLES, read_records
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.testing import batch_peak_rss_mb, padded_batch_file

pytest.importorskip("fastapi")


def _line(custom_id, content, **body):
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": content}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _image(url, text="Describe this image."):
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


def _batch(tiny_dir, requests, out):
    args = ["batch", str(requests), "-o", str(out), "--model", str(tiny_dir), "-q"]
    return CliRunner().invoke(app, [*args, "--dtype", "float32", "--device", "cpu"])


def test_a_batch_file_gives_the_batch_apis_lines_resumes_and_reports_bad_lines(tiny_dir, tmp_path):
    from mmcli import Labeler

    (tmp_path / "coffee.jpg").write_bytes((SAMPLES / "coffee.jpg").read_bytes())
    lines = [
        _line("a", _image(f"file://{tmp_path / 'coffee.jpg'}"), max_tokens=8),
        _line("b", "Say something.", max_tokens=6, temperature=0.7, seed=3),
        _line("e", _image("coffee.jpg"), max_tokens=8),  # a path: beside the requests file
        _line("c", _image(f"file://{SAMPLES / 'chelsea.jpg'}"), max_tokens=8),  # outside
        _line("d", "hi", logit_bias={"5": 1}),
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(map(json.dumps, lines)) + "\n{not json\n")
    out = tmp_path / "results.jsonl"
    assert _batch(tiny_dir, requests, out).exit_code == 1  # some lines failed
    results = {r["custom_id"]: r for r in read_records(out)}
    assert set(results) == {"a", "b", "c", "d", "e", None} and len(read_records(out)) == 6
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    answer = results["a"]["response"]
    expected = cap.ask([str(SAMPLES / "coffee.jpg")], "Describe this image.", max_new_tokens=8)
    assert answer["status_code"] == 200 and results["a"]["error"] is None
    assert answer["body"]["choices"][0]["message"]["content"] == expected.text
    assert answer["body"]["object"] == "chat.completion" and answer["request_id"]
    assert results["e"]["response"]["body"]["choices"] == answer["body"]["choices"]
    sampled = cap.ask([], "Say something.", max_new_tokens=6, temperature=0.7, seed=3)
    assert results["b"]["response"]["body"]["choices"][0]["message"]["content"] == sampled.text
    for custom_id, says in (("c", "inside the allowed"), ("d", "logit_bias")):
        response = results[custom_id]["response"]
        assert response["status_code"] == 400 and says in response["body"]["error"]["message"]
    assert "line 6: not JSON" in results[None]["error"]["message"]
    before = out.read_text()
    assert _batch(tiny_dir, requests, out).exit_code == 1  # the failed ones again, no answer
    again = read_records(out)[6:]
    assert out.read_text().startswith(before)
    assert sorted(r["custom_id"] for r in again) == ["c", "d"]  # a and b are kept, not redone


def test_a_repeated_custom_id_is_refused_before_loading(tiny_dir, tmp_path, monkeypatch):
    from mmcli.api.labeler import Labeler

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Labeler, "from_run", refuse)
    requests = tmp_path / "requests.jsonl"
    lines = [_line("x", "hi"), _line("y", "hi"), _line("x", "again")]
    requests.write_text("\n".join(map(json.dumps, lines)) + "\n")
    result = _batch(tiny_dir, requests, tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "custom_id 'x' is on line 1 and line 3" in result.output


def test_a_failure_of_one_line_is_that_lines_error(tiny_dir, tmp_path, monkeypatch):
    import mmcli.serve.batch as batch

    real = batch.build_job

    def build_job(labeler, body, *args, **kwargs):
        if body.messages[0].content == "break":
            raise RuntimeError("the tokenizer broke")
        return real(labeler, body, *args, **kwargs)

    monkeypatch.setattr(batch, "build_job", build_job)
    requests = tmp_path / "requests.jsonl"
    lines = [
        _line("ok", "hi", max_tokens=2),
        _line("bad", "break"),
        _line("ok2", "hi", max_tokens=2),
    ]
    requests.write_text("\n".join(map(json.dumps, lines)) + "\n")
    out = tmp_path / "out.jsonl"
    assert _batch(tiny_dir, requests, out).exit_code == 1
    results = {r["custom_id"]: r["response"] for r in read_records(out)}
    assert results["ok"]["status_code"] == results["ok2"]["status_code"] == 200
    error = results["bad"]["body"]["error"]
    assert results["bad"]["status_code"] == 500 and error["type"] == "server_error"
    assert "RuntimeError: the tokenizer broke" in error["message"]


@pytest.mark.slow
def test_a_large_file_runs_in_bounded_memory(tiny_dir, tmp_path):
    """The file is read as a stream with a bounded window in flight: 20,000 lines of 2 KB peak
    within 40 MB of what 1,000 lines do (bench/serve.py runs 100,000); every line is answered
    once."""
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    padded_batch_file(small, 1_000)
    padded_batch_file(large, 20_000)
    base = batch_peak_rss_mb(tiny_dir, small, tmp_path / "small-out.jsonl")
    peak = batch_peak_rss_mb(tiny_dir, large, tmp_path / "large-out.jsonl")
    print(f"peak RSS: 1,000 lines {base:.0f} MB, 20,000 lines {peak:.0f} MB")
    with open(tmp_path / "large-out.jsonl") as f:
        statuses = [json.loads(line)["response"]["status_code"] for line in f]
    assert len(statuses) == 20_000 and statuses.count(200) == 20
    assert peak - base < 40
