"""Shared fixtures: tiny checkpoints in the released layout, transformers' processor and model on
them."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmcli.kernels import cpu_features
from mmcli.testing import MOE_VARIANTS, QWEN3_5_VARIANTS, forced_logits, make_tiny_checkpoint

# mmcli's default cache (prepared int8 weights) in a directory of this session's, not ~/.cache
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="mmcli-tests-cache-")
SAMPLES = Path(__file__).resolve().parent.parent / "samples"
VARIANTS = ["base", "wide_attn", "deepstack_last"]


def pytest_configure(config):
    """Where pytest-xdist runs the tests in workers (pyproject's `-n`), in the process that starts
    them: each worker's OpenMP threads a share of the cores, two at least (the kernels' threads
    are part of what is tested), and put to sleep when idle rather than spinning, as the workers'
    threads share the cores (2 cores: the quick loop in 146 s against 192 in one process, where
    spinning threads took 365)."""
    workers = len(config.getoption("tx", None) or [])
    if workers and "PYTEST_XDIST_WORKER" not in os.environ:
        cores = cpu_features.detect().cores
        os.environ.setdefault("OMP_NUM_THREADS", str(max(2, cores // workers)))
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(params=["this CPU's", "AVX2"])
def build(request, monkeypatch):
    """Each test once with the build this CPU loads and once with the AVX2 one."""
    from mmcli.kernels import cpu

    if request.param == "AVX2":
        monkeypatch.setenv("MMCLI_CPU_KERNEL", "avx2")
    cpu.load.cache_clear()
    assert cpu.load()[0] is not None, cpu.load()[1]
    yield cpu.name()
    monkeypatch.undo()
    cpu.load.cache_clear()


@pytest.fixture
def vector_units(monkeypatch):
    """Runs as on a CPU whose units are vector ones only (AVX2, AVX-512 VNNI: no bfloat16
    products), where `dtype: auto` computes in float32 end to end."""
    vector = cpu_features.real_units() - {"amx_bf16", "amx_int8", "avx512_bf16", "bf16", "i8mm"}
    monkeypatch.setenv("MMCLI_CPU_FEATURES", ",".join(sorted(vector)) or "none")


def with_cpu_kernels(module, compute="float32", loaded="bfloat16", quantize="none"):
    """`module` with the kernels the kernel plan of an eager CPU run installs in its layers."""
    from mmcli.kernels.machine import here
    from mmcli.kernels.plan import RunShape, choose, install

    install(choose(RunShape("cpu", "eager", compute, loaded, quantize), here()), module)
    return module


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "base")


@pytest.fixture(scope="session")
def bf16_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint with its matrices in bfloat16, as the released ones hold them."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "m", dtype="bfloat16")


@pytest.fixture(scope="session")
def variant_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    forms = {
        "base": "rope_scaling",
        "wide_attn": "rope_parameters",
        "deepstack_last": "rope_scaling",
    }
    return {
        v: make_tiny_checkpoint(
            root / v,
            v,
            seed=i + 1,
            rope_form=forms[v],
            shards=2 if v == "wide_attn" else 1,
            template_file="jinja" if v == "deepstack_last" else "json",
        )
        for i, v in enumerate(VARIANTS)
    }


@pytest.fixture(scope="session")
def qwen3_5_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen3.5 checkpoints whose weights transformers wrote (one with three linear layers
    per full one, one alternating)."""
    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        v: hf_written(make_tiny_checkpoint(root / v, v, seed=i + 7), seed=i + 7)
        for i, v in enumerate(QWEN3_5_VARIANTS)
    }


@pytest.fixture(scope="session")
def qwen3_5_dir(qwen3_5_dirs) -> Path:
    return qwen3_5_dirs["qwen3_5"]


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny MoE checkpoints transformers wrote: Qwen3-VL MoE (fused experts, a dense layer by
    mlp_only_layers) and Qwen3.5 MoE (one tensor per expert, a shared expert)."""
    root = tmp_path_factory.mktemp("moe")
    return {
        v: hf_written(make_tiny_checkpoint(root / v, v, seed=i + 3), seed=i + 3)
        for i, v in enumerate(MOE_VARIANTS)
    }


@pytest.fixture(scope="session")
def moe_dir(moe_dirs) -> Path:
    return moe_dirs["qwen3_5_moe"]


def read_records(path: Path) -> list[dict]:
    """The records of a JSONL file, in order."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def caption_argv(*args, model, max_new_tokens: int | None = 3, quiet: bool = True) -> list[str]:
    """`caption ARGS --model MODEL [-q] [--max-new-tokens N]`: every caption test's command."""
    argv = ["caption", *map(str, args), "--model", str(model), *(["-q"] if quiet else [])]
    return argv + ([] if max_new_tokens is None else ["--max-new-tokens", str(max_new_tokens)])


def caption_cli(*args, model, max_new_tokens: int | None = 3, quiet: bool = True):
    """`mmcli caption` through Typer's runner (in this process): caption_argv's command."""
    from typer.testing import CliRunner

    from mmcli.cli.app import app

    argv = caption_argv(*args, model=model, max_new_tokens=max_new_tokens, quiet=quiet)
    return CliRunner().invoke(app, argv)


# holds a local Ray instance until its stdin closes; prints its address and the variables
# ray.init set, which a client needs too (Ray 2.60: RAY_AUTH_MODE where ~/.ray holds a token)
_RAY_HOLDER = """
import json, os, sys, ray
before = dict(os.environ)
context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
env = {k: v for k, v in os.environ.items() if before.get(k) != v}
print(json.dumps({"address": context.address_info["gcs_address"], "env": env}), flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="session")
def ray_instance():
    """A local Ray instance of 2 CPUs for the session: `flags` join it with two replicas of one
    CPU each (`--ray-address`), run in the environment `env`. A run that starts its own spends
    about 10 s of its 25 starting and stopping it (test_ray.py keeps one such run)."""
    import subprocess

    pytest.importorskip("ray", reason="the ray extra is not installed")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    holder = subprocess.Popen(
        [sys.executable, "-c", _RAY_HOLDER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    started = next((json.loads(line) for line in holder.stdout if line.startswith("{")), None)
    assert started, "the Ray instance did not start"
    replicas = ["--replicas", "2", "--replica-resources", '{"num_cpus": 1}']
    flags = ["--ray", "--ray-address", started["address"], *replicas]
    yield {"flags": flags, "env": {**env, **started["env"]}}
    holder.stdin.close()  # its interpreter exits, and Ray stops the instance with it
    try:
        holder.wait(60)
    except subprocess.TimeoutExpired:
        holder.kill()


def caption_process(*args, model, max_new_tokens: int | None = 3) -> list[str]:
    """caption_argv's command as a process of its own (`python -m mmcli`), for the tests that
    interrupt, kill or run it at once."""
    argv = caption_argv(*args, model=model, max_new_tokens=max_new_tokens)
    return [sys.executable, "-m", "mmcli", *argv]


def image_folder(root: Path, n: int = 2) -> Path:
    """`n` small JPEGs of the samples, of different sizes, in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        name = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg"][i % 3]
        photo(name, (64 + 16 * i, 48 + 8 * i)).save(root / f"im{i}.jpg")
    return root


def hf_processor(path: Path):
    """transformers' Qwen3VLProcessor with its PIL image processor, built from the checkpoint's
    files.

    The video processor needs torchvision, which we do not install; images never touch it, so the
    processor's class check for that slot is skipped and the slot left empty."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    pre = json.loads((path / "preprocessor_config.json").read_text())
    pre = {k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class")}
    template = (
        (path / "chat_template.jinja").read_text()
        if (path / "chat_template.jinja").is_file()
        else json.loads((path / "chat_template.json").read_text())["chat_template"]
    )
    check = ProcessorMixin.check_argument_for_proper_class
    ProcessorMixin.check_argument_for_proper_class = lambda *a, **k: None
    try:
        return Qwen3VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(**pre),
            tokenizer=AutoTokenizer.from_pretrained(path),
            video_processor=None,
            chat_template=template,
        )
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def hf_written(path: Path, seed: int) -> Path:
    """A Qwen3.5 checkpoint's weights (and config.json) rewritten by transformers itself: its own
    model class built from the config, random values by its own parameter names, `save_pretrained`
    (the generation config, which transformers would rewrite without eos ids, is kept)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from mmcli.testing import random_tensor

    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(random_tensor(name, tuple(parameter.shape), g, unit_offset=True))
    generation = (path / "generation_config.json").read_text()
    (path / "model.safetensors").unlink()
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(generation)
    return path


def reference_prompt_ids(path: Path, kinds: list[str], layout: list, question: str, **template):
    """The prompt as transformers' processor builds it: its chat template, then each video's span
    replaced by "<t seconds>" + start + pads + end per temporal patch (as Qwen3-VL's processor
    expands it)."""
    processor = hf_processor(path)
    content = [{"type": k} for k in kinds] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        **template,
    )
    for entry in layout:
        if isinstance(entry, list):
            text = text.replace(
                "<|vision_start|><|video_pad|><|vision_end|>",
                "".join(
                    f"<{s:.1f} seconds><|vision_start|>" + "@VIDEO@" * n + "<|vision_end|>"
                    for s, n in entry
                ),
                1,
            )
        else:
            text = text.replace("<|image_pad|>", "@IMAGE@" * entry, 1)
    text = text.replace("@VIDEO@", "<|video_pad|>").replace("@IMAGE@", "<|image_pad|>")
    return processor.tokenizer(text)["input_ids"]


def hf_model(path: Path):
    import torch
    from transformers import AutoModelForImageTextToText

    # the experts' loop, which also runs in float64 (the grouped-GEMM one does not)
    return AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager"
    ).eval()


def photo(name: str, size: tuple[int, int] | None = None, mode: str = "RGB") -> Image.Image:
    im = Image.open(SAMPLES / name).convert("RGB")
    if size is not None:
        im = im.resize(size, Image.BILINEAR)
    return im if mode == "RGB" else im.convert(mode)


def varied_images() -> dict[str, Image.Image]:
    """At least ten images of odd sizes and every decoded mode."""
    rgba = photo("coffee.jpg", (123, 77)).convert("RGBA")
    alpha = np.asarray(rgba).copy()
    alpha[..., 3] = np.linspace(0, 255, alpha.shape[1], dtype=np.uint8)[None, :]
    grey16 = Image.fromarray(np.asarray(photo("rocket.jpg", (90, 61), "L")).astype(np.uint16) * 257)
    return {
        "rgb_512": photo("astronaut.jpg"),
        "rgb_600x400": photo("coffee.jpg"),
        "rgb_451x300": photo("chelsea.jpg"),
        "rgb_odd_37x211": photo("rocket.jpg", (37, 211)),
        "rgb_tiny_9x13": photo("chelsea.jpg", (9, 13)),
        "rgb_wide_500x40": photo("astronaut.jpg", (500, 40)),
        "rgba_123x77": Image.fromarray(alpha, "RGBA"),
        "palette_100x80": photo("chelsea.jpg", (100, 80)).convert("P", palette=Image.ADAPTIVE),
        "grey_81x97": photo("coffee.jpg", (81, 97), "L"),
        "la_64x48": photo("rocket.jpg", (64, 48), "LA"),
        "cmyk_70x70": photo("astronaut.jpg", (70, 70), "CMYK"),
        "grey16_90x61": grey16,
        "bilevel_40x40": photo("coffee.jpg", (40, 40), "1"),
    }


def encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


# Comparing a run with transformers' (the Qwen3.5 and MoE parity tests)


def prefill_item(req, rotary=None, slot: int = 0, **fields):
    """The runner's PrefillItem of a request (its rotary ids, or `rotary`), in cache row `slot`."""
    from mmcli.engine.batch import PrefillItem

    rotary = req.rotary_position_ids if rotary is None else rotary
    return PrefillItem(slot, req.input_ids, rotary, req.pixel_values, req.vision_grids, **fields)


def prefill_hidden(labeler, req, rotary=None):
    """The final hidden states [T, H] of a request's prompt, prefilled alone."""
    import torch

    with torch.inference_mode():
        return labeler.runner.forward_prompts([prefill_item(req, rotary)])


def prefill_logits(labeler, req, rotary=None):
    """The logits [T, V] (float32) of every token of a request's prompt, prefilled alone."""
    import torch

    with torch.inference_mode():
        return labeler.model.lm_head(prefill_hidden(labeler, req, rotary)).float()


def assert_logits_match(labeler, req, model, inputs):
    """Prefill logits against the reference's exact values (its float64 run): within 2e-4, or,
    where the reference's own float32 run is farther than that, of its order (4x).

    Gated DeltaNet's RMSNorm rescales each head's delta-rule output, small in random models, to
    unit size, so rounding upstream reaches the logits magnified in any float32 implementation;
    over a few hundred tokens the reference's float32 run is itself 1e-3 away from float64."""
    import torch

    ours = prefill_logits(labeler, req).double()
    with torch.no_grad():
        ref32 = model(**inputs).logits[0].double()
        wide = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        ref64 = model.double()(**wide).logits[0]
        model.float()
    ours_error = (ours - ref64).abs().max().item()
    reference_error = (ref32 - ref64).abs().max().item()
    print(f"float32 logits from float64: ours {ours_error:.2e}, reference {reference_error:.2e}")
    assert ours_error <= max(2e-4, 4 * reference_error)


def greedy(labeler, req):
    return next(iter(labeler.engine.generate([dataclasses.replace(req, stop_ids=frozenset())])))


def reference_greedy(model, inputs, tokens: int = 16) -> list[int]:
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None
    gen = GenerationConfig(
        max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    out = model.generate(**inputs, generation_config=gen)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


# Comparing two kernels (or products, or units) of one run: along the same tokens, with a margin


def int4_values_f64(weight):
    """An Int4Weight's (q - 8) * scale + zero in float64, [out, in] (torch's layout read back)."""
    import torch

    from mmcli.kernels.weight_forms import int4_block

    weight = weight.torch_form()
    out, inner = weight.shape
    block = int4_block()
    packed = weight.packed.view(out // block, inner, block // 2)
    q = torch.cat([packed & 0xF, packed >> 4], -1).permute(0, 2, 1).reshape(out, inner)
    sz = weight.scales_zeros.double()  # [in / 32, out, 2]
    scale, zero = (sz[..., i].t().repeat_interleave(32, 1) for i in (0, 1))
    return (q.double() - 8) * scale + zero


def assert_bfloat16_products(products, rows: int, channels: int, inputs: int) -> None:
    """`products(x, weight, split)` (float32 x, bfloat16 weight) against float64: with each
    activation rounded to bfloat16, within float32 sums' error; `split` (each activation as two
    bfloat16), within 2^-16 of each activation's magnitude."""
    import torch

    generator = torch.Generator().manual_seed(rows * channels)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(channels, inputs, generator=generator).bfloat16()
    magnitude = x.abs().double() @ weight.abs().double().t()  # what the errors scale with
    summed = 2e-6 * magnitude + 1e-6  # float32 sums of `inputs` terms
    rounded = x.bfloat16().double() @ weight.double().t()
    assert ((products(x, weight, False).double() - rounded).abs() <= summed).all()
    exact = x.double() @ weight.double().t()
    error = (products(x, weight, True).double() - exact).abs()
    assert (error <= 2**-16 * magnitude + summed).all()


def assert_fused_step_keeps_the_modules_choices(checkpoint, batch: int, unit: str, margin: float):
    """`batch` sequences decoded together on the fused step on `unit` (as the plan names it)
    against the decoder's modules, teacher-forced on fixed tokens: within `margin` of each
    reference's spread (assert_same_choices)."""
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config

    cfg = load_config(None, {"engine": {"max_seqs": 32}})
    labeler = Labeler.from_pretrained(str(checkpoint), device="cpu", config=cfg)
    assert f"decode_step decode_layer.c on {unit}" in labeler.kernels
    requests = [
        labeler.request(f"k{i}", [photo("chelsea.jpg")], f"Describe image {i}.",
                        labeler.sampling(max_new_tokens=6))[0]
        for i in range(batch)
    ]  # fmt: skip
    decoder = labeler.model.language_model
    fused, decoder.kernel = decoder.kernel, None
    tokens = [[3 + i, 7, 11, 5, 2, 9] for i in range(batch)]
    reference = forced_logits(labeler, requests, tokens)
    decoder.kernel = fused
    assert fused is not None and fused.max_rows >= batch
    for logits, expected in zip(forced_logits(labeler, requests, tokens), reference):
        assert_same_choices(logits, expected, margin * expected.std().item())


def assert_same_choices(logits, reference, margin: float) -> int:
    """Two kernels' teacher-forced logits along the reference's tokens: within `margin` at every
    step, so that each step whose reference top-2 gap exceeds twice the margin picks the
    reference's token (a step within it is a near-tie either kernel may take). Returns the number
    of such decided steps."""
    error = (logits - reference).abs().max().item()
    print(f"logits apart by {error:.2e} at most (margin {margin:.2e})")
    assert error <= margin
    top2 = reference.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * margin
    assert (logits.argmax(-1) == reference.argmax(-1))[decided].all()
    return int(decided.sum())
