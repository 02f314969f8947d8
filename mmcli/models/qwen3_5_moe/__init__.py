"""Qwen3.5 MoE: Qwen3.5 with sparse MLP blocks and a shared expert."""

from mmcli.models.qwen3_5_moe.family import Qwen3_5Moe

FAMILY = Qwen3_5Moe()
