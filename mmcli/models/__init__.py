"""The model families, shaped like their released checkpoints: shared blocks in layers/, a package
per family, found through registry.py by config.json's model_type."""
