"""The precision a run holds its weights in and computes in, resolved from the settings, the
checkpoint's dtype and the device (torch-free but for `torch_dtype`)."""

from __future__ import annotations

from mmcli.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """The torch dtype of a precision's name (imports torch)."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def resolve_dtype(name: str, checkpoint_dtype: str, device_type: str) -> str:
    """dtype as run. auto: the checkpoint's dtype on accelerators; float32 on the CPU, where
    bfloat16 matmuls mostly lack fast kernels."""
    if name != "auto":
        return name
    return "float32" if device_type == "cpu" else checkpoint_dtype


def resolve_weights_dtype(
    weights: str, compute: str, dtype_setting: str, checkpoint_dtype: str, device_type: str
) -> str:
    """weights_dtype as run. auto: as stored when the computation is float32 on the CPU by
    default (`dtype: auto`; a stored bfloat16 or float16 value converts to float32 exactly), else
    the compute dtype (so an explicit `dtype: float32` holds float32 weights)."""
    if weights != "auto":
        return weights
    stored_lower = checkpoint_dtype in ("bfloat16", "float16")
    return (
        checkpoint_dtype
        if dtype_setting == "auto" and device_type == "cpu" and stored_lower
        else compute
    )


def run_precision(
    dtype: str, weights_dtype: str, quantize: str, checkpoint_dtype: str, device_type: str
) -> dict:
    """The precisions a run holds and computes in, as records name them: weights (as loaded;
    `int8` once quantized), compute (activations and accumulation) and the quantization."""
    compute = resolve_dtype(dtype, checkpoint_dtype, device_type)
    loaded = resolve_weights_dtype(weights_dtype, compute, dtype, checkpoint_dtype, device_type)
    return {
        "weights": quantize if quantize in ("int8", "int4") else loaded,
        "loaded": loaded,
        "compute": compute,
        "quantize": quantize,
    }
