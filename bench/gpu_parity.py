"""mmcli against transformers on CUDA, on the tests' tiny random checkpoints (three Qwen3-VL
shapes; two Qwen3.5 ones and the two MoE families, whose weights transformers wrote).

float32: greedy tokens must be identical (32 tokens, text only, one image, two images). bfloat16:
the share of positions where the two agree (teacher-forced on transformers' own tokens, so one
early divergence does not count for every later position), with every divergence listed. Exits 1
if float32 differs or bfloat16 agrees on less than 90% of positions.

python bench/gpu_parity.py [--device cuda]   (--device cpu checks the script itself)"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import VARIANTS, hf_processor, hf_written, photo  # noqa: E402

from mmcli.api.labeler import Labeler  # noqa: E402
from mmcli.engine.batch import DecodeItem, PrefillItem  # noqa: E402
from mmcli.testing import MOE_VARIANTS, QWEN3_5_VARIANTS, make_tiny_checkpoint  # noqa: E402

CASES = {
    "text_only": [],
    "one_image": ["chelsea.jpg"],
    "two_images": ["astronaut.jpg", "coffee.jpg"],
}
QUESTION = "Describe this image."
TOKENS = 32


DEVICE = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"


def reference(path: Path, dtype: torch.dtype, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and its logits at each generated position."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval().to(DEVICE)
    model.generation_config.eos_token_id = None
    processor = hf_processor(path)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,  # as mmcli labels (Qwen3-VL's template has no such switch)
    )
    inputs = processor(text=[text], images=images or None, return_tensors="pt").to(DEVICE)
    gen = GenerationConfig(
        max_new_tokens=TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=gen)
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, torch.stack([step[0].float() for step in out.logits])


def ours_greedy(cap: Labeler, images: list) -> list[int]:
    from dataclasses import replace

    req, _ = cap.request("k", images, QUESTION, cap.sampling(max_new_tokens=TOKENS))
    return next(iter(cap.engine.generate([replace(req, stop_ids=frozenset())]))).token_ids


def ours_teacher_forced(cap: Labeler, images: list, tokens: list[int]) -> list[int]:
    """mmcli's argmax at each position, given transformers' tokens before it (fed one decode
    step at a time: a generated token is text even when its id is a vision placeholder's)."""
    req, _ = cap.request("k", images, QUESTION, cap.sampling())
    n = len(req.input_ids)
    item = PrefillItem(
        0,
        req.input_ids,
        req.rotary_position_ids,
        req.pixel_values,
        req.vision_grids,
        max_tokens=n + len(tokens),
    )
    with torch.inference_mode():
        chosen = [int(cap.runner.prefill([item])[0].argmax())]
        for k, token in enumerate(tokens[:-1]):
            step = DecodeItem(0, token, n + k, req.rope_delta)
            chosen.append(int(cap.runner.decode([step])[0].argmax()))
    return chosen


def main() -> int:
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate([*VARIANTS, *QWEN3_5_VARIANTS, *MOE_VARIANTS]):
            path = make_tiny_checkpoint(Path(tmp) / variant, variant, seed=i + 1)
            if variant not in VARIANTS:
                path = hf_written(path, seed=i + 1)
            for dtype in ("float32", "bfloat16"):
                cap = Labeler.from_pretrained(str(path), dtype=dtype, device=DEVICE)
                for case, names in CASES.items():
                    images = [photo(n) for n in names]
                    ref_tokens, _ = reference(path, getattr(torch, dtype), images)
                    if dtype == "float32":
                        ours = ours_greedy(cap, images)
                        same = ours == ref_tokens
                        failures += not same
                        print(
                            f"{variant} {case} float32: greedy tokens "
                            f"{'identical' if same else 'DIFFER'} ({TOKENS} tokens)",
                            flush=True,
                        )
                        continue
                    ours = ours_teacher_forced(cap, images, ref_tokens)
                    agree = sum(a == b for a, b in zip(ours, ref_tokens))
                    diverged = [
                        (n, a, b) for n, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b
                    ]
                    failures += agree < 0.9 * TOKENS
                    print(
                        f"{variant} {case} bfloat16: {agree}/{TOKENS} positions agree; "
                        f"divergences (position, mmcli, transformers): {diverged or 'none'}",
                        flush=True,
                    )
                del cap
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    print("gpu parity:", "ok" if not failures else f"{failures} failing cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
