"""The weights: where a checkpoint is (hub), reading and checking it, the precision a run
resolves, the model built from it, int8 and int4, and the prepared cache."""
