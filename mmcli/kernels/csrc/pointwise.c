/* A layer's element-wise steps in float32 on the CPU, built by kernels/cpu.py, each one pass over
   its tensors: the rotary (rope.apply_rotary) and SiLU(gate) * up (the MLP). PyTorch runs the
   rotary as three passes with a temporary, and the SwiGLU as two: on a prefill's or the vision
   tower's tensors, which outgrow the caches, every pass is a read and a write of memory. The
   decode step (decode_layer.c) calls the same two. */
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
