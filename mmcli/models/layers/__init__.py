"""The building blocks the families compose: norms, linear layers (and their quantized forms),
attention, rotary, the MLP and the sparse MoE block, and the per-sequence cache."""
