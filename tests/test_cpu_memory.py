"""The CPU path's memory and precision: weights as stored, int8, the KV cache sized to the job, a
fast start."""

import dataclasses
import json
import math
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from conftest import SAMPLES, prefill_logits, with_cpu_kernels
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.config import load_config
from mmcli.kernels import cpu, cpu_ops
from mmcli.models.layers.linear import Linear
from mmcli.models.layers.quantized import X_MAX, Int8Head, Int8Linear
from mmcli.testing import make_outlier_checkpoint
from mmcli.weights.checkpoint import expected_shapes
from mmcli.weights.int8 import int8_linear, quantize_int8, quantize_linears

IMAGE = [SAMPLES / "chelsea.jpg"]


@pytest.fixture(scope="module")
def outlier_dir(bf16_dir, tmp_path_factory) -> Path:
    return make_outlier_checkpoint(bf16_dir, tmp_path_factory.mktemp("outlier") / "m")


def _labeler(path, **settings):
    return Labeler.from_pretrained(
        str(path), config=load_config(None, {"device": "cpu", **settings})
    )


def _logits(cap):
    req, _ = cap.request("k", IMAGE, "Describe this image.", cap.sampling())
    return prefill_logits(cap, req)


def _parameters(cap) -> int:
    cfg = cap.model.cfg
    return sum(
        math.prod(shape)
        for name, shape in expected_shapes(cfg).items()
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings)
    )


def test_the_run_is_made_once_and_held(bf16_dir):
    """The precision and the settings resolved once are the ones every part holds (frozen),
    and the runner computes in the precision's dtype, not one read off a weight."""
    labeler = _labeler(bf16_dir, dtype="float32")
    assert labeler.precision is labeler.run.precision is labeler.loaded.run.precision
    assert labeler.config is labeler.run.config
    with pytest.raises(dataclasses.FrozenInstanceError):
        labeler.precision.compute = "bfloat16"
    assert labeler.runner.dtype == labeler.precision.compute_dtype == torch.float32


def test_default_cpu_path_holds_the_stored_bfloat16_and_computes_in_float32(bf16_dir, vector_units):
    default, full = _labeler(bf16_dir), _labeler(bf16_dir, dtype="float32")
    float32 = {"compute": "float32", "products": "float32", "quantize": "none"}
    assert default.precision.record() == {"weights": "bfloat16", **float32}
    assert full.precision.record() == {"weights": "float32", **float32}
    assert ("bf16_linear.c" in default.kernels) == (cpu.why_unavailable() is None)
    assert (
        default.weight_bytes / _parameters(default) <= 2.1 < full.weight_bytes / _parameters(full)
    )
    torch.testing.assert_close(_logits(default), _logits(full), atol=1e-4, rtol=0)
    ask = {"max_new_tokens": 24}
    assert (
        default.ask(IMAGE, "Describe this image.", **ask).token_ids
        == full.ask(IMAGE, "Describe this image.", **ask).token_ids
    )


@pytest.mark.skipif(cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16])
def test_the_few_rows_kernel_computes_bfloat16_weights_in_float32(rows):
    """Shapes off the kernel's tiles (7 output channels, 21 columns: 4+3 and 8+8+5) and a strided
    input, against float64; this machine's build must load (the runner's report names it)."""
    assert cpu.load()[0] is not None, cpu.load()[1]
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(7, 21, generator=generator).bfloat16()
    x = torch.randn(21, rows, generator=generator).t()
    layer = Linear(21, 7, bias=True).requires_grad_(False)
    layer.weight.data, layer.bias.data = weight, torch.randn(7, generator=generator)
    expected = x.double() @ weight.double().t() + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        cpu.bf16_linear(x.contiguous(), weight).double(),
        expected - layer.bias.double(),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.skipif(cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here")
def test_the_few_rows_kernel_sums_each_row_alone_whatever_its_tile():
    """Inputs in pairs' order over whole vectors and a tail (300 = 9 x 32 + 12), 1 to 9 rows
    (tiles of 3 weight rows under 4 rows, of 2 from 4 on, 11 channels off both): against float64,
    and each row's outputs the bits it has computed alone, so that a sequence's logits do not
    depend on how many share its step."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(11, 300, generator=generator).bfloat16()
    x = torch.randn(9, 300, generator=generator)
    alone = torch.cat([cpu.bf16_linear(row[None], weight) for row in x])
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(alone.double(), expected, atol=1e-4, rtol=1e-5)
    for rows in range(1, 10):
        assert torch.equal(cpu.bf16_linear(x[:rows].contiguous(), weight), alone[:rows])


def _relative_error(logits, reference) -> float:
    return float((logits - reference).norm() / reference.norm())


def test_int8_keeps_outlier_channels_from_wrecking_the_rest(outlier_dir):
    """int8 (norms folded into the next linears, a scale per token) stays within 12% (relative L2
    of the prefill logits) of the float32 run on a model with outlier channels; one activation
    scale per call does not."""
    reference = _logits(_labeler(outlier_dir, dtype="float32"))
    ours = _labeler(outlier_dir, quantize="int8")
    assert (
        ours.precision.weights == "int8"
        and ours.weight_bytes < 0.8 * _labeler(outlier_dir).weight_bytes
    )
    # tied: the head an int8 copy (its activations split), the embedding its bfloat16 table
    assert isinstance(ours.model.lm_head, Int8Head)
    assert ours.model.language_model.embed_tokens.weight.dtype == torch.bfloat16
    assert _relative_error(_logits(ours), reference) < 0.12
    # the same int8 weights, no folding, one scale a call
    naive = _labeler(outlier_dir, weights_dtype="bfloat16")
    quantize_linears(naive.model, keep=(naive.model.lm_head,))
    for layer in naive.model.modules():
        if isinstance(layer, Int8Linear):
            layer.per_token = False
        if hasattr(layer, "rounded"):  # set at load for bfloat16 products, not int8's
            layer.rounded = False
    assert _relative_error(_logits(naive), reference) > 0.12


@pytest.mark.parametrize("kernel", [None, "int8_split", "int8_wide"])
def test_the_int8_logits_take_14_bits_of_each_activation(kernel):
    """An int8 head takes about 14 bits of each activation (two rows of 7-bit levels, or int16
    levels on int8_linear.c's wide rows): within 2^-12 of the largest output of the products of
    its int8 weights in float64, where 7-bit rows are off by over 2%."""
    if kernel and cpu.load()[0] is None:
        pytest.skip(cpu.why_unavailable())
    generator = torch.Generator().manual_seed(0)
    weight = quantize_int8(torch.randn(300, 256, generator=generator))
    dequantized = weight.rows()[:300, :256].double() * weight.scale[:300, None].double()
    x = torch.randn(5, 256, generator=generator) * torch.linspace(0.1, 3, 256)  # uneven columns
    exact = x.double() @ dequantized.t()
    rows, head = Int8Linear(256, 300, weight), Int8Head(256, 300, weight)
    rows.kernel = cpu_ops.int8_matmul if kernel else None
    heads = {"int8_split": partial(cpu_ops.int8_split_matmul, rows=cpu_ops.int8_matmul)}
    head.kernel = heads.get(kernel, cpu_ops.int8_wide_matmul if kernel else None)
    error = {}
    for name, layer in (("rows", rows), ("head", head)):
        error[name] = float((layer(x).double() - exact).abs().max() / exact.abs().max())
    assert error["head"] < 2**-12 and error["rows"] > 0.02


def test_quantization_is_in_the_record_and_the_resume_key(tiny_dir, tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    shutil.copy(SAMPLES / "coffee.jpg", root)
    out = tmp_path / "out.jsonl"
    for extra in ([], ["--quantize", "int8"], ["--quantize", "int8"]):
        result = CliRunner().invoke(
            app,
            [
                "caption",
                str(root),
                "-o",
                str(out),
                "--model",
                str(tiny_dir),
                "-q",
                "--max-new-tokens",
                "3",
                *extra,
            ],
        )
        assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # the third run redid nothing
    assert [r["precision"]["quantize"] for r in records] == [
        "none",
        "int8",
    ]
    assert (
        records[1]["precision"]["weights"] == "int8"
        and records[0]["settings"] != records[1]["settings"]
    )


def test_the_kv_cache_holds_what_the_job_uses(tiny_dir, tmp_path):
    cap = _labeler(tiny_dir, dtype="float32")  # engine.max_len 4096 by default
    result = cap.ask(IMAGE, "Describe this image.", max_new_tokens=4)
    assert (cap.runner.cache.rows, cap.runner.cache.columns) == (
        1,
        256,
    ) and result.num_input_tokens + 4 <= 256
    items = [
        (f"k{i}", SAMPLES / name)
        for i, name in enumerate(["coffee.jpg", "rocket.jpg", "chelsea.jpg"])
    ]
    alone = {
        key: cap.ask([path], "Describe this image.", max_new_tokens=300).token_ids
        for key, path in items
    }
    batched = {r.key: r.token_ids for r in cap.label(items, max_new_tokens=300)}
    # grown, in order
    assert batched == alone and cap.runner.cache.rows == 3 and cap.runner.cache.columns == 512


def _int8_layer(out_features, in_features, seed):
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=True).requires_grad_(False)
    layer.weight.data = torch.randn(out_features, in_features, generator=generator)
    layer.bias.data = torch.randn(out_features, generator=generator)
    reference = {"weight": layer.weight.clone(), "bias": layer.bias.clone()}
    return with_cpu_kernels(int8_linear(layer), quantize="int8"), reference


def _int8_expected(layer, x):
    """What the int8 layer computes, in exact integers: 7-bit levels of each row times the 8-bit
    weights (unpacked from the kernel's layout), then both scales and the bias."""
    weight = layer.weight
    n, k = layer.out_features, layer.in_features
    scale = torch.maximum(x.amax(1, keepdim=True), -x.amin(1, keepdim=True)) / X_MAX
    levels = (x / scale).round().long()
    sums = levels @ weight.rows()[:n, :k].long().t()
    return sums.double() * scale.double() * weight.scale[:n].double() + weight.bias[:n].double()


@pytest.mark.skipif(cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here")
@pytest.mark.parametrize("build", ["this CPU's", "AVX2"])
@pytest.mark.parametrize("rows", [1, 5, 7, 130])
def test_the_int8_kernel_sums_exactly_in_both_builds(rows, build, monkeypatch):
    """Sides off the kernel's tiles and blocks (70 channels: 64 + 6, padded to 80; 262 inputs:
    a block of 256 and 6 more, padded to 264), against exact integer sums; the AVX2 build too
    where the CPU has VNNI; the float32 fallback (no kernel) agrees."""
    if build == "AVX2":
        monkeypatch.setenv("MMCLI_CPU_KERNEL", "avx2")
    cpu.load.cache_clear()
    try:
        assert cpu.load()[0] is not None, cpu.load()[1]
        layer, reference = _int8_layer(70, 262, rows)
        x = torch.randn(rows, 262, generator=torch.Generator().manual_seed(100 + rows))
        expected = _int8_expected(layer, x)
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-5)
        monkeypatch.setenv("MMCLI_CPU_KERNEL", "0")
        cpu.load.cache_clear()
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-5)
        # and the quantization itself: within half a step of each weight's own channel scale
        exact = x.double() @ reference["weight"].double().t() + reference["bias"].double()
        assert (layer(x).double() - exact).abs().max() < 0.05 * exact.abs().max()
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()


@pytest.mark.skipif(cpu.why_unavailable() is not None, reason="no AVX2 or no C compiler here")
@pytest.mark.parametrize("build", ["this CPU's", "AVX2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("folded", [False, True])
def test_the_weights_quantize_in_c_to_the_bits_torch_gives(build, dtype, folded, monkeypatch):
    """int8_weights.c against quantize_int8's torch operations, with and without a folded
    norm's column scales: the same values, scales and sums, bit for bit, on sides off its
    vectors and the layout's groups (37 channels padded to 48, 45 inputs to 48), with a zero
    channel (the scale's floor) and ties of the rounding (weights of whole halves)."""
    if build == "AVX2":
        monkeypatch.setenv("MMCLI_CPU_KERNEL", "avx2")
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(37, 45, generator=generator)
    weight[3] = 0.0
    weight[5] = torch.arange(45) - 22.0  # scale 22 / 127: some quotients land on halves
    weight = weight.to(dtype)
    columns = torch.rand(45, generator=generator) + 0.5 if folded else None
    try:
        cpu.load.cache_clear()
        assert cpu.load()[0] is not None, cpu.load()[1]
        ours = quantize_int8(weight, None, columns)
        monkeypatch.setenv("MMCLI_CPU_KERNEL", "0")
        cpu.load.cache_clear()
        theirs = quantize_int8(weight, None, columns)
    finally:
        monkeypatch.undo()
        cpu.load.cache_clear()
    for part, value in theirs.tensors().items():
        assert torch.equal(ours.tensors()[part], value), part


def _smaps_fields(address: int) -> dict[str, str]:
    """The smaps fields (Rss, AnonHugePages, VmFlags, ...) of this process's mapping that holds
    `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for n, line in enumerate(lines):
        span = line.split()[0]
        if "-" in span and all(c in "0123456789abcdef-" for c in span):
            start, end = (int(v, 16) for v in span.split("-"))
            if start <= address < end:
                fields = {}
                for entry in lines[n + 1 :]:
                    key, _, value = entry.partition(":")
                    if not value or " " in key:  # the next mapping's header
                        break
                    fields[key] = value.strip()
                return fields
    raise AssertionError(f"no mapping holds {address:#x}")


def _smaps_entry(address: int, key: str) -> int:
    """`key` (Rss, AnonHugePages) of the mapping of this process that holds `address`, in
    bytes."""
    return int(_smaps_fields(address)[key].split()[0]) * 1024


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_the_weights_pages_are_mapped_in_at_once(tmp_path):
    """populate() enters a mapped checkpoint's pages into the process's page table before any is
    read (the mapping's resident size goes from none to all of it). Allocator settings hold on
    glibc."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mmcli.kernels.host_memory import keep_freed_memory, populate

    save_file({"w": torch.ones(8 << 20)}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        mapped = f.get_tensor("w")
        size = mapped.numel() * mapped.element_size()
        assert _smaps_entry(mapped.data_ptr(), "Rss") < size / 4
        if not populate([(mapped.data_ptr(), size)]):
            pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14)")
        assert _smaps_entry(mapped.data_ptr(), "Rss") >= size
    assert keep_freed_memory()


def _huge_pages_promised() -> bool:
    """Whether a fault in a region advised MADV_HUGEPAGE takes a 2 MiB page, compacting memory
    for one if it must: THP not `never`, and its defrag setting stalls for advised regions."""
    settings = Path("/sys/kernel/mm/transparent_hugepage")
    if not (settings / "enabled").exists() or "[never]" in (settings / "enabled").read_text():
        return False
    defrag = (settings / "defrag").read_text() if (settings / "defrag").exists() else ""
    return any(f"[{way}]" in defrag for way in ("always", "madvise", "defer+madvise"))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_weights_moved_into_huge_pages_keep_their_values_views_and_ties(tmp_path):
    """hold_in_huge_pages copies each storage once and points every tensor at its copy, in
    place: a tied pair still shares its bytes, a view keeps its offset and strides and its base
    moves with it, a tensor of another holder over the old storage keeps it (the prepared
    file's writer), and the region is advised for 2 MiB pages, and in them where the kernel
    promises them."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mmcli.kernels.host_memory import HUGE_PAGE, hold_in_huge_pages, keep_freed_memory

    save_file({"w": torch.arange(3 << 20, dtype=torch.float32)}, tmp_path / "w.safetensors")
    with safe_open(tmp_path / "w.safetensors", framework="pt") as f:
        mapped = f.get_tensor("w")
    tied = mapped.view(3, -1)  # another tensor over the same storage
    column = torch.arange(12, dtype=torch.bfloat16).view(4, 3).t()[1:]  # a strided view
    writers = [mapped.detach(), column.detach()]
    old = column.untyped_storage().data_ptr()
    before = [(t.clone(), t.stride()) for t in (mapped, tied, column)]
    # malloc keeps freed blocks (as after a load): the region must be fresh memory all the same
    keep_freed_memory()
    torch.ones(64 << 20, dtype=torch.uint8).add_(1)  # written and freed, kept in the heap
    assert hold_in_huge_pages([mapped, tied, column, mapped])
    for moved, (values, strides) in zip((mapped, tied, column), before):
        assert torch.equal(moved, values) and moved.stride() == strides
    assert tied.data_ptr() == mapped.data_ptr() and writers[0].data_ptr() != mapped.data_ptr()
    # the view's base moved with it: nothing of ours holds the old storage but the writer's
    assert column._base.untyped_storage().data_ptr() == column.untyped_storage().data_ptr()
    assert column._base.untyped_storage().data_ptr() != old
    assert torch.equal(writers[0], before[0][0]) and torch.equal(writers[1], before[2][0])
    # the copies begin on a 2 MiB boundary (column's view is one value into its storage)
    assert min(mapped.data_ptr(), column.data_ptr() - column.itemsize) % HUGE_PAGE == 0
    mapped += 1  # the copy is the process's own memory, no longer the file's
    assert torch.equal(tied.view(-1), before[0][0] + 1)
    assert "hg" in _smaps_fields(mapped.data_ptr())["VmFlags"].split()  # advised
    if _huge_pages_promised():
        assert _smaps_entry(mapped.data_ptr(), "AnonHugePages") >= HUGE_PAGE


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_the_kv_cache_is_held_in_huge_pages_and_keeps_what_it_holds_as_it_grows():
    """A CPU cache's K and V begin zero on a 2 MiB boundary of a region advised for 2 MiB pages
    (in them where the kernel promises them); grown, they keep their columns and are so again.
    A tensor under 2 MiB is torch's own."""
    from mmcli.kernels.host_memory import HUGE_PAGE, zeros_in_huge_pages
    from mmcli.models.cache import DecoderCache
    from mmcli.models.config import TextConfig

    cfg = TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        intermediate_size=64, num_hidden_layers=2, vocab_size=16, mrope_section=(2, 1, 1),
    )  # fmt: skip
    cache = DecoderCache(cfg, 4, 2048, torch.float32, torch.device("cpu"), torch.bfloat16)
    k = cache.k[1]
    assert k.dtype == torch.bfloat16 and k.shape == (4, 2, 2048, 128) and not k.any()
    assert k.data_ptr() % HUGE_PAGE == 0 and "hg" in _smaps_fields(k.data_ptr())["VmFlags"].split()
    k[:, :, :5] = 3.0
    if _huge_pages_promised():
        assert _smaps_entry(k.data_ptr(), "AnonHugePages") >= HUGE_PAGE
    cache.grow(6, 4096)
    grown = cache.k[1]
    assert grown.shape == (6, 2, 4096, 128) and grown.data_ptr() % HUGE_PAGE == 0
    assert torch.equal(grown[:4, :, :5], torch.full((4, 2, 5, 128), 3.0, dtype=torch.bfloat16))
    assert not grown[:, :, 5:].any() and not grown[4:].any()
    small = zeros_in_huge_pages((4, 8), torch.float32)
    assert torch.equal(small, torch.zeros(4, 8))
    assert small.untyped_storage().nbytes() == 4 * 8 * 4  # its own storage, not a region's


def test_a_load_into_huge_pages_computes_as_the_mapped_load(bf16_dir):
    """weights_memory huge_pages: the same logits, the same bytes held, and no page of the
    checkpoint still mapped; mapped keeps its pages."""
    mapped = _labeler(bf16_dir, weights_memory="mapped")
    moved = _labeler(bf16_dir, weights_memory="huge_pages")
    assert torch.equal(_logits(moved), _logits(mapped))
    assert moved.weight_bytes == mapped.weight_bytes
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else None
    if maps is not None:  # the first load's pages only
        assert str(bf16_dir) in maps
    del mapped
    import gc

    gc.collect()
    if maps is not None:
        assert str(bf16_dir) not in Path("/proc/self/maps").read_text()


def test_ask_keeps_the_weights_mapped_and_caption_moves_them(tiny_dir, tmp_path, monkeypatch):
    """weights_memory auto: one answer's few steps gain less than the copy costs, so `mmcli
    ask` keeps the files' pages; `caption` copies the weights into huge pages."""
    from mmcli.weights import loader

    moves = []
    monkeypatch.setattr(loader, "hold_in_huge_pages", lambda tensors: moves.append(tensors))
    model = ["--model", str(tiny_dir), "--dtype", "float32", "--max-new-tokens", "2"]
    image = str(SAMPLES / "coffee.jpg")
    result = CliRunner().invoke(app, ["ask", *model, "--image", image, "q"])
    assert result.exit_code == 0, result.output
    assert moves == []
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(image, folder)
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["caption", str(folder), *model, "-o", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert len(moves) == 1 and moves[0]


def _anonymous_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssAnon:")[1].split()[0]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux's /proc")
def test_memory_freed_between_kept_blocks_goes_back_to_the_kernel():
    """Under the run's allocator settings, blocks freed between blocks kept (a quantizing load's
    float32 copies between its int8 weights) stay in the process until release_freed_memory."""
    from mmcli.kernels.host_memory import keep_freed_memory, release_freed_memory

    if not keep_freed_memory():
        pytest.skip("malloc is not glibc's")
    blocks = [torch.ones(2 << 20) for _ in range(64)]  # 8 MiB each, written: resident
    kept, freed = blocks[1::2], blocks[::2]
    del blocks
    before = _anonymous_bytes()
    freed.clear()
    held = _anonymous_bytes()
    assert release_freed_memory()
    after = _anonymous_bytes()
    assert held - after > 0.8 * 32 * (8 << 20), (before, held, after)
    assert all(bool(block[0] == 1) for block in kept)
