"""Qwen3.5: the Qwen3-VL layout with a hybrid text decoder, whose Gated DeltaNet layers live here.

Everything else (vision tower without DeepStack, gated full attention, (1 + weight) norms, partial
rotary) is the shared modules' configuration."""
