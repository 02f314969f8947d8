"""What a model family gives mmcli, one small protocol (torch-free: the config is read before
torch loads). A family is a package under mmcli/models/ whose `FAMILY` is an instance of a
subclass, and a line in registry.py; docs/internals.md has the checklist.

The shared rooms (weights/, kernels/, engine/, api/) know a model only through this protocol and
the module tree's top: `visual`, `language_model`, `lm_head` and the layers of models/layers/;
every name below that is the family's (tests/test_family_rooms.py greps for them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mmcli.models.config import ModelConfig, TextConfig

# A scope (a decoder layer, a vision block) and the norms in it, each with the linears that read
# its output: int8 folds each norm's weight into those linears, a scope at a time.
FoldGroups = list[tuple["nn.Module", list[tuple["nn.Module", list["nn.Module"]]]]]


class Family:
    model_type = ""  # config.json's model_type
    name = ""  # as people write it
    backends = ("eager", "inductor", "neuron")  # the compile backends that can run it
    backend_reason = ""  # why the backends missing from `backends` cannot run it
    cuda_graphs = True  # whether a decode step can be captured (not where routing is host-read)
    token_embedding = ""  # the checkpoint's token embedding: a tied lm_head's weight

    def hybrid(self, text: TextConfig) -> bool:
        """Whether the decoder has layers of a recurrent kind beside attention."""
        return False

    def sparse(self, text: TextConfig) -> bool:
        """Whether the decoder has MoE blocks (a router and experts)."""
        return False

    def fusable_decode(self, text: TextConfig) -> bool:
        """Whether every decoder layer is of the kind decode_layer.c computes in one call (read
        before the weights: their form is checked again on the layers)."""
        return False

    def unused_tensor(self, name: str) -> bool:
        """Whether a checkpoint tensor is left unread (a head mmcli does not run)."""
        return False

    def read_config(self, raw: dict, where: str) -> ModelConfig:
        """config.json's dict as the model's shape; a bad value is a CheckpointError naming
        `where` and the key."""
        raise NotImplementedError

    def build(self, cfg: ModelConfig) -> nn.Module:
        """The module tree, named as the checkpoint names its tensors; it embeds its inputs
        (`embed_inputs`, DeepStack included) and holds `visual`, `language_model` and `lm_head`.
        `language_model` gives `fusable_layers()`: its layers as kernels/fused_decode.py's
        FusableLayer, or None where one is of another kind."""
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

    def rotary_axes(self, text: TextConfig) -> torch.Tensor:
        """Which position stream (0 T, 1 H, 2 W) turns each rotary frequency slot [rotary/2]."""
        raise NotImplementedError

    def vision_levels(self, cfg: ModelConfig) -> int:
        """How many feature levels the vision tower hands the decoder besides the merged one."""
        return 0

    def fold_groups(self, model: nn.Module) -> FoldGroups:
        """The norms int8 folds into the linears reading them, scope by scope."""
        return []

    def kept_linears(self, model: nn.Module) -> set[nn.Module]:
        """The linears quantization leaves as loaded (an MoE's routers)."""
        return set()
