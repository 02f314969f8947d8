/* y = x @ w.T for float32 x and bfloat16 w, float32 accumulation: the few-row (decode) kernel cpu_kernel.py builds.
   Each 8-column group of up to 4 weight rows is widened once (a bfloat16 is the high half of a float32, so this is
   exact) and used by up to 3 activation rows: 12 accumulators, within AVX2's 16 registers. */
#include <immintrin.h>
#include <stdint.h>

static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
static inline float bf16_to_float(uint16_t h) { union { uint32_t u; float f; } c = { (uint32_t)h << 16 }; return c.f; }

/* y[m, n0:n0+NB] for rows m0..m0+MB: NB weight rows converted once per 8 columns, used by MB rows. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const uint16_t *w, float *y,
                                                       int64_t N, int MB, int NB) {
    __m256 acc[4][4];
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) acc[m][n] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv[4];
        for (int n = 0; n < NB; n++) wv[n] = load_bf16(w + n * K + k);
        for (int m = 0; m < MB; m++) {
            __m256 xv = _mm256_loadu_ps(x + m * K + k);
            for (int n = 0; n < NB; n++) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) {
            float s = hsum(acc[m][n]);
            for (int64_t r = k; r < K; r++) s += x[m * K + r] * bf16_to_float(w[n * K + r]);
            y[m * N + n] = s;
        }
}

#define ROWS(NB)                                                                         \
    for (int64_t m = 0; m < M; m += 3) {                                                 \
        const float *xm = x + m * K; float *ym = y + m * N + n;                          \
        switch (M - m) {                                                                 \
        case 1: tile(xm, K, w + n * K, ym, N, 1, NB); break;                             \
        case 2: tile(xm, K, w + n * K, ym, N, 2, NB); break;                             \
        default: tile(xm, K, w + n * K, ym, N, 3, NB); break;                            \
        }                                                                                \
    }

/* y (M x N, float32) = x (M x K, float32) @ w.T (N x K, bfloat16 bits), both row-major. */
void bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N / 4 * 4; n += 4) { ROWS(4) }
    for (int64_t n = N / 4 * 4; n < N; n++) { ROWS(1) }
}
