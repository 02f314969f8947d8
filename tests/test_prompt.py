import pytest
from conftest import hf_processor, photo

from mmcli.errors import CheckpointError
from mmcli.inputs.prompt import PromptBuilder


@pytest.mark.parametrize(
    "names", [[], ["chelsea.jpg"], ["astronaut.jpg", "rocket.jpg", "coffee.jpg"]]
)
def test_ids_match_transformers_processor(variant_dirs, names):
    for path in variant_dirs.values():
        prompts = PromptBuilder.from_checkpoint(path, _image_id(path))
        proc = hf_processor(path)
        images = [photo(n) for n in names]
        question = "What is here? Answer in 3 words, please."
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
        text = proc.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
        assert prompts.render(question, ["image"] * len(images)) == text
        ref = proc(text=[text], images=images or None, return_tensors="pt")
        counts = [int(g.prod()) // 4 for g in ref["image_grid_thw"]] if images else []
        assert prompts.encode(question, counts) == ref["input_ids"][0].tolist()


def test_template_runs_in_a_sandbox(tmp_path, tiny_dir):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (bad / "chat_template.json").unlink()
    (bad / "chat_template.jinja").write_text("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    prompts = PromptBuilder.from_checkpoint(bad, _image_id(tiny_dir))
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        prompts.render("hi", [])


def _image_id(path):
    import json

    return json.loads((path / "config.json").read_text())["image_token_id"]


def test_missing_template_is_a_checkpoint_error(tmp_path, tiny_dir):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    (bare / "chat_template.json").unlink()
    with pytest.raises(CheckpointError, match="no chat template"):
        PromptBuilder.from_checkpoint(bare, _image_id(tiny_dir))
