"""Our C kernels (cpu.py) as the layers call them once the kernel plan installs them: each takes
a layer's inputs and returns its output, or None where these inputs are not the kernel's (another
dtype or device, strides it does not read, inside a graph being traced), and the layer then runs
its own torch code. The checks are the kernels' contracts, so a layer knows no kernel by name."""

from __future__ import annotations

import functools

import torch

from mmcli.kernels import cpu, delta_rule
from mmcli.kernels.weight_forms import split_products

# the few-rows kernel up to here, the GEMM above: their crossover (bench/float_kernels.py)
KERNEL_ROWS = 16


def _float32_on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def rms_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rounded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """rms_norm.c: (x + update, its norm) in one call (torch's CPU rms_norm alone is eight
    operations), `update` None (x as it is: its rows may be strided) or a product's outputs
    (float32, or bfloat16 handed on); the norm in bfloat16 where `rounded`."""
    if not (_float32_on_cpu(x, weight) and x.stride(-1) == 1 and cpu.eager()):
        return None
    if update is None and not rounded:
        return x, cpu.rms_norm(x, weight, eps)
    if not _whole_rows(x, update):
        return None
    return cpu.add_rms_norm(x, update, weight, eps, rounded)


def layer_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    rounded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """layer_norm.c: (x + update, its norm) in one pass, as rms_norm's."""
    if not (_float32_on_cpu(x, weight, bias) and _whole_rows(x, update) and cpu.eager()):
        return None
    return cpu.add_layer_norm(x, update, weight, bias, eps, rounded)


def _whole_rows(x: torch.Tensor, update: torch.Tensor | None) -> bool:
    """x (and update, where there is one: float32, or bfloat16 handed on) in the add-and-norm
    kernels' rows: contiguous, of whole vectors."""
    fits = update is None or (
        update.shape == x.shape
        and update.is_contiguous()
        and update.device.type == "cpu"
        and update.dtype in (torch.float32, torch.bfloat16)
    )
    return fits and x.is_contiguous() and x.shape[-1] % cpu.NORM_WIDTH == 0


def rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> torch.Tensor | None:
    """pointwise.c's rotary: x [..., heads, head_dim] by cos/sin [..., rotary_dim], one pass; x
    float32, or a product's bfloat16 outputs handed on; each head normalised first by an RMSNorm
    of `norm_weight` where given (float32, head_dim values), in the same pass."""
    if not (
        _float32_on_cpu(cos, sin)
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and x.dim() >= 3
        and x.stride(-1) == 1
        and cos.shape == sin.shape == (*x.shape[:-2], cos.shape[-1])
        and cos.shape[-1] % 2 == 0
        and cos.shape[-1] <= x.shape[-1]
        and not x.requires_grad
        and cpu.eager()
    ):
        return None
    if norm_weight is not None or x.dtype == torch.bfloat16:
        fits = x.shape[-1] <= cpu.MAX_HEAD and (
            norm_weight is None or _float32_on_cpu(norm_weight) and norm_weight.is_contiguous()
        )
        if not fits:
            return None
    try:
        rows = x.view(-1, *x.shape[-2:])
    except RuntimeError:  # leading dimensions that do not merge: torch's path
        return None
    rotary_dim = cos.shape[-1]
    cos, sin = cos.reshape(-1, rotary_dim).contiguous(), sin.reshape(-1, rotary_dim).contiguous()
    norm = (norm_weight, eps) if norm_weight is not None else None
    return cpu.rotary(rows, cos, sin, norm).view(x.shape)


def silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """pointwise.c's SwiGLU, silu(gate) * up in one pass, into gate (the layer does not keep
    it). bfloat16 gate and up, a bfloat16 GEMM's outputs handed on as they are (Linear's
    `rounded`), give silu(gate) * up in float32 rounded to bfloat16: the down projection's input
    as its product would round it."""
    if not (
        gate.shape == up.shape
        and gate.is_contiguous()
        and up.is_contiguous()
        and not gate.requires_grad
        and cpu.eager()
    ):
        return None
    if _bf16_on_cpu(gate, up):
        return cpu.silu_times_rounded(gate, up)
    return cpu.silu_times(gate, up) if _float32_on_cpu(gate, up) else None


def _bf16_on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
) -> torch.Tensor | None:
    """attention.c: the decoder prefill's causal, grouped-query attention and attention within
    one image's range."""
    if not _attention_inputs(q, k, v):
        return None
    return cpu.attention(q, k, v, causal)


def attention_pairs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    tiles: bool = False,
) -> torch.Tensor | None:
    """attention.c with its products on bfloat16 pairs (`tiles`: on the AMX tiles), for runs
    whose products are bfloat16; None where the loaded build has no such products
    (MMCLI_CPU_FEATURES masked AVX-512 BF16 since)."""
    if not (_attention_inputs(q, k, v) and cpu.has_attention_pairs(tiles)):
        return None
    return cpu.attention(q, k, v, causal, "tiles" if tiles else "pairs")


def _attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (
        _float32_on_cpu(q, k, v) and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    ) and cpu.eager()


def bf16_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    rounded: bool = False,
    few_rows: int = KERNEL_ROWS,
) -> torch.Tensor | None:
    """bf16_linear.c: x (float32) @ weight.T (bfloat16) + bias, then the activation; up to
    `few_rows` rows the few-rows kernel, more rows the GEMM (which applies the bias and the
    activation as it stores). Its products are float32, so are its outputs, `rounded` or not."""
    if not (
        weight.dtype == torch.bfloat16
        and x.dtype == torch.float32
        and weight.is_contiguous()
        and x.device.type == "cpu"
        and cpu.eager()
    ):
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if x2.shape[0] > few_rows:
        y = cpu.bf16_gemm(x2, weight, bias, activation)
    else:
        y = cpu.bf16_linear(x2, weight)
        y = y if bias is None else y + bias
        if activation is not None:
            y = torch.nn.functional.gelu(y, approximate="tanh")
    return y.reshape(*x.shape[:-1], weight.shape[0])


def bf16_rows_matmul(x: torch.Tensor, weight: torch.Tensor, split: bool) -> torch.Tensor | None:
    """x (float32) @ weight.T (bfloat16) in bfloat16 products, on the AMX tiles (amx.c, up to
    cpu.AMX_ROWS rows) or AVX-512 BF16's dot products (bf16_dot.c): x rounded to bfloat16, or
    with `split` to 16 bits of each value (the logits' products at the memory's rate where
    float32 FMAs fall behind); bf16_matmul's float32 FMAs for other rows, shapes or builds."""
    x2 = x.reshape(-1, x.shape[-1])
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.bfloat16
        and weight.is_contiguous()
        and x2.shape[0] >= 1
        and cpu.eager()
    ):
        y = cpu.bf16_rows_linear(x2.contiguous(), weight, split)
        if y is not None:
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return bf16_matmul(x, weight, None, None)


def head_matmul(x, weight, bias, activation, rounded=False, *, split: bool) -> torch.Tensor | None:
    """The head's kernel on the tiles or AVX-512 BF16's dot products: bf16_rows_matmul, each
    activation split or rounded (a bias or an activation: bf16_matmul's); float32 logits,
    `rounded` or not."""
    if bias is not None or activation is not None:
        return bf16_matmul(x, weight, bias, activation)
    return bf16_rows_matmul(x, weight, split=split)


def amx_int4_matmul(
    x: torch.Tensor, weight, bias: torch.Tensor | None, vnni_rows: int = cpu.INT4_VNNI_ROWS
) -> torch.Tensor | None:
    """x @ W.T (+ bias) for an Int4Weight on the AMX build's kernels (cpu.amx_int4_gemm: the
    vector units' int8 products to `vnni_rows` rows, the tiles' above) above
    cpu.INT4_TORCH_ROWS rows; None (torch's int4 kernel) for fewer rows or shapes off them."""
    kernel = functools.partial(cpu.amx_int4_gemm, vnni_rows=vnni_rows)
    return _int4_rows(kernel, x, weight, bias, cpu.INT4_TORCH_ROWS)


def int4_vnni_matmul(
    x: torch.Tensor, weight, bias: torch.Tensor | None, torch_rows: int = cpu.INT4_TORCH_ROWS
) -> torch.Tensor | None:
    """x @ W.T (+ bias) for an Int4Weight on the vector units' int8 dot products
    (cpu.int4_int8_linear: a step's rows on int4_vnni.c, a prompt's widened to int8) above
    `torch_rows` rows; None (torch's int4 kernel) for fewer rows or shapes off them."""
    return _int4_rows(cpu.int4_int8_linear, x, weight, bias, torch_rows)


def _int4_rows(
    kernel, x: torch.Tensor, weight, bias: torch.Tensor | None, torch_rows: int
) -> torch.Tensor | None:
    """An int4 kernel of ours above `torch_rows` rows (fewer: torch's, where it measures faster
    than ours)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] <= torch_rows or x.device.type != "cpu" or not cpu.eager():
        return None
    y = kernel(x2, weight)
    if y is None:
        return None
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def widen_outputs(
    products: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    rounded: bool = False,
) -> torch.Tensor | None:
    """activation(bfloat16 products widened + bias) in float32, one pass (pointwise.c); with
    `rounded`, in bfloat16 (the products as they are where there is nothing to add or apply);
    None where our kernels do not run it (the caller's torch operations then)."""
    fits = bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    on_cpu = products.dtype == torch.bfloat16 and products.device.type == "cpu"
    if not (fits and on_cpu and cpu.eager()):
        return None
    if rounded and bias is None and activation is None:
        return products
    return cpu.widen_outputs(products.contiguous(), bias, activation, rounded)


def int8_matmul(
    x2: torch.Tensor, weight, activation: str | None = None, vnni_rows: int = cpu.INT8_VNNI_ROWS
) -> torch.Tensor | None:
    """int8_linear.c: activation(x2 (rows, in) float32 @ an Int8Weight), each row quantized with
    its own scale on the way, the activation applied as the outputs are stored (the AMX build:
    more than `vnni_rows` rows on the tiles)."""
    if not (x2.device.type == "cpu" and cpu.eager()):
        return None
    return cpu.int8_linear(x2, weight, vnni_rows, activation=activation)


def int8_wide_matmul(x2: torch.Tensor, weight) -> torch.Tensor | None:
    """The logits on int8_linear.c's 14-bit rows: x2 (rows, in) float32 @ an Int8Weight, each
    activation on int16 levels (a scale a row); (rows, padded out)."""
    if not (x2.device.type == "cpu" and cpu.eager()):
        return None
    return cpu.int8_wide_linear(x2, weight)


def int8_split_matmul(x2: torch.Tensor, weight, *, rows) -> torch.Tensor | None:
    """The logits on an int8 kernel of 7-bit rows (`rows`: int8's installed kernel): each
    activation as two rows of levels (split_rows), the products summed; (rows, padded out)."""
    return split_products(x2, lambda split: rows(split, weight, None))


def delta_step(query, key, value, g, beta, states: torch.Tensor, slots: torch.Tensor):
    """delta_rule.c's decode step, delta_rule.step's contract: the states' rows advanced in place,
    each read from memory once; None where they are not the kernel's (float32, contiguous, the
    slots int64, on the CPU)."""
    fits = _float32_on_cpu(states) and states.is_contiguous() and slots.dtype == torch.int64
    if not (fits and slots.device.type == "cpu" and cpu.eager()):
        return None
    inputs = (t.contiguous() for t in delta_rule.step_inputs(query, key, value, g, beta))
    return cpu.delta_step(*inputs, states, slots.contiguous())


def cache_attention(q, k, v, batch, k_cache: torch.Tensor, v_cache: torch.Tensor):
    """decode_layer.c's attention of a decode step (kernels/attention.cache_attention's
    contract): each row's context read once for its query heads, no copy of it; None where the
    inputs are not the kernel's (float32 rows, a float32 or bfloat16 cache, contiguous, on the
    CPU, eager: fixed shapes keep torch's)."""
    caches = k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
    on_cpu = _float32_on_cpu(q, k, v) and k_cache.device.type == "cpu"
    whole = k_cache.is_contiguous() and v_cache.is_contiguous()
    if not (caches and on_cpu and whole and not batch.fixed_shapes and cpu.eager()):
        return None
    rows = (t.to(torch.int64).contiguous() for t in (batch.slots, batch.positions))
    return cpu.decode_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, *rows
    )
