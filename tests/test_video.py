"""Videos: frame sampling, timestamps, sizing, bad files, and parity with transformers' Qwen3-VL
video path.

transformers' video processor needs torchvision (no CPU build on the index here), so the model
and positions are compared on our pixel values, and sampling, sizing and timestamps against
hand-computed values and the reference's own formulas (its processor's _calculate_timestamps, its
video smart_resize)."""

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from conftest import hf_model, photo, prefill_logits, reference_prompt_ids
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.inputs.video import (
    VideoSampling,
    decode_video,
    group_timestamps,
    sample_indices,
    video_smart_resize,
)
from mmcli.testing import make_test_video

av = pytest.importorskip("av")
QUESTION = "What happens in this video?"


def test_a_ten_second_30_fps_video_at_2_fps_samples_and_stamps_as_computed_by_hand(
    tiny_dir, tmp_path
):
    video = decode_video(
        make_test_video(tmp_path / "v.mp4", seconds=10, fps=30), VideoSampling(fps=2)
    )
    # n = int(300 / 30 * 2) = 20; round(linspace(0, 299, 20)), step 299/19 = 15.74
    assert video.indices == [
        0,
        16,
        31,
        47,
        63,
        79,
        94,
        110,
        126,
        142,
        157,
        173,
        189,
        205,
        220,
        236,
        252,
        268,
        283,
        299,
    ]
    assert video.times == [i / 30 for i in video.indices] and (
        video.duration,
        video.source_fps,
    ) == (10.0, 30.0)
    # frame k is grey (7k) % 256, lossy
    greys = [int(np.asarray(f)[40, 60, 0]) for f in video.frames]
    assert all(abs(g - (7 * i) % 256) <= 8 for g, i in zip(greys, video.indices)), greys
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    req, infos = cap.request("k", [], QUESTION, cap.sampling(), videos=[tmp_path / "v.mp4"])
    text = cap.prompts.tokenizer.decode(req.input_ids, skip_special_tokens=False)
    # pairs of frames, the mean of their times: (0 + 16/30)/2 = 0.27 -> 0.3, (31 + 47)/60 = 1.3, ...
    assert re.findall(r"<([\d.]+) seconds>", text) == [
        "0.3",
        "1.3",
        "2.4",
        "3.4",
        "4.5",
        "5.5",
        "6.6",
        "7.6",
        "8.7",
        "9.7",
    ]
    assert infos[0]["video"] == {
        "duration": 10.0,
        "source_fps": 30.0,
        "num_frames": 20,
        "frame_times": [round(i / 30, 3) for i in video.indices],
    }


def test_sampling_sizing_and_stamps_follow_the_reference_formulas():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    for total, fps in [(300, 30.0), (7, 24.0), (12345, 29.97), (50, 25.0)]:
        for sampling in [
            VideoSampling(fps=2),
            VideoSampling(fps=1, min_frames=8),
            VideoSampling(fps=None, num_frames=9),
        ]:
            indices = sample_indices(total, fps, sampling)
            count = sampling.num_frames or min(
                max(int(total / fps * sampling.fps), sampling.min_frames),
                sampling.max_frames,
                total,
            )
            assert indices == np.linspace(0, total - 1, count).round().astype(int).tolist()
            stamps = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
            assert group_timestamps([i / fps for i in indices]) == stamps
    for frames, height, width in [
        (20, 480, 640),
        (4, 1080, 1920),
        (768, 720, 1280),
        (5, 33, 2000),
        (2, 20, 30),
    ]:
        budget = VideoSampling(min_pixels=4096, max_pixels=25_165_824)
        assert video_smart_resize(frames, height, width, budget) == smart_resize(
            frames, height, width, 2, 32, 4096, 25_165_824
        )


def test_video_settings_are_checked_and_win_over_the_checkpoint(tmp_path):
    from mmcli.config import load_config
    from mmcli.errors import ConfigError

    for bad, key in [
        ({"fps": 2, "num_frames": 8}, "video.num_frames"),
        ({"min_frames": 8, "max_frames": 4}, "video.max_frames"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, {"video": bad})
    (tmp_path / "video_preprocessor_config.json").write_text(
        json.dumps({"num_frames": 16, "min_frames": 2})
    )
    # the checkpoint's count, min_frames from the settings
    assert (
        VideoSampling.from_checkpoint(
            tmp_path, load_config(None, {"video": {"min_frames": 6}}).video
        ).num_frames
        == 16
    )
    chosen = VideoSampling.from_checkpoint(
        tmp_path, load_config(None, {"video": {"fps": 1.0}}).video
    )
    assert (chosen.fps, chosen.num_frames, chosen.min_frames) == (1.0, None, 2)


def test_a_rotated_file_comes_out_upright_and_seeking_skips_what_is_not_sampled(tmp_path):
    for rotation in (90, -90, 180):
        video = decode_video(
            make_test_video(tmp_path / f"r{rotation}.mp4", rotation=rotation), VideoSampling()
        )
        frame = np.asarray(video.frames[0])[..., 0]
        assert video.frames[0].size == (96, 64)  # as displayed
        # the white corner top left
        assert frame[:16, :24].mean() > 240 and frame[-16:, -24:].mean() < 40
    # resized as decoded (a long 4K file never holds its full-size frames): 4 frames of 64x96 in
    # 8192 pixels a video
    small = decode_video(
        tmp_path / "r90.mp4", VideoSampling(min_pixels=1024, max_pixels=8192), resample=3
    )
    assert [f.size for f in small.frames] == [(32, 32)] * 4 and small.size == (96, 64)
    long = make_test_video(tmp_path / "long.mp4", seconds=120, fps=10, keyframe_every=10)
    video = decode_video(long, VideoSampling(max_frames=8))
    assert len(video.frames) == 8 and video.total_frames == 1200 and video.frames_decoded <= 8 * 10


def test_a_clip_whose_timestamps_start_late_is_whole_and_times_count_from_its_start(tmp_path):
    # WebM and Matroska cut from a stream: the first frame at 5 s, the header's duration an end time
    times = [5 + k / 10 for k in range(20)]
    for name, codec in (("late.mkv", "mpeg4"), ("late.webm", "libvpx")):
        video = decode_video(
            make_test_video(tmp_path / name, frame_times=times, codec=codec), VideoSampling(fps=2)
        )
        assert video.duration == 2.0 and video.total_frames == 20 and not video.notes
        assert [round(t, 3) for t in video.times] == [0.0, 0.6, 1.3, 1.9]


def test_variable_rate_is_seen_in_the_frames_own_times(tmp_path):
    # Matroska's header rates agree (10 and 10) on a clip whose frames alternate 140 and 60 ms
    times = [round(k / 10 + (0.04 if k % 2 else 0), 3) for k in range(20)]
    vfr = decode_video(make_test_video(tmp_path / "vfr.mkv", frame_times=times), VideoSampling())
    cfr = decode_video(make_test_video(tmp_path / "cfr.mkv"), VideoSampling())
    assert any("variable frame rate" in n for n in vfr.notes) and not cfr.notes


def test_a_mirrored_clip_comes_out_mirrored_not_turned(tmp_path):
    for mirror in ("horizontal", "vertical"):
        clip = make_test_video(tmp_path / f"{mirror}.mp4", mirror=mirror)
        frame = np.asarray(decode_video(clip, VideoSampling()).frames[0])[..., 0]
        # the white corner top left, as shown; turned 180 degrees it would be bottom right
        assert frame[:16, :24].mean() > 240 and frame[-16:, -24:].mean() < 40


def _bad_videos(root):
    good = make_test_video(root / "good.mp4")
    data = good.read_bytes()
    (root / "corrupt.mp4").write_bytes(bytes(range(256)) * 16)
    (root / "truncated.mp4").write_bytes(data[: len(data) // 2])
    mkv = make_test_video(root / "long.mkv", seconds=4).read_bytes()
    (root / "long.mkv").unlink()
    (root / "cut.mkv").write_bytes(mkv[: len(mkv) // 2])  # readable from the start, ends early
    (root / "unknown_codec.mkv").write_bytes(mkv.replace(b"V_MPEG4/ISO/ASP", b"V_ZZZZZ/ISO/ASP"))
    with av.open(str(root / "no_frames.mp4"), "w") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width = stream.height = 64
        container.start_encoding()
    with av.open(str(root / "audio_only.mp4"), "w") as container:
        stream = container.add_stream("aac", rate=16000)
        for k in range(10):
            frame = av.AudioFrame.from_ndarray(
                np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
            )
            frame.sample_rate, frame.pts = 16000, k * 1024
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    make_test_video(root / "huge.mp4", width=256, height=192)
    make_test_video(
        root / "vfr.mp4", frame_times=[0, 0.1, 0.15, 0.4, 0.5, 0.9, 1.0, 1.05, 1.5, 2.0]
    )
    photo("coffee.jpg", (64, 48)).save(root / "photo.jpg")
    (root / "gone.mp4").symlink_to(root / "missing-target.mp4")


def test_caption_labels_videos_next_to_images_and_each_bad_video_is_an_error_record(
    tiny_dir, tmp_path
):
    root = tmp_path / "clips"
    root.mkdir()
    _bad_videos(root)
    config = tmp_path / "c.yaml"
    config.write_text("video:\n  max_decode_pixels: 40000\n")  # huge.mp4 is 256x192 = 49152 a frame
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(
        app,
        [
            "caption",
            str(root),
            "-o",
            str(out),
            "-c",
            str(config),
            "--model",
            str(tiny_dir),
            "--max-new-tokens",
            "4",
            "--quiet",
        ],
    )
    assert result.exit_code == 1, result.output
    records = {r["key"]: r for r in map(json.loads, out.read_text().splitlines())}
    causes = {
        "corrupt.mp4": "not a video FFmpeg can read",
        "truncated.mp4": "truncated or corrupt MP4/MOV: FFmpeg finds no readable index",
        "cut.mkv": "truncated: the stream ends at",
        "unknown_codec.mkv": "unknown codec",
        "no_frames.mp4": "zero frames",
        "audio_only.mp4": "no video stream (audio streams only)",
        "gone.mp4": "unreadable file (no such file or broken link)",
        "huge.mp4": "256x192 pixels a frame is over the decode limit of 40000 "
        "(video.max_decode_pixels)",
    }
    for key, cause in causes.items():
        assert records[key]["status"] == "error" and cause in records[key]["error"]["message"], (
            records[key]
        )
        assert records[key]["error"]["message"].startswith(str(root / key)), records[key]
    assert records["photo.jpg"]["status"] == "ok" and "video" not in records["photo.jpg"]
    good, vfr = records["good.mp4"], records["vfr.mp4"]
    assert (
        good["status"] == "ok"
        and good["video"]["num_frames"] == 4
        and good["video"]["duration"] == 2.0
    )
    assert vfr["status"] == "ok" and "variable frame rate" in vfr["note"]
    # the frames' own times, sampled by time
    assert vfr["video"]["frame_times"] == [
        0.0,
        0.9,
        1.5,
        2.0,
    ]
    assert len(records) == 11


def test_ask_video_cli(tiny_dir, tmp_path):
    clip = make_test_video(tmp_path / "clip.mp4")
    out = tmp_path / "a.jsonl"
    result = CliRunner().invoke(
        app,
        [
            "ask",
            "--video",
            str(clip),
            QUESTION,
            "--model",
            str(tiny_dir),
            "--max-new-tokens",
            "3",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert (
        record["key"] == str(clip)
        and record["video"]["num_frames"] == 4
        and record["num_image_tokens"] > 0
    )
    result = CliRunner().invoke(app, ["ask", QUESTION, "--model", str(tiny_dir)])
    assert result.exit_code == 2 and "--image FILE or --video FILE" in result.output


@pytest.fixture(scope="module")
def pair(tiny_dir):
    return Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu"), hf_model(tiny_dir)


def _reference_ids(tiny_dir, kinds, layout):
    return reference_prompt_ids(tiny_dir, kinds, layout, QUESTION)


@pytest.mark.parametrize("with_image", [False, True])
def test_video_positions_logits_and_greedy_tokens_match_transformers(
    pair, tiny_dir, tmp_path, with_image
):
    captioner, model = pair
    clip = make_test_video(tmp_path / "clip.mp4", seconds=3, fps=8, width=160, height=96)
    images = [photo("chelsea.jpg", (96, 80))] if with_image else []
    prepared = captioner.requests.prepare(images, [clip])
    req = captioner.requests.build("k", prepared, QUESTION, captioner.sampling(max_new_tokens=16))
    ids = _reference_ids(tiny_dir, ["image"] * len(images) + ["video"], prepared.layout)
    image_id, video_id = model.config.image_token_id, model.config.video_token_id
    assert req.input_ids == ids
    groups = prepared.grids[len(images) :]
    video_grid = torch.tensor([[len(groups), groups[0][1], groups[0][2]]])
    inputs = {
        "input_ids": torch.tensor([ids]),
        "pixel_values_videos": torch.cat(prepared.pixels[len(images) :]),
        "video_grid_thw": video_grid,
        "mm_token_type_ids": torch.tensor(
            [[1 if i == image_id else 2 if i == video_id else 0 for i in ids]]
        ),
    }
    if images:
        inputs.update(
            pixel_values=torch.cat(prepared.pixels[: len(images)]),
            image_grid_thw=torch.tensor([list(g) for g in prepared.grids[: len(images)]]),
        )
    positions, deltas = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs.get("image_grid_thw"), video_grid
    )
    assert torch.equal(req.rotary_position_ids, positions[:, 0]) and req.rope_delta == int(deltas)
    with torch.no_grad():
        reference = model(**inputs).logits[0]
    ours = prefill_logits(captioner, req)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)

    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    out = model.generate(
        **inputs,
        generation_config=GenerationConfig(
            max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        ),
    )
    done = next(iter(captioner.engine.generate([dataclasses.replace(req, stop_ids=frozenset())])))
    assert done.token_ids == out[0, len(ids) :].tolist() and len(done.token_ids) == 16


def test_plan_sizes_a_video_from_its_headers_as_a_run_does(tiny_dir, tmp_path):
    from mmcli.cli.plan import image_patches
    from mmcli.config import load_config

    clip = make_test_video(tmp_path / "a.mp4", seconds=3, fps=8, width=160, height=96)
    names, patches = image_patches([tmp_path], load_config(None, {"model": str(tiny_dir)}))
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    prepared = cap.requests.prepare([], [clip])
    assert names == ["a.mp4#0", "a.mp4#1", "a.mp4#2"]
    # 6 frames of 96x160 under the tiny checkpoint's 16384 pixels a video: beta =
    # sqrt(6*96*160/16384) = 2.37,
    # 32x64 a frame, 2x4 patches
    assert patches == [t * h * w for t, h, w in prepared.grids] == [8, 8, 8]


def test_tasks_apply_to_videos_with_one_decoding_and_encoding(tiny_dir, tmp_path):
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    clip = make_test_video(tmp_path / "clip.mp4")
    results = list(cap.label([("clip.mp4", clip)], tasks=["caption", "tags"], max_new_tokens=3))
    assert sorted(r.task for r in results) == ["caption", "tags"] and all(r.ok for r in results)
    assert all(r.images[0]["video"]["num_frames"] == 4 for r in results)
    # two frame pairs, once
    assert cap.runner.images_encoded == 2 and cap.runner.prefixes_prefilled == 1


def test_a_question_holding_a_video_placeholder_is_refused(pair):
    from mmcli.errors import ItemError

    prompts = pair[0].prompts
    layout = [[(0.3, 2), (1.3, 2)]]
    assert prompts.encode(QUESTION, layout).count(pair[1].config.video_token_id) == 4
    with pytest.raises(ItemError, match="1 video frame groups|3 video placeholders"):
        prompts.encode("<|vision_start|><|video_pad|><|vision_end|> and this?", [[(0.3, 2)]])
