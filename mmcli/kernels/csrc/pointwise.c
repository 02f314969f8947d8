/* A layer's element-wise steps in float32 on the CPU, built by kernels/cpu.py, each one pass over
   its tensors: the rotary (rope.apply_rotary), SiLU(gate) * up (the MLP) and a bfloat16 GEMM's
   outputs widened with their bias and activation. PyTorch runs the rotary as three passes with a
   temporary, the SwiGLU as two and the widening as three: on a prefill's or the vision tower's
   tensors, which outgrow the caches, every pass is a read and a write of memory. The decode step
   (decode_layer.c) calls the first two. */
#include "float_tiles.h"

/* One head's first 2 * half values rotated into out (which may be x): x cos, then minus x2 sin on
   the first half and plus x1 sin on the second (rotate_half's split halves). */
static void rotate_head(const float *x, float *out, const float *cos, const float *sin,
                        int64_t half) {
    for (int64_t i = 0; i < half; i += GL) {
        const lanes some = first_lanes(half - i < GL ? (int)(half - i) : GL);
        const vec x1 = vload_some(x + i, some), x2 = vload_some(x + half + i, some);
        const vec first =
            vsub(vmul(x1, vload_some(cos + i, some)), vmul(x2, vload_some(sin + i, some)));
        const vec second = vadd(vmul(x2, vload_some(cos + half + i, some)),
                                vmul(x1, vload_some(sin + half + i, some)));
        vstore_some(out + i, first, some);
        vstore_some(out + half + i, second, some);
    }
}

/* out (rows x heads x d, contiguous; x itself where x is contiguous) = x (a row every x_row
   floats, a head every x_head, d contiguous) rotated by cos/sin (rows x rot, contiguous: the same
   for every head); the values past rot (partial rotary) are copied as they are. */
void rotary(const float *x, int64_t x_row, int64_t x_head, float *out, int64_t rows, int64_t heads,
            int64_t d, const float *cos, const float *sin, int64_t rot, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * heads * d >= 1 << 16)
    for (int64_t t = 0; t < rows * heads; t++) {
        const int64_t r = t / heads, h = t % heads;
        const float *from = x + r * x_row + h * x_head;
        float *to = out + t * d;
        rotate_head(from, to, cos + r * rot, sin + r * rot, rot / 2);
        if (to != from)
            for (int64_t i = rot; i < d; i++) to[i] = from[i];
    }
}

/* gate <- silu(gate) * up over n values, as F.silu(gate) * up: gate / (1 + e^-gate) * up. */
void silu_times(float *gate, const float *up, int64_t n, int threads) {
    const int64_t vectors = n / GL;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 1 << 16)
    for (int64_t b = 0; b < vectors; b++) {
        const vec g = vload(gate + b * GL);
        const vec s = vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g))));
        vstore(gate + b * GL, vmul(s, vload(up + b * GL)));
    }
    for (int64_t i = vectors * GL; i < n; i++)
        gate[i] = gate[i] / (1.0f + __builtin_expf(-gate[i])) * up[i];
}

/* y (rows x cols) = activation(products + bias): a bfloat16 GEMM's outputs widened to float32
   (exactly), the bias (NULL: none) added and the activation (enum activation) applied; with
   `rounded`, y is bfloat16, each value rounded as the next bfloat16 product would round it. */
void widen_outputs(const uint16_t *products, const float *bias, void *y, int64_t rows, int64_t cols,
                   int activation, int rounded, int threads) {
    const int64_t vectors = cols / GL;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 1 << 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *from = products + r * cols;
        float *to = (float *)y + r * cols;
        uint16_t *to_bf16 = (uint16_t *)y + r * cols;
        for (int64_t b = 0; b < vectors; b++) {
            vec v = widen(from + b * GL);
            if (bias) v = vadd(v, vload(bias + b * GL));
            if (activation == GELU_TANH) v = vgelu_tanh(v);
            if (rounded)
                store_bf16(to_bf16 + b * GL, v);
            else
                vstore(to + b * GL, v);
        }
        for (int64_t c = vectors * GL; c < cols; c++) {
            float v = bf16_to_float(from[c]) + (bias ? bias[c] : 0.0f);
            const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
            v = activation == GELU_TANH ? v / (1.0f + __builtin_expf(-2.0f * u)) : v;
            if (rounded)
                to_bf16[c] = bf16_rounded(v);
            else
                to[c] = v;
        }
    }
}

/* out = silu(gate) * up, rounded to bfloat16, over n values of a bfloat16 GEMM's outputs:
   silu_times on them widened, for a next bfloat16 product that would round its input anyway. */
void silu_times_rounded(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n,
                        int threads) {
    const int64_t vectors = n / GL;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 1 << 16)
    for (int64_t b = 0; b < vectors; b++) {
        const vec g = widen(gate + b * GL);
        const vec s = vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g))));
        store_bf16(out + b * GL, vmul(s, widen(up + b * GL)));
    }
    for (int64_t i = vectors * GL; i < n; i++) {
        const float g = bf16_to_float(gate[i]);
        out[i] = bf16_rounded(g / (1.0f + __builtin_expf(-g)) * bf16_to_float(up[i]));
    }
}
