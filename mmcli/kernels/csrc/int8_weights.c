/* A weight matrix to int8_linear.c's weights, as weights/int8.py's quantize_int8 makes them in
   torch: the columns multiplied by a folded norm's scale (or not), then each output channel's
   largest magnitude / 127 (at least 1e-12) its scale, and its values divided by it and rounded to
   the nearest, ties to even, in int8_linear.c's layout (groups of 16 channels, 4 inputs of each
   interleaved). The same float32 operations in the same order, so the same bits; one pass over the
   stored bfloat16 (or float32) weights, where torch's eight operations wrote and read a float32
   copy of each. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* 8 weights from index i (input k) in float32, times their columns' scales where given */
static inline __m256 load8(const void *w, int bf16, const float *column_scale, int64_t i,
                           int64_t k) {
    __m256 v;
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        v = _mm256_loadu_ps((const float *)w + i);
    }
    return column_scale ? _mm256_mul_ps(v, _mm256_loadu_ps(column_scale + k)) : v;
}

static inline float load1(const void *w, int bf16, const float *column_scale, int64_t i,
                          int64_t k) {
    float v;
    if (bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
        memcpy(&v, &bits, 4);
    } else {
        v = ((const float *)w)[i];
    }
    return column_scale ? v * column_scale[k] : v;
}

/* The largest magnitude of row `row`'s K (scaled) weights. */
static float largest(const void *w, int bf16, const float *column_scale, int64_t row, int64_t K) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 top = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        top = _mm256_max_ps(top,
                            _mm256_and_ps(load8(w, bf16, column_scale, row * K + k, k), magnitude));
    float lanes[8], most = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) most = lanes[i] > most ? lanes[i] : most;
    for (; k < K; k++) {
        float v = __builtin_fabsf(load1(w, bf16, column_scale, row * K + k, k));
        most = v > most ? v : most;
    }
    return most;
}

/* Channel c of a group (its bytes at `group` + c * 4, 4 inputs every 64 bytes): row `row`'s
   weights divided by s and rounded, zero past K; returns their sum. */
static int32_t quantize_channel(const void *w, int bf16, const float *column_scale, int64_t row,
                                int64_t K, int64_t Kp, float s, int8_t *group, int c) {
    const __m256 vs = _mm256_set1_ps(s);
    __m256i total = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(load8(w, bf16, column_scale, row * K + k, k), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i i = _mm256_cvtps_epi32(q);
        total = _mm256_add_epi32(total, i);
        __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        int64_t bytes = _mm_cvtsi128_si64(_mm_packs_epi16(words, words));
        memcpy(group + (k / 4) * 64 + c * 4, &bytes, 4);
        memcpy(group + (k / 4 + 1) * 64 + c * 4, (const char *)&bytes + 4, 4);
    }
    int32_t lanes[8], sum = 0;
    _mm256_storeu_si256((__m256i *)lanes, total);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    for (; k < Kp; k++) {
        int8_t v = 0;
        if (k < K)
            v = (int8_t)__builtin_roundevenf(load1(w, bf16, column_scale, row * K + k, k) / s);
        group[(k / 4) * 64 + c * 4 + k % 4] = v;
        sum += v;
    }
    return sum;
}

/* w: N x K, float32 or (bf16) bfloat16 bits, row-major; column_scale: K values or NULL. values:
   Np x Kp bytes (Np a multiple of 16, Kp of 4), scale and sums: Np values; the padding zero. */
void quantize_weights(const void *w, int bf16, const float *column_scale, int64_t N, int64_t K,
                      int8_t *values, float *scale, int32_t *sums, int64_t Np, int64_t Kp,
                      int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t g = 0; g < Np / 16; g++) {
        int8_t *group = values + g * 16 * Kp;
        for (int c = 0; c < 16; c++) {
            const int64_t row = g * 16 + c;
            if (row >= N) {
                for (int64_t k = 0; k < Kp; k++) group[(k / 4) * 64 + c * 4 + k % 4] = 0;
                scale[row] = 0.0f;
                sums[row] = 0;
                continue;
            }
            float s = largest(w, bf16, column_scale, row, K) / 127.0f;
            s = s < 1e-12f ? 1e-12f : s;
            scale[row] = s;
            sums[row] = quantize_channel(w, bf16, column_scale, row, K, Kp, s, group, c);
        }
    }
}
