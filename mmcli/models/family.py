"""What a model family gives mmcli, one small protocol (torch-free: the config is read before
torch loads). A family is a package under mmcli/models/ whose `FAMILY` is an instance of a
subclass, and a line in registry.py; docs/internals.md has the checklist."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mmcli.models.config import ModelConfig


class Family:
    model_type = ""  # config.json's model_type
    name = ""  # as people write it
    backends = ("eager", "inductor", "neuron")  # the compile backends that can run it
    cuda_graphs = True  # whether a decode step can be captured (not where routing is host-read)

    def read_config(self, raw: dict, where: str) -> ModelConfig:
        """config.json's dict as the model's shape; a bad value is a CheckpointError naming
        `where` and the key."""
        raise NotImplementedError

    def build(self, cfg: ModelConfig) -> nn.Module:
        """The module tree, named as the checkpoint names its tensors; it embeds its inputs
        (`embed_inputs`, DeepStack included) and holds `visual`, `language_model` and `lm_head`."""
        raise NotImplementedError

    def map_checkpoint(self, tensors: dict[str, torch.Tensor], expected: dict) -> None:
        """Tensors as read into the names and layouts the module tree holds (in place); expected:
        every held name's shape."""

    def rope_index(
        self,
        input_ids: list[int],
        vision_grids: list[tuple[int, int, int]],
        visual_token_ids: tuple[int, ...],
        spatial_merge_size: int,
    ) -> tuple[torch.Tensor, int]:
        """[3, T] rotary position ids of one prompt and its delta (max + 1 - T)."""
        raise NotImplementedError
