"""The Python API: load a checkpoint once, then ask about inputs or label many items."""
