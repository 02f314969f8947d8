"""Scanning folders into items: keys, several roots, clashes."""

import pytest
from conftest import image_folder
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.errors import ConfigError
from mmcli.jobs.scan import scan


def test_several_roots_prefix_their_keys_and_a_clash_is_refused(tmp_path):
    a, b = image_folder(tmp_path / "a", 1), image_folder(tmp_path / "b", 1)
    assert [k for k, _ in scan([a, b])] == ["a/im0.jpg", "b/im0.jpg"]
    assert [k for k, _ in scan([a])] == ["im0.jpg"]
    twin = image_folder(tmp_path / "elsewhere" / "a", 1)
    with pytest.raises(ConfigError, match="both give the key 'a/im0.jpg'"):
        scan([a, twin])
    result = CliRunner().invoke(
        app, ["caption", str(a), str(twin), "--dry-run", "-o", str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code == 2 and "both give the key" in result.output
