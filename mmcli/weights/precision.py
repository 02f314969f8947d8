"""The precision a run holds its weights in and computes in, resolved from the settings, the
checkpoint's dtype and the device (torch-free but for `torch_dtype`)."""

from __future__ import annotations

from dataclasses import dataclass

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


def resolve_products(dtype: str, compute: str, loaded: str, bf16_matrix: bool) -> str:
    """The operands' dtype of the matrix products (GEMMs and attention's). auto on a CPU that
    multiplies bfloat16 in hardware, with bfloat16 weights: bfloat16 operands (and the KV cache),
    float32 accumulation, float32 between the products (norms, residuals, the few-rows decode
    kernels); else the compute dtype."""
    if dtype == "auto" and compute == "float32" and loaded == "bfloat16" and bf16_matrix:
        return "bfloat16"
    return compute


@dataclass(frozen=True)
class Precision:
    """The precisions a run holds and computes in, decided once (api.loader.resolve_run)."""

    weights: str  # as held: the dtype loaded, or int8 / int4 once quantized
    loaded: str  # the dtype the checkpoint's matrices are read into
    compute: str  # activations and accumulation
    products: str  # the matrix products' operands
    quantize: str  # none, int8 or int4

    def record(self) -> dict[str, str]:
        """As records carry it (`precision`): what ran, not how it was read."""
        return {
            "weights": self.weights,
            "compute": self.compute,
            "products": self.products,
            "quantize": self.quantize,
        }

    def describe(self) -> str:
        """For status lines: "bfloat16 weights, float32 compute (bfloat16 products)"."""
        text = f"{self.weights} weights, {self.compute} compute"
        return text + (f" ({self.products} products)" if self.products != self.compute else "")

    @property
    def compute_dtype(self):
        return torch_dtype(self.compute)

    @property
    def kv_dtype(self):
        """The KV cache's dtype: bfloat16 where the products are (the prompt's attention already
        multiplies its keys and values rounded so) or the weights are quantized (every product's
        inputs are already levels coarser than bfloat16's 8 bits: 7-bit ones a token for int8,
        a group for int4), else the products'. Held in bfloat16, a decode step reads half the
        bytes over its context."""
        rounded = self.quantize in ("int8", "int4")
        return torch_dtype("bfloat16" if rounded else self.products)

    @property
    def loaded_dtype(self):
        return torch_dtype(self.loaded)


def run_precision(
    dtype: str,
    weights_dtype: str,
    quantize: str,
    checkpoint_dtype: str,
    device_type: str,
    bf16_matrix: bool = False,
) -> Precision:
    """The settings' dtype, weights_dtype and quantize resolved for this checkpoint and device.
    `bf16_matrix`: the CPU multiplies bfloat16 in hardware (kernels/cpu_features.py)."""
    compute = resolve_dtype(dtype, checkpoint_dtype, device_type)
    loaded = resolve_weights_dtype(weights_dtype, compute, dtype, checkpoint_dtype, device_type)
    cpu_bf16 = bf16_matrix and device_type == "cpu"
    return Precision(
        weights=quantize if quantize in ("int8", "int4") else loaded,
        loaded=loaded,
        compute=compute,
        products=resolve_products(dtype, compute, loaded, cpu_bf16),
        quantize=quantize,
    )
