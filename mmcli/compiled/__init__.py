"""Compiled graphs: fixed-shape buckets compiled ahead and cached, and CUDA graphs."""
