/* RMSNorm in float32 on the CPU, built by kernels/cpu.py: out[r] = w * (x[r] / sqrt(mean(x[r]^2) +
   eps)), normalised first, then scaled, as the Qwen3 reference does. One call in place of the eight
   tensor operations torch's CPU rms_norm runs: a decode step runs over a hundred norms of one row,
   each cheap next to the dispatch of those operations. */
#include "float_tiles.h"

static void norm_row(const float *x, const float *w, float *out, int64_t width, float eps) {
    vec squares = vzero();
    for (int64_t i = 0; i < width; i += GL) {
        lanes some = first_lanes(width - i < GL ? (int)(width - i) : GL);
        vec v = vload_some(x + i, some);
        squares = vfma(v, v, squares);
    }
    const vec inverse = vset(1.0f / __builtin_sqrtf(vsum(squares) / (float)width + eps));
    for (int64_t i = 0; i < width; i += GL) {
        lanes some = first_lanes(width - i < GL ? (int)(width - i) : GL);
        vec normed = vmul(vload_some(x + i, some), inverse);
        vstore_some(out + i, vmul(vload_some(w + i, some), normed), some);
    }
}

/* out (rows x width, contiguous) for x's rows (`ld` floats apart) and w (width). Threads only for
   many rows: a parallel region costs more than a few rows' work. */
void rms_norm(const float *x, int64_t ld, const float *w, float *out, int64_t rows, int64_t width,
              float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++) norm_row(x + r * ld, w, out + r * width, width, eps);
}
