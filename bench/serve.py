"""`mmcli serve` against `caption` and `ask`, in one run and one process, on one loaded model:

- the bench images through 8 concurrent clients (the openai SDK, streaming): images/s, p50/p95
  latency and time to first token, against the same images through the caption loop
  (`Labeler.label`, what `mmcli caption` runs after its load);
- one request's latency against `ask`'s (the load taken out of both);
- 64 concurrent clients (not streaming) with 448x448 images: images/s against the caption loop's
  on the same images, p50/p95 latency, the 429s, and the process's peak resident memory;
- `mmcli batch` on a 100,000-line file (2 KB lines, the tiny checkpoint) against 2,000 lines:
  peak resident memory of each run (bounded: the file is streamed, a window in flight).

python bench/serve.py [--smoke] [--max-new-tokens 64] [--clients 64] [--batch-lines 100000]

Targets: 8 and 64 clients at 0.85x or more of caption's images/s; one request within 1.1x of
ask; the 100,000-line batch within 100 MB of the 2,000-line one."""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_hf import PROMPT, ROOT, make_inputs  # noqa: E402

from mmcli.config import load_config  # noqa: E402
from mmcli.testing import (  # noqa: E402
    batch_peak_rss_mb,
    live_server,
    make_tiny_checkpoint,
    padded_batch_file,
    peak_rss_mb,
)


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def one_stream(client, image: Path, tokens: int) -> tuple[float, float, str]:
    """(seconds to the first text, seconds to the end, the text) of one streamed request."""
    started, first, text = time.perf_counter(), None, []
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(image)}},
                {"type": "text", "text": PROMPT},
            ],
        }
    ]
    stream = client.chat.completions.create(
        model="bench", messages=messages, max_tokens=tokens, stream=True
    )
    for chunk in stream:
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece and first is None:
            first = time.perf_counter() - started
        text.append(piece or "")
    end = time.perf_counter() - started
    # a random model's text can be held back to its end (pieces of UTF-8 characters)
    return first if first is not None else end, end, "".join(text)


def caption_rate(labeler, images: list[Path], tokens: int) -> tuple[float, dict]:
    items = [(f"k{n}", str(p)) for n, p in enumerate(images)]
    started = time.perf_counter()
    texts = {r.key: r.text for r in labeler.label(items, max_new_tokens=tokens)}
    return len(images) / (time.perf_counter() - started), texts


def ask_seconds(labeler, image: Path, tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        labeler.ask([str(image)], PROMPT, max_new_tokens=tokens)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def concurrent_run(client, images: list[Path], tokens: int) -> tuple[float, list, list, list]:
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        runs = list(pool.map(lambda p: one_stream(client, p, tokens), images))
    rate = len(images) / (time.perf_counter() - started)
    return rate, [r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]


def one_answer(client, image: Path, tokens: int) -> tuple[float, bool]:
    """(seconds, whether it was refused with a 429) of one request, not streamed."""
    import openai

    started = time.perf_counter()
    try:
        client.chat.completions.create(model="bench", messages=_messages(image), max_tokens=tokens)
        return time.perf_counter() - started, False
    except openai.RateLimitError:
        return time.perf_counter() - started, True


def _messages(image: Path) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": PROMPT}]}]


def many_clients(client, images: list[Path], tokens: int) -> tuple[float, list, int]:
    """(images/s answered, latencies, 429s) of one client a thread for each image, at once."""
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        runs = list(pool.map(lambda p: one_answer(client, p, tokens), images))
    refused = sum(r[1] for r in runs)
    rate = (len(images) - refused) / (time.perf_counter() - started)
    return rate, [r[0] for r in runs if not r[1]], refused


def square_images(cache: Path, count: int, side: int = 448) -> list[Path]:
    """`count` different side x side photos of the samples (rotated apart: no cache hits)."""
    from PIL import Image

    names = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]
    folder = cache / f"images{side}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n in range(count):
        path = folder / f"{n:03d}.png"
        if not path.is_file():
            im = Image.open(ROOT / "samples" / names[n % 4]).convert("RGB")
            im.rotate(n * 3).resize((side, side), Image.BICUBIC).save(path)
        paths.append(path)
    return paths


def batch_memory(cache: Path, lines: int) -> tuple[float, float]:
    """Peak RSS (MB) of `mmcli batch` on 2,000 lines and on `lines` lines."""
    model = cache / "tiny"
    if not (model / "config.json").is_file():
        make_tiny_checkpoint(model, dtype="bfloat16")
    runs = []
    for count in (2_000, lines):
        requests = padded_batch_file(cache / f"batch-{count}.jsonl", count)
        output = cache / f"batch-{count}-out.jsonl"
        output.unlink(missing_ok=True)
        runs.append(batch_peak_rss_mb(model, requests, output))
        requests.unlink()
    return runs[0], runs[1]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    import openai

    from mmcli import Labeler
    from mmcli.serve.service import EngineService

    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".bench_cache")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--batch-lines", type=int, default=100_000)
    args = parser.parse_args()
    clients = 8 if args.smoke else args.clients
    batch_lines = 3_000 if args.smoke else args.batch_lines
    tokens = 8 if args.smoke else args.max_new_tokens
    ckpt, images, _ = make_inputs(args.cache_dir, args.smoke, count=8)
    images = (images * 2)[:8]
    settings = {"device": "cpu", "engine": {"max_seqs": 8}}
    labeler = Labeler.from_pretrained(str(ckpt), config=load_config(None, settings))
    caption_rate(labeler, images, tokens)  # warm: kernels built, the cache grown to 8 rows
    caption, texts = caption_rate(labeler, images, tokens)
    ask = ask_seconds(labeler, images[0], tokens, args.repeats)
    service = EngineService(labeler).start()
    try:
        with live_server(labeler, service, model="bench", log=lambda line: None) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            single = statistics.median(
                one_stream(client, images[0], tokens)[1] for _ in range(args.repeats)
            )
            served, firsts, ends, answers = concurrent_run(client, images, tokens)
            squares = square_images(args.cache_dir, clients)
            caption_squares, _ = caption_rate(labeler, squares, tokens)
            before = peak_rss_mb(os.getpid())
            many, latencies, refused = many_clients(client, squares, tokens)
            after = peak_rss_mb(os.getpid())
    finally:
        service.close()
    small, large = batch_memory(args.cache_dir, batch_lines)
    same = sum(a == texts[f"k{n}"] for n, a in enumerate(answers))
    print(f"checkpoint {ckpt.name}, {len(images)} images, {tokens} new tokens each")
    print(f"caption loop: {caption:.3f} images/s")
    print(
        f"8 concurrent clients: {served:.3f} images/s = {served / caption:.2f}x caption's "
        "(target >= 0.85)"
    )
    print(
        f"  latency p50 {quantile(ends, 0.5):.2f} s, p95 {quantile(ends, 0.95):.2f} s; "
        f"time to first token p50 {quantile(firsts, 0.5):.2f} s, p95 "
        f"{quantile(firsts, 0.95):.2f} s; {same} of {len(images)} answers as caption's"
    )
    print(
        f"one request: {single:.3f} s, ask {ask:.3f} s = {single / ask:.2f}x ask's (target <= 1.1)"
    )
    print(
        f"{clients} concurrent clients, 448x448 images: {many:.3f} images/s = "
        f"{many / caption_squares:.2f}x caption's {caption_squares:.3f} (target >= 0.85); "
        f"{refused} answered 429"
    )
    if latencies:
        print(
            f"  latency p50 {quantile(latencies, 0.5):.2f} s, p95 {quantile(latencies, 0.95):.2f} "
            f"s; peak RSS {after:.0f} MB ({after - before:+.0f} MB over this phase)"
        )
    print(
        f"mmcli batch peak RSS: 2,000 lines {small:.0f} MB, {batch_lines:,} lines {large:.0f} MB "
        f"({large - small:+.0f} MB; target < 100)"
    )


if __name__ == "__main__":
    main()
