"""Qwen3.5: the Qwen3-VL layout with a hybrid text decoder (its Gated DeltaNet layers live here)."""

from mmcli.models.qwen3_5.family import Qwen3_5

FAMILY = Qwen3_5()
