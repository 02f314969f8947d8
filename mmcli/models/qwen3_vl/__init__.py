"""Qwen3-VL: a vision tower with DeepStack mergers and a Qwen3 text decoder with M-RoPE."""

from mmcli.models.qwen3_vl.family import Qwen3VL

FAMILY = Qwen3VL()
