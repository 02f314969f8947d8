/* RMSNorm in float32 on the CPU, built by kernels/cpu.py: out[r] = w * (x[r] / sqrt(mean(x[r]^2) +
   eps)), normalised first, then scaled, as the Qwen3 reference does. One call in place of the eight
   tensor operations torch's CPU rms_norm runs: a decode step runs over a hundred norms of one row,
   each cheap next to the dispatch of those operations. */
#include "float_tiles.h"

/* One row: out may be x (each vector is read before it is written). */
void rms_norm_row(const float *x, const float *w, float *out, int64_t width, float eps) {
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
    for (int64_t r = 0; r < rows; r++) rms_norm_row(x + r * ld, w, out + r * width, width, eps);
}

/* rms_norm_row over a row of whole vectors, of x + update (float32, or bfloat16 widened exactly)
   written to sum, its output in bfloat16 where `rounded` (as torch rounds) */
static void add_norm_row(const float *x, const void *update, int update_bf16, float *sum,
                         const float *w, void *out, int rounded, int64_t width, float eps) {
    vec squares = vzero();
    for (int64_t i = 0; i < width; i += GL) {
        const vec v = add_update(x, update, update_bf16, sum, i);
        squares = vfma(v, v, squares);
    }
    const vec inverse = vset(1.0f / __builtin_sqrtf(vsum(squares) / (float)width + eps));
    const float *row = update ? sum : x;
    for (int64_t i = 0; i < width; i += GL)
        store_as(out, i, vmul(vload(w + i), vmul(vload(row + i), inverse)), rounded);
}

/* The residual stream's add and the next norm in one pass: sum = x + update (x, sum: rows x width
   float32, contiguous; update the same in float32 or bfloat16, or NULL: sum unwritten), out =
   rms_norm(sum), in bfloat16 where `rounded` (its readers' products round their inputs so). The
   floats of x + update, rms_norm and torch's rounding, one after another; width a multiple of
   the vectors' (cpu.py checks). */
void add_rms_norm(const float *x, const void *update, int update_bf16, float *sum, const float *w,
                  void *out, int rounded, int64_t rows, int64_t width, float eps, int threads) {
    const int64_t out_row = width * (rounded ? 2 : 4), update_row = width * (update_bf16 ? 2 : 4);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++)
        add_norm_row(x + r * width, update ? (const char *)update + r * update_row : NULL,
                     update_bf16, sum + r * width, w, (char *)out + r * out_row, rounded, width,
                     eps);
}
