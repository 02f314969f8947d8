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
#pragma omp parallel for num_threads(threads)                                                      \
    schedule(static) if (rows * heads * d >= PARALLEL_VALUES)
    for (int64_t t = 0; t < rows * heads; t++) {
        const int64_t r = t / heads, h = t % heads;
        const float *from = x + r * x_row + h * x_head;
        float *to = out + t * d;
        rotate_head(from, to, cos + r * rot, sin + r * rot, rot / 2);
        if (to != from)
            for (int64_t i = rot; i < d; i++) to[i] = from[i];
    }
}

/* Element i of a float32 tensor or, with bf16, of a bfloat16 one (as load_as and store_as) */
static inline float value_at(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void set_at(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = bf16_rounded(v);
    else
        ((float *)p)[i] = v;
}

/* rms_norm.c's norm of one row (out may be x) */
void rms_norm_row(const float *x, const float *w, float *out, int64_t width, float eps);

#define MAX_HEAD 512 /* the values of a head norm_rotary holds */

/* rotary's heads, read from float32 or (x_bf16) from a product's bfloat16 outputs widened
   exactly, each normalised first by rms_norm_row with w (d values; NULL: none): Qwen3's q/k
   norms and the rotary in one pass, the floats of the two one after the other. Strides in
   values; d <= MAX_HEAD (cpu.py checks). */
void norm_rotary(const void *x, int x_bf16, int64_t x_row, int64_t x_head, float *out, int64_t rows,
                 int64_t heads, int64_t d, const float *w, float eps, const float *cos,
                 const float *sin, int64_t rot, int threads) {
#pragma omp parallel for num_threads(threads)                                                      \
    schedule(static) if (rows * heads * d >= PARALLEL_VALUES)
    for (int64_t t = 0; t < rows * heads; t++) {
        const int64_t r = t / heads, at = r * x_row + (t % heads) * x_head;
        float head[MAX_HEAD] __attribute__((aligned(64)));
        int64_t i = 0;
        for (; i + GL <= d; i += GL) vstore(head + i, load_as(x, at + i, x_bf16));
        for (; i < d; i++) head[i] = value_at(x, at + i, x_bf16);
        if (w) rms_norm_row(head, w, head, d, eps);
        float *to = out + t * d;
        rotate_head(head, to, cos + r * rot, sin + r * rot, rot / 2);
        for (i = rot; i < d; i++) to[i] = head[i];
    }
}

/* out = silu(gate) * up over n values, as F.silu(gate) * up: gate / (1 + e^-gate) * up; with
   bf16, gate, up and out are bfloat16 */
static void swiglu(const void *gate, const void *up, void *out, int64_t n, int bf16, int threads) {
    const int64_t vectors = n / GL;
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PARALLEL_VALUES)
    for (int64_t b = 0; b < vectors; b++) {
        const vec g = load_as(gate, b * GL, bf16);
        const vec s = vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g))));
        store_as(out, b * GL, vmul(s, load_as(up, b * GL, bf16)), bf16);
    }
    for (int64_t i = vectors * GL; i < n; i++) {
        const float g = value_at(gate, i, bf16);
        set_at(out, i, g / (1.0f + __builtin_expf(-g)) * value_at(up, i, bf16), bf16);
    }
}

/* gate <- silu(gate) * up over n float32 values */
void silu_times(float *gate, const float *up, int64_t n, int threads) {
    swiglu(gate, up, gate, n, 0, threads);
}

/* out = silu(gate) * up over n values of bfloat16 GEMMs' outputs, computed in float32 and rounded
   for a next bfloat16 product, which would round its input anyway */
void silu_times_rounded(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t n,
                        int threads) {
    swiglu(gate, up, out, n, 1, threads);
}

/* y (rows x cols) = activation(products + bias): a bfloat16 GEMM's outputs widened to float32
   (exactly), the bias (NULL: none) added and the activation (enum activation) applied; with
   `rounded`, y is bfloat16, each value rounded as the next bfloat16 product would round it. */
void widen_outputs(const uint16_t *products, const float *bias, void *y, int64_t rows, int64_t cols,
                   int activation, int rounded, int threads) {
    const int64_t vectors = cols / GL;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *from = products + r * cols;
        for (int64_t b = 0; b < vectors; b++) {
            vec v = widen(from + b * GL);
            if (bias) v = vadd(v, vload(bias + b * GL));
            store_as(y, r * cols + b * GL, activation == GELU_TANH ? vgelu_tanh(v) : v, rounded);
        }
        for (int64_t c = vectors * GL; c < cols; c++) {
            const float v = bf16_to_float(from[c]) + (bias ? bias[c] : 0.0f);
            const float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
            const float a = activation == GELU_TANH ? v / (1.0f + __builtin_expf(-2.0f * u)) : v;
            set_at(y, r * cols + c, a, rounded);
        }
    }
}
