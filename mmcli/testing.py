"""Tiny random Qwen3-VL and Qwen3.5 checkpoints in the released Hugging Face layout, for tests and `--smoke`
benchmarks.

Everything is generated here (BPE tokenizer trained on a few sentences, random weights);
transformers loads the result unchanged. Never used on a real model."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from fractions import Fraction
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from mmcli.models.registry import parse_config
from mmcli.weights.checkpoint import expected_shapes

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A chat template in the style of the Qwen3-VL Instruct release: optional system turn, tools block,
# images,
# videos and text items rendered in order, generation prompt.
CHAT_TEMPLATE = """{%- set image_count = namespace(value=0) -%}
{%- set video_count = namespace(value=0) -%}
{%- macro render_content(content, do_vision_count) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for item in content -%}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' -%}
                {%- if do_vision_count %}{% set image_count.value = image_count.value + 1 %}{% endif -%}
                {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                <|vision_start|><|image_pad|><|vision_end|>
            {%- elif 'video' in item or item.type == 'video' -%}
                {%- if do_vision_count %}{% set video_count.value = video_count.value + 1 %}{% endif -%}
                {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                <|vision_start|><|video_pad|><|vision_end|>
            {%- elif 'text' in item -%}
                {{- item.text -}}
            {%- else -%}
                {{- raise_exception('Unexpected item type in content.') -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' -}}
    {%- if messages[0].role == 'system' %}{{- render_content(messages[0].content, false) + '\\n\\n' -}}{% endif -%}
    {{- '# Tools\\n\\n<tools>' -}}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) -}}{% endfor -%}
    {{- '\\n</tools><|im_end|>\\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content, false) + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role in ['user', 'assistant', 'system'] -%}
        {{- '<|im_start|>' + message.role + '\\n' + render_content(message.content, true) + '<|im_end|>\\n' -}}
    {%- else -%}
        {{- raise_exception('Unexpected message role.') -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}{% endif -%}
"""

# Qwen3.5's generation prompt: the assistant turn opens a thinking block unless enable_thinking is
# false, which gives it an empty one (as the released template does).
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}{% endif -%}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else %}{{- '<think>\\n' -}}{%- endif %}"
    "{% endif -%}",
)
THINK_TOKENS = ["<think>", "</think>"]

_CORPUS = [
    "Describe this image.",
    "What is in the picture? A cat sits on a red sofa near the window.",
    "The astronaut smiles in front of the flag; a rocket launches into the blue sky.",
    "A cup of coffee on a wooden table, with steam rising slowly.",
    "Answer in one short sentence, please.",
    "There are 3 dogs, 12 birds and 7 trees in the park at 10:30 in the morning.",
    "user assistant system The quick brown fox jumps over the lazy dog.",
]


def installed_command(name: str) -> str:
    """A console script of this environment (`mmcli`, `clang-format`): beside the interpreter
    running, so a venv works unactivated, else as PATH finds it."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.is_file() else shutil.which(name) or name


# A JSON task's schema for tests and benches: an enum, bounded numbers, strings and a list.
EXAMPLE_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["kind", "count", "title", "tags"],
    "properties": {
        "kind": {"enum": ["photo", "drawing", "screenshot"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 20},
        "title": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    },
}


def tiny_tokenizer(vocab_size: int = 360, thinking: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if thinking:  # plain added tokens, as in Qwen3.5's tokenizer: decoded text keeps them
        tok.add_tokens(THINK_TOKENS)
    return tok


TINY_TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    model_type="qwen3_vl_text",
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=None,
)
TINY_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    in_channels=3,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[0, 1],
    hidden_act="gelu_pytorch_tanh",
    model_type="qwen3_vl",
    initializer_range=0.02,
)


def tiny_config(
    variant: str = "base",
    rope_form: str = "rope_scaling",
    vocab_size: int = 384,
    special_ids: dict | None = None,
) -> dict:
    """config.json of a tiny model. Variants: 'base' (head_dim 128, mrope [24,20,20], tied),
    'wide_attn' (attention width != hidden, untied), 'deepstack_last' (DeepStack taps on the last
    blocks)."""
    text = {**TINY_TEXT, "vocab_size": vocab_size}
    rope = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    vision = dict(TINY_VISION)
    tie = True
    if variant == "wide_attn":
        text.update(
            hidden_size=48,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
            num_hidden_layers=2,
        )
        rope["mrope_section"] = [6, 5, 5]
        vision.update(out_hidden_size=48, num_position_embeddings=576, deepstack_visual_indexes=[1])
        tie = False
    elif variant == "deepstack_last":
        text.update(num_hidden_layers=4)
        vision.update(depth=5, deepstack_visual_indexes=[2, 3, 4], num_heads=4)
    elif variant != "base":
        raise ValueError(f"unknown tiny variant {variant!r}")
    if rope_form == "rope_scaling":
        text.update(rope_theta=5_000_000.0, rope_scaling=rope)
    else:
        text["rope_parameters"] = {**rope, "rope_theta": 5_000_000.0}
    ids = special_ids or {}
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "image_token_id": ids.get("<|image_pad|>", 151655),
        "video_token_id": ids.get("<|video_pad|>", 151656),
        "vision_start_token_id": ids.get("<|vision_start|>", 151652),
        "vision_end_token_id": ids.get("<|vision_end|>", 151653),
        "tie_word_embeddings": tie,
        "text_config": text,
        "vision_config": vision,
        "dtype": "float32",
        "transformers_version": "4.57.0.dev0",
    }


QWEN3_5_VARIANTS = ("qwen3_5", "qwen3_5_wide")
MOE_VARIANTS = ("qwen3_vl_moe", "qwen3_5_moe")
# four experts, two per token; Qwen3-VL MoE's second layer dense (mlp_only_layers), Qwen3.5 MoE's
# layers each with a shared expert
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96)


def tiny_moe_config(variant: str, vocab_size: int, special_ids: dict) -> dict:
    """config.json of a tiny MoE model, as transformers writes it."""
    if variant == "qwen3_vl_moe":
        config = tiny_config("base", "rope_parameters", vocab_size, special_ids)
        config["text_config"].update(
            TINY_MOE, model_type="qwen3_vl_moe_text", decoder_sparse_step=1, mlp_only_layers=[1]
        )
        config.update(architectures=["Qwen3VLMoeForConditionalGeneration"], model_type=variant)
        config["vision_config"]["model_type"] = "qwen3_vl_moe"
        return config
    config = tiny_qwen3_5_config("qwen3_5", vocab_size, special_ids)
    config["text_config"].update(
        TINY_MOE, model_type="qwen3_5_moe_text", shared_expert_intermediate_size=40
    )
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type=variant)
    config["vision_config"]["model_type"] = "qwen3_5_moe_vision"
    return config


def tiny_qwen3_5_config(variant: str, vocab_size: int, special_ids: dict) -> dict:
    """config.json of a tiny Qwen3.5 model, as transformers writes it. 'qwen3_5': three linear
    layers per full one, tied; 'qwen3_5_wide': alternating layers, value heads wider than key
    heads, GQA, untied."""
    text = {
        **TINY_TEXT,
        "model_type": "qwen3_5_text",
        "vocab_size": vocab_size,
        # Gated DeltaNet's RMSNorm scales each head's delta-rule output (small in a random model)
        # up to unit size, magnifying float32 rounding by up to 1/sqrt(eps): 1e-5 keeps the tiny
        # models' float32 logits within reach of a 1e-4 comparison
        "rms_norm_eps": 1e-5,
        "num_hidden_layers": 4,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
    }
    tie = variant == "qwen3_5"
    if variant == "qwen3_5_wide":
        text.update(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_value_head_dim=24,
            layer_types=["linear_attention", "full_attention"] * 2,
        )
        text["rope_parameters"].update(mrope_section=[2, 1, 1])
    text["tie_word_embeddings"] = tie
    vision = {**TINY_VISION, "model_type": "qwen3_5_vision"}
    vision.pop("deepstack_visual_indexes")
    config = tiny_config("base", "rope_parameters", vocab_size, special_ids)
    config.update(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        tie_word_embeddings=tie,
        text_config=text,
        vision_config=vision,
    )
    return config


def qwen3_5_2b_config(special_ids: dict) -> dict:
    """config.json with the shapes of the released Qwen3.5-2B, for benchmarks on random
    weights."""
    config = tiny_qwen3_5_config("qwen3_5", 248320, special_ids)
    config["text_config"].update(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        max_position_embeddings=262144,
    )
    config["text_config"]["rope_parameters"].update(mrope_section=[11, 11, 10])
    config["vision_config"].update(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048
    )
    return config


def qwen3_5_35b_a3b_config(special_ids: dict) -> dict:
    """config.json with the shapes of the released Qwen3.5-35B-A3B (256 experts, 8 a token and a
    shared one; 30 Gated DeltaNet and 10 attention layers), for benchmarks on random weights."""
    config = tiny_moe_config("qwen3_5_moe", 248320, special_ids)
    config["text_config"].update(
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
    )
    config["tie_word_embeddings"] = False
    config["text_config"]["rope_parameters"].update(mrope_section=[11, 11, 10])
    config["vision_config"].update(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048
    )
    return config


def qwen3_vl_30b_a3b_config(special_ids: dict) -> dict:
    """config.json with the shapes of the released Qwen3-VL-30B-A3B-Instruct (128 experts, 8 a
    token), for benchmarks on random weights."""
    config = tiny_moe_config("qwen3_vl_moe", 151936, special_ids)
    config["text_config"].update(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        max_position_embeddings=262144,
    )
    config["tie_word_embeddings"] = False
    config["vision_config"].update(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=2048,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
    )
    return config


def qwen3_vl_2b_config(special_ids: dict) -> dict:
    """config.json with the shapes of the released Qwen3-VL-2B-Instruct, for benchmarks on random
    weights."""
    config = tiny_config("base", "rope_scaling", 151936, special_ids)
    config["text_config"].update(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
    )
    config["vision_config"].update(
        depth=24,
        hidden_size=1024,
        intermediate_size=4096,
        num_heads=16,
        out_hidden_size=2048,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[5, 11, 17],
    )
    return config


def random_weights(
    config: dict, seed: int = 0, std: float = 0.15, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random tensors for every name the config implies; std is large so greedy choices have
    clear margins."""
    g = torch.Generator().manual_seed(seed)
    model = parse_config(config)
    return {
        name: random_tensor(name, shape, g, std, model.text.norm_unit_offset).to(dtype)
        for name, shape in expected_shapes(model).items()
    }


def random_tensor(
    name: str,
    shape: tuple[int, ...],
    g: torch.Generator,
    std: float = 0.15,
    unit_offset: bool = False,
) -> torch.Tensor:
    """One tensor of a random checkpoint, by its name: norms scaling by about 1 (a weight near 1,
    or near 0 where the text decoder's norms scale by 1 + weight), Gated DeltaNet's decay rates A
    from 0.5 to 8, matrices scaled to their fan-in (a depthwise conv's is its kernel)."""
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.5, 8, generator=g).log()
    norm = "norm1" in name or "norm2" in name or name.endswith(("norm.weight", "layernorm.weight"))
    if norm and name.endswith("weight"):
        offset = unit_offset and "language_model" in name and "linear_attn" not in name
        return (0.0 if offset else 1.0) + 0.1 * torch.randn(shape, generator=g)
    scale = std if name.endswith("weight") else 0.05
    if "conv1d" in name:  # a depthwise conv: fan-in is its kernel
        scale = 1.5 / shape[-1] ** 0.5
    elif len(shape) == 3:  # MoE experts [E, out, in]
        scale = min(std, 1.5 / shape[-1] ** 0.5)
    elif name.endswith("weight") and len(shape) == 2 and "embed" not in name:
        scale = min(std, 1.5 / shape[1] ** 0.5)
    return scale * torch.randn(shape, generator=g)


def make_tiny_checkpoint(
    path: str | Path,
    variant: str = "base",
    *,
    seed: int = 0,
    dtype: str = "float32",
    rope_form: str = "rope_scaling",
    shards: int = 1,
    template_file: str = "json",
    max_pixels: int = 128 * 128,
    min_pixels: int = 32 * 32,
    released_shapes: bool = False,
    layers: int | None = None,
    weights: bool = True,
) -> Path:
    """Write config.json, weights, tokenizer, chat template, preprocessor and generation configs
    to `path`. `released_shapes` gives the tensors of Qwen3-VL-2B, Qwen3.5-2B with a Qwen3.5
    variant, or Qwen3-VL-30B-A3B with `qwen3_vl_moe` (random values, for benchmarks); `layers`
    keeps the text decoder's first layers only; without `weights`, everything but the weights
    (a writer of its own streams those: bench/big_moe.py)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hybrid = variant in QWEN3_5_VARIANTS or variant == "qwen3_5_moe"
    tok = tiny_tokenizer(thinking=hybrid)
    tok.save(str(path / "tokenizer.json"))
    special_ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab = -(-tok.get_vocab_size() // 64) * 64
    config = _variant_config(variant, rope_form, vocab, special_ids, released_shapes)
    config["dtype"] = dtype
    if layers is not None:  # the first layers only
        text = config["text_config"]
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if weights:
        tensors = random_weights(
            config, seed, std=0.02 if released_shapes else 0.15, dtype=getattr(torch, dtype)
        )
        if config["tie_word_embeddings"]:
            tensors.pop("lm_head.weight")
        _save_weights(path, tensors, shards)
    template = THINKING_TEMPLATE if hybrid else CHAT_TEMPLATE
    _write_processor_files(path, template_file, min_pixels, max_pixels, template)
    gen = {
        "bos_token_id": special_ids["<|endoftext|>"],
        "pad_token_id": special_ids["<|endoftext|>"],
        "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
        "do_sample": False,
    }
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


def _variant_config(
    variant: str, rope_form: str, vocab: int, special_ids: dict, released_shapes: bool
) -> dict:
    if variant == "qwen3_vl_moe" and released_shapes:
        return qwen3_vl_30b_a3b_config(special_ids)
    if variant == "qwen3_5_moe" and released_shapes:
        return qwen3_5_35b_a3b_config(special_ids)
    if variant in MOE_VARIANTS:
        return tiny_moe_config(variant, vocab, special_ids)
    if variant in QWEN3_5_VARIANTS:
        if released_shapes:
            return qwen3_5_2b_config(special_ids)
        return tiny_qwen3_5_config(variant, vocab, special_ids)
    if released_shapes:
        return qwen3_vl_2b_config(special_ids)
    return tiny_config(variant, rope_form, vocab, special_ids)


def _save_weights(path: Path, weights: dict, shards: int) -> None:
    names = sorted(weights)
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[k::shards]}
            save_file(part, str(path / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in part})
        total = sum(t.numel() * t.element_size() for t in weights.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )


def _write_processor_files(
    path: Path, template_file: str, min_pixels: int, max_pixels: int, template: str
) -> None:
    tok_cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 262144,
        "errors": "replace",
        "split_special_tokens": False,
        "add_prefix_space": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    if template_file == "json":
        (path / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    else:
        (path / "chat_template.jinja").write_text(template)
    pre = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    video = {
        **pre,
        "video_processor_type": "Qwen3VLVideoProcessor",
        "fps": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
    }
    video.pop("image_processor_type")
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


def make_outlier_checkpoint(source: str | Path, target: str | Path) -> Path:
    """A copy of a tiny checkpoint whose decoder RMSNorm weights carry three channels scaled by
    30: large outlier channels in the activations the linear layers read, as real language models
    show (written once)."""
    import shutil

    from safetensors.torch import load_file

    target = Path(target)
    if not (target / "config.json").is_file():
        shutil.copytree(source, target, dirs_exist_ok=True)
        tensors = load_file(str(target / "model.safetensors"))
        generator = torch.Generator().manual_seed(0)
        for name, tensor in tensors.items():
            if "language_model" in name and name.endswith("layernorm.weight"):
                tensor[torch.randperm(tensor.numel(), generator=generator)[:3]] *= 30
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def make_test_video(
    path: str | Path,
    seconds: float = 2.0,
    fps: int = 10,
    width: int = 96,
    height: int = 64,
    codec: str = "mpeg4",
    rotation: int = 0,
    frame_times: list[float] | None = None,
    keyframe_every: int = 12,
    mirror: str | None = None,
    container_format: str | None = None,
) -> Path:
    """A small video written with PyAV: frame k is grey level (k * 7) % 256 with a white top-left
    corner (so a test can tell frames and orientation apart), `width` x `height` as displayed.
    `frame_times` gives each frame's own time (variable frame rate); with `rotation` (the display
    matrix's counterclockwise degrees, a multiple of 90) the frames are stored turned the other
    way, so that a player that honours the matrix shows them upright. `mirror` ("horizontal" or
    "vertical", without a rotation) stores them mirrored, with a display matrix that mirrors them
    back. `frame_times` may start after 0 (a clip cut from a stream)."""
    import av
    import numpy as np

    path = Path(path)
    times = (
        frame_times if frame_times is not None else [k / fps for k in range(round(seconds * fps))]
    )
    if mirror is not None and rotation:
        raise ValueError("mirror goes without a rotation here")
    flips = {"hflip": mirror == "horizontal", "vflip": mirror == "vertical"}
    with av.open(str(path), "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=fps)
        turns = rotation // 90 % 4
        stream.width, stream.height = (height, width) if turns % 2 else (width, height)
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = Fraction(1, fps if frame_times is None else 1000)
        stream.codec_context.gop_size = keyframe_every
        if rotation or mirror:
            stream.set_display_rotation(rotation, **flips)
        for k, t in enumerate(times):
            rgb = np.full((height, width, 3), (k * 7) % 256, np.uint8)
            rgb[: height // 4, : width // 4] = 255
            stored = np.rot90(rgb, -turns)
            stored = stored[:, ::-1] if flips["hflip"] else stored
            stored = stored[::-1] if flips["vflip"] else stored
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(stored), format="rgb24")
            frame.time_base = stream.codec_context.time_base
            frame.pts = round(t / frame.time_base)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def boxes_record(
    path: Path, boxes: list[dict], size: tuple[int, int], key: str | None = None
) -> dict:
    """A `detect` task's record holding these boxes (pixels of a `size` image), as a run writes
    it; the tiny checkpoints cannot answer with boxes, so tests of what reads them make one."""
    from mmcli.api.result import Result
    from mmcli.jobs.records import make_record

    key = key or Path(path).name
    image = [{"width": size[0], "height": size[1]}]
    result = Result(key, text="[]", images=image, fields={"text": "[]", "boxes": boxes})
    return make_record(
        key=key,
        task="detect",
        prompt="Locate.",
        result=result,
        model="test",
        model_revision=None,
        sampling={},
        path=path,
    )


def free_port() -> int:
    """A free loopback port."""
    from mmcli.cli.serve import free_port as port_on

    return port_on("127.0.0.1")


@contextlib.contextmanager
def live_server(labeler, service, model: str = "tiny", **settings):
    """`mmcli serve`'s app over `service` on uvicorn, in a thread of this process, on a free
    loopback port; yields its address."""
    import threading
    import time

    import uvicorn

    from mmcli.hosts import accepted_hosts
    from mmcli.serve.app import ServeSettings, create_app

    port = free_port()
    settings.setdefault("hosts", accepted_hosts("127.0.0.1", port, []))
    log = settings.pop("log", None)  # the access log's lines: stderr unless given
    app = create_app(labeler, service, ServeSettings(served_model=model, **settings), log)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join()


@contextlib.contextmanager
def served_process(model, *flags: str, port: int | None = None, timeout: float = 120):
    """`mmcli serve --model MODEL FLAGS` as its own process on a free loopback port (unless
    given), float32 on the CPU, model name `tiny`; yields (base URL, the process) once it
    answers, its stderr collected in `process.log` (a list of lines)."""
    import subprocess
    import threading
    import time
    import urllib.request

    port = port or free_port()
    command = [installed_command("mmcli"), "serve", "--model", str(model), "--port", str(port)]
    command += ["--dtype", "float32", "--device", "cpu", "--served-model-name", "tiny", *flags]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    process.log = []
    reader = threading.Thread(target=lambda: process.log.extend(process.stderr), daemon=True)
    reader.start()
    host = next((flags[i + 1] for i, f in enumerate(flags[:-1]) if f == "--host"), "127.0.0.1")
    url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except OSError as e:
                if process.poll() is not None or time.time() > deadline:
                    log = "".join(process.log)
                    raise RuntimeError(f"mmcli serve did not start:\n{log}") from e
                time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        reader.join(5)


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory so far (Linux's VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for process {pid}")


def padded_batch_file(path: Path, count: int) -> Path:
    """A Batch API file of `count` lines of 2 KB each (a `metadata` pad): every 1000th a
    question for one token, the rest naming an image that is not there (that line's error)."""
    pad = "p" * 2000
    with open(path, "w") as f:
        for i in range(count):
            text = {"type": "text", "text": "Describe."}
            image = {"type": "image_url", "image_url": {"url": f"missing-{i}.png"}}
            content = "hi" if i % 1000 == 0 else [image, text]
            body = {"model": "any", "messages": [{"role": "user", "content": content}]}
            body.update(max_tokens=1, metadata={"pad": pad})
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            f.write(json.dumps({**line, "body": body}) + "\n")
    return path


def batch_peak_rss_mb(model, requests: Path, output: Path) -> float:
    """`mmcli batch REQUESTS -o OUTPUT` (float32, CPU) in its own process: its peak resident
    memory (VmHWM at its exit: ru_maxrss would keep its parent's across exec), in MB; a
    RuntimeError unless it exits 0 or 1 (lines failed)."""
    import subprocess

    argv = ["mmcli", "batch", str(requests), "-o", str(output), "--model", str(model), "-q"]
    argv += ["--dtype", "float32", "--device", "cpu"]
    code = (
        "import atexit, os, sys; from mmcli.testing import peak_rss_mb; "
        "atexit.register(lambda: print('PEAK', peak_rss_mb(os.getpid()), file=sys.stderr)); "
        f"sys.argv = {argv!r}; from mmcli.cli.app import app; app()"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if run.returncode not in (0, 1):
        raise RuntimeError(f"mmcli batch exited {run.returncode}:\n{run.stderr}")
    return float(run.stderr.rsplit("PEAK", 1)[1].split()[0])


def forced_logits(labeler, requests, tokens: list[list[int]]) -> list[torch.Tensor]:
    """Teacher forcing: each request's logits [len(tokens), V] (float32) at every step of decoding
    its `tokens`, the sequences prefilled together and decoded in one batched step each, as the
    engine runs them (the prefill's last logits, then one decode step a token: the step's kernels
    and its KV cache)."""
    from mmcli.engine.batch import DecodeItem, PrefillItem

    runner, steps = labeler.runner, len(tokens[0])
    items = [
        PrefillItem(
            i,
            req.input_ids,
            req.rotary_position_ids,
            req.pixel_values,
            req.vision_grids,
            max_tokens=len(req.input_ids) + steps,
        )  # fmt: skip
        for i, req in enumerate(requests)
    ]
    with torch.inference_mode():
        logits = [runner.prefill(items)]
        for step in range(steps - 1):
            rows = [
                DecodeItem(i, ts[step], len(req.input_ids) + step, req.rope_delta)
                for i, (req, ts) in enumerate(zip(requests, tokens))
            ]
            logits.append(runner.decode(rows))
    return list(torch.stack(logits, dim=1).float().unbind(0))
