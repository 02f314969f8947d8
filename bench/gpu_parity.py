"""mmcli against transformers on CUDA, on the tests' tiny random checkpoints (three Qwen3-VL
shapes; two Qwen3.5 ones and the two MoE families, whose weights transformers wrote).

float32: greedy tokens must be identical (32 tokens, text only, one image, two images). bfloat16:
mmcli's and transformers' logits, each teacher-forced along transformers' float32 tokens (one early
divergence does not count for every later position), against transformers' float32 logits: how far
each side is from them (the root-mean-square difference over their spread) and where its choice
differs from float32's (a random tiny checkpoint's logits are nearly flat: either side may take a
near-tie, so a choice is not the measure). Exits 1 if float32 differs or mmcli's bfloat16 is
further from float32 than MARGIN and than FACTOR times transformers' own bfloat16.

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
from mmcli.testing import (  # noqa: E402
    MOE_VARIANTS,
    QWEN3_5_VARIANTS,
    forced_logits,
    make_tiny_checkpoint,
)

CASES = {
    "text_only": [],
    "one_image": ["chelsea.jpg"],
    "two_images": ["astronaut.jpg", "coffee.jpg"],
}
QUESTION = "Describe this image."
TOKENS = 32
# Of the float32 logits' spread (their standard deviation): bfloat16 moves the Qwen3-VL
# checkpoints' logits by 1-3% of it (root mean square), a wrong kernel by all of it. A family
# whose reference moves further in bfloat16 (Qwen3.5's recurrences: 3-11%) is held to FACTOR
# times transformers' own distance instead (the two sides measured 0.7-1.5x apart on the CPU).
MARGIN = 0.05
FACTOR = 2.0


DEVICE = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"


def reference(
    path: Path, dtype: torch.dtype, images: list, forced: list[int] | None = None
) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and its logits at each generated position; with `forced`,
    teacher-forced along those tokens (its raw logits, before the processor that forces them)."""
    from transformers import (
        AutoModelForImageTextToText,
        GenerationConfig,
        LogitsProcessor,
        LogitsProcessorList,
    )

    class Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            token = forced[input_ids.shape[1] - prompt_length]
            only = torch.full_like(scores, -torch.inf)
            only[:, token] = 0
            return only

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
    prompt_length = inputs["input_ids"].shape[1]
    gen = GenerationConfig(
        max_new_tokens=TOKENS,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.inference_mode():
        processors = LogitsProcessorList([Forced()] if forced else [])
        out = model.generate(**inputs, generation_config=gen, logits_processor=processors)
    tokens = out.sequences[0, prompt_length:].tolist()
    return tokens, torch.stack([step[0].float() for step in out.logits]).cpu()


def ours_greedy(cap: Labeler, images: list) -> list[int]:
    from dataclasses import replace

    req, _ = cap.request("k", images, QUESTION, cap.sampling(max_new_tokens=TOKENS))
    return next(iter(cap.engine.generate([replace(req, stop_ids=frozenset())]))).token_ids


def distance(logits: torch.Tensor, truth: torch.Tensor) -> float:
    """The root-mean-square difference from the float32 logits, in their spread."""
    return ((logits - truth).square().mean().sqrt() / truth.std()).item()


def unlike(logits: torch.Tensor, truth: torch.Tensor) -> list[int]:
    """Positions whose choice differs from float32's."""
    return (logits.argmax(-1) != truth.argmax(-1)).nonzero().flatten().tolist()


def bfloat16_parity(ours: torch.Tensor, theirs: torch.Tensor, truth: torch.Tensor):
    """Whether mmcli's bfloat16 holds (within MARGIN of float32, or FACTOR times transformers'
    bfloat16 distance), and the line that says so."""
    mine, reference_distance = distance(ours, truth), distance(theirs, truth)
    line = (
        f"from float32 {mine:.3f} of its spread (transformers' bfloat16 {reference_distance:.3f}; "
        f"margin {MARGIN}, or {FACTOR}x transformers'); choices unlike float32's at positions: "
        f"mmcli {unlike(ours, truth) or 'none'}, transformers {unlike(theirs, truth) or 'none'}"
    )
    return mine <= max(MARGIN, FACTOR * reference_distance), line


def main() -> int:
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, variant in enumerate([*VARIANTS, *QWEN3_5_VARIANTS, *MOE_VARIANTS]):
            path = make_tiny_checkpoint(Path(tmp) / variant, variant, seed=i + 1)
            if variant not in VARIANTS:
                path = hf_written(path, seed=i + 1)
            truth = {}  # each case's float32 tokens and logits (transformers'), for bfloat16
            for dtype in ("float32", "bfloat16"):
                cap = Labeler.from_pretrained(str(path), dtype=dtype, device=DEVICE)
                for case, names in CASES.items():
                    images = [photo(n) for n in names]
                    if dtype == "float32":
                        ref_tokens, ref_logits = truth[case] = reference(
                            path, torch.float32, images
                        )
                        ours = ours_greedy(cap, images)
                        same = ours == ref_tokens
                        failures += not same
                        print(
                            f"{variant} {case} float32: greedy tokens "
                            f"{'identical' if same else 'DIFFER'} ({TOKENS} tokens)",
                            flush=True,
                        )
                        continue
                    ref_tokens, ref_logits = truth[case]
                    _, theirs = reference(path, torch.bfloat16, images, forced=ref_tokens)
                    req, _ = cap.request("k", images, QUESTION, cap.sampling())
                    ours = forced_logits(cap, [req], [ref_tokens])[0].cpu()
                    held, line = bfloat16_parity(ours, theirs, ref_logits)
                    failures += not held
                    print(f"{variant} {case} bfloat16: {line}", flush=True)
                del cap
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    print("gpu parity:", "ok" if not failures else f"{failures} failing cases")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
