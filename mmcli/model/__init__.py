"""The models, shaped like the released checkpoints, and loading them."""
