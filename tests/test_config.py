from pathlib import Path

import pytest

from mmcli.config import Config, load_config
from mmcli.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_documented_defaults_equal_built_in_defaults():
    assert load_config(ROOT / "configs" / "default.yaml") == Config()


def test_precedence_cli_over_file_over_defaults(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("generation:\n  max_new_tokens: 7\n  temperature: 0.5\nprompt: hello\n")
    cfg = load_config(f, {"generation": {"temperature": 0.9, "top_k": None}})
    assert (cfg.generation.max_new_tokens, cfg.generation.temperature, cfg.prompt) == (
        7,
        0.9,
        "hello",
    )
    assert cfg.generation.top_k == Config().generation.top_k


@pytest.mark.parametrize(
    "text,message",
    [
        ("generation:\n  temprature: 1\n", "config generation.temprature: unknown key"),
        (
            "generation:\n  max_new_tokens: many\n",
            "config generation.max_new_tokens: expected int, got 'many'",
        ),
        (
            "dtype: float64\n",
            "config dtype: value 'float64' must be auto, float32, bfloat16, float16",
        ),
        ("generation: 3\n", "config generation: expected a mapping"),
        (
            "engine:\n  max_cache_tokens: 100\n",
            "config engine.max_cache_tokens: value 100 must be 0 (by the run) or at least "
            "engine.max_len",
        ),
        ("- a\n- b\n", "top level must be a mapping"),
    ],
)
def test_bad_config_is_refused_naming_the_key(tmp_path, text, message):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(f)
