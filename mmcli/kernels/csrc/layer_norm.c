/* LayerNorm in float32 on the CPU, built by kernels/cpu.py, as the vision tower uses it: out[r] =
   (x[r] - mean) / sqrt(variance + eps) * w + b over a row, the variance the mean of the squared
   deviations (torch's, biased), with the residual stream's add before it in the same pass. In
   place of torch's add, its two passes and the conversion each reader makes for its bfloat16
   product: on the tower's rows (outgrowing the caches) every pass is a read and a write of
   memory. */
#include "float_tiles.h"

/* One row of whole vectors: sum = x + update (float32, or bfloat16 widened exactly; NULL: x as it
   is, sum unwritten), out its norm, in bfloat16 where `rounded` (as torch rounds). The row stays
   in the core's caches across its three loops. */
static void add_layer_norm_row(const float *x, const void *update, int update_bf16, float *sum,
                               const float *w, const float *b, void *out, int rounded,
                               int64_t width, float eps) {
    vec total = vzero();
    for (int64_t i = 0; i < width; i += GL)
        total = vadd(total, add_update(x, update, update_bf16, sum, i));
    const float *row = update ? sum : x;
    const vec mean = vset(vsum(total) / (float)width);
    vec squares = vzero();
    for (int64_t i = 0; i < width; i += GL) {
        const vec d = vsub(vload(row + i), mean);
        squares = vfma(d, d, squares);
    }
    const vec inverse = vset(1.0f / __builtin_sqrtf(vsum(squares) / (float)width + eps));
    for (int64_t i = 0; i < width; i += GL) {
        const vec normed = vmul(vsub(vload(row + i), mean), inverse);
        store_as(out, i, vfma(normed, vload(w + i), vload(b + i)), rounded);
    }
}

/* sum = x + update, out = layer_norm(sum) with weight w and bias b (width each), rows x width,
   contiguous, width a multiple of the vectors' (cpu.py checks); x, sum float32, update float32 or
   bfloat16 (a product's outputs) or NULL, out bfloat16 where `rounded` (its readers' products
   round their inputs so), else float32. */
void add_layer_norm(const float *x, const void *update, int update_bf16, float *sum, const float *w,
                    const float *b, void *out, int rounded, int64_t rows, int64_t width, float eps,
                    int threads) {
    const int64_t out_row = width * (rounded ? 2 : 4), update_row = width * (update_bf16 ? 2 : 4);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * width >= PARALLEL_VALUES)
    for (int64_t r = 0; r < rows; r++)
        add_layer_norm_row(x + r * width, update ? (const char *)update + r * update_row : NULL,
                           update_bf16, sum + r * width, w, b, (char *)out + r * out_row, rounded,
                           width, eps);
}
