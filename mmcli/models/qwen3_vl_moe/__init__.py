"""Qwen3-VL MoE: Qwen3-VL with sparse MLP blocks."""

from mmcli.models.qwen3_vl_moe.family import Qwen3VLMoe

FAMILY = Qwen3VLMoe()
