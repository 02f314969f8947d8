/* bfloat16 products of a few rows on AVX-512 BF16's dot products, for the CPUs that have them
   and no AMX tiles (AMD Zen 4 and 5, Intel Cooper Lake): y (M x N, float32) = x (M x K, float32,
   rounded to bfloat16) @ w.T (N x K bfloat16, as loaded), float32 sums. vdpbf16ps multiplies 32
   bfloat16 pairs into 16 float32 lanes in one instruction where bf16_linear's FMAs widen each
   weight and make 16 products: 1.4-1.8x their rate at a decode step's 8 to 32 rows, where both
   are bound by their arithmetic. With `split` each activation is taken as two bfloat16 (the value
   rounded, then its remainder rounded: 16 bits of it), for the logits.

   Each output is one accumulator of 16 lanes summed over the inputs in order and then across
   its lanes by one fixed tree (vectors.h's sum16), whatever the tile it was made in: a row's
   products are the same bits whichever rows share its call. */
#include <stdlib.h>

#include "vectors.h"

#ifdef __AVX512BF16__

#define STEP 32  /* bfloat16 inputs a vector */
#define BLOCK 16 /* output channels a thread takes at a time */

/* x (M x K float32) -> `planes` planes of M rows x Kp bfloat16 (Kp: K rounded up to STEP, zeros
   after K): the values rounded to nearest even, then (split) what rounding left, rounded. */
static void round_rows(const float *x, int64_t M, int64_t K, int64_t Kp, int planes,
                       uint16_t *out) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < Kp; k += 16) {
            const __mmask16 some = k + 16 <= K ? 0xFFFF
                                   : k < K     ? (__mmask16)((1u << (K - k)) - 1)
                                               : 0;
            const __m512 v = _mm512_maskz_loadu_ps(some, x + m * K + k);
            const __m256bh high = _mm512_cvtneps_pbh(v);
            _mm256_storeu_si256((__m256i *)(out + m * Kp + k), (__m256i)high);
            if (planes < 2) continue;
            const __m512 back =
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)high), 16));
            const __m256bh low = _mm512_cvtneps_pbh(_mm512_sub_ps(v, back));
            _mm256_storeu_si256((__m256i *)(out + (M + m) * Kp + k), (__m256i)low);
        }
}

static inline __m512bh load_pairs(const uint16_t *p) {
    return (__m512bh)_mm512_loadu_si512((const void *)p);
}

/* the channels of `block`'s tiles of `rows` rows (see there) */
static inline int tile_width(int rows) { return rows == 1 ? 1 : rows < 3 ? 8 : 4; }

/* the tiles `block` makes of `rows` rows (at most 4) and its channels */
static int64_t tiles_of(int rows, int channels) {
    return channels / tile_width(rows) + channels % tile_width(rows);
}

/* the next block's rows, spread over the steps of this block's tiles (vectors.h) */
static struct ahead ahead_of(const uint16_t *w, int64_t K, int64_t M, int64_t N, int64_t n0,
                             int channels) {
    const int64_t at = n0 + BLOCK, count = at >= N ? 0 : N - at < BLOCK ? N - at : BLOCK;
    const int64_t tiles = M / 4 * tiles_of(4, channels) + (M % 4 ? tiles_of(M % 4, channels) : 0);
    const int64_t steps = tiles * (K / STEP), lines = count * K * 2 / 64;
    struct ahead a = {NULL, NULL, 0};
    /* one or two rows' tiles keep pace with memory on the hardware's prefetch alone; 3 and 4
       rows (narrower tiles) measured 4-12% faster with it, 5 to 16 (passes again) 16-25% */
    if (M < 3 || !steps || !count) return a; /* (no pointer past the weights' end is formed) */
    a.next = (const char *)(w + at * K), a.end = (const char *)(w + (at + count) * K);
    a.lines = (lines + steps - 1) / steps;
    return a;
}

/* y[m][n] for MB rows of x (Kp apart; with PLANES 2 their remainders `low` further) and NB
   weight rows (K apart), MB x NB <= 16: acc[m * NB + n]. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t Kp, int64_t low,
                                                       const uint16_t *w, int64_t K, float *y,
                                                       int64_t N, int MB, int NB, int PLANES,
                                                       struct ahead *ahead) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + STEP <= K; k += STEP) {
        fetch_ahead(ahead);
        __m512bh xv[4][2];
        for (int m = 0; m < MB; m++)
            for (int p = 0; p < PLANES; p++) xv[m][p] = load_pairs(x + p * low + m * Kp + k);
        for (int n = 0; n < NB; n++) {
            const __m512bh wv = load_pairs(w + n * K + k);
            for (int m = 0; m < MB; m++)
                for (int p = 0; p < PLANES; p++)
                    acc[m * NB + n] = _mm512_dpbf16_ps(acc[m * NB + n], xv[m][p], wv);
        }
    }
    if (k < K) { /* the last inputs: x's planes hold zeros past K */
        const __mmask32 some = (__mmask32)((1ull << (K - k)) - 1);
        for (int n = 0; n < NB; n++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(some, w + n * K + k);
            for (int m = 0; m < MB; m++)
                for (int p = 0; p < PLANES; p++)
                    acc[m * NB + n] =
                        _mm512_dpbf16_ps(acc[m * NB + n], load_pairs(x + p * low + m * Kp + k), wv);
        }
    }
    float sums[16];
    _mm512_storeu_ps(sums, sum16(acc));
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) y[m * N + n] = sums[m * NB + n];
}

/* The channels [n0, n0 + channels) of every row: tiles of 1 row x 1 channel, 2 rows x 8 or 3-4
   rows x 4 (a row of 16 channels' pointers left GCC too few registers: 66 GB/s from L2 where 8
   channels read 109), the channels left over one at a time. One row reads its weights from
   memory in order, a stream a core: 89-99% of a plain stream's rate on a 2-core Zen 4, where
   tiles of 8 channels (8 streams 4 KiB apart; 2, 4 or 16 did no better) made 75-90%. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, int64_t Kp, int64_t low,
                                                        const uint16_t *w, int64_t K, float *y,
                                                        int64_t M, int64_t N, int64_t n0,
                                                        int channels, int PLANES) {
    struct ahead ahead = ahead_of(w, K, M, N, n0, channels);
#define TILE(MB, NB)                                                                               \
    tile(x + m * Kp, Kp, low, w + (n0 + n) * K, K, y + m * N + n0 + n, N, MB, NB, PLANES, &ahead)
    for (int64_t m = 0; m < M; m += 4) {
        const int rows = M - m < 4 ? (int)(M - m) : 4, wide = tile_width(rows);
        int n = 0;
        for (; n + wide <= channels; n += wide) switch (rows) {
            case 1: TILE(1, 1); break;
            case 2: TILE(2, 8); break;
            case 3: TILE(3, 4); break;
            default: TILE(4, 4); break;
            }
        for (; n < channels; n++) switch (rows) {
            case 1: TILE(1, 1); break;
            case 2: TILE(2, 1); break;
            case 3: TILE(3, 1); break;
            default: TILE(4, 1); break;
            }
    }
#undef TILE
}

/* y (M x N) = x (M x K) @ w.T (N x K), row-major: x float32, w bfloat16 bits, y float32. 0, or 1
   where the rows' bfloat16 copy could not be allocated. */
int bf16_dot_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int split, int threads) {
    const int64_t Kp = (K + STEP - 1) / STEP * STEP;
    const int planes = split ? 2 : 1;
    uint16_t *rows = aligned_alloc(64, (size_t)(planes * M * Kp * 2 + 63) / 64 * 64);
    if (!rows) return 1;
    round_rows(x, M, K, Kp, planes, rows);
    const int64_t low = M * Kp, blocks = (N + BLOCK - 1) / BLOCK;
/* blocks of channels to whichever thread is free (a core slowed by another tenant's work
   takes fewer; eight at a time, so that the block fetched ahead is mostly the thread's next);
   each sum is the same whoever makes it */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * BLOCK;
        const int channels = N - n0 < BLOCK ? (int)(N - n0) : BLOCK;
        if (split)
            block(rows, Kp, low, w, K, y, M, N, n0, channels, 2);
        else
            block(rows, Kp, low, w, K, y, M, N, n0, channels, 1);
    }
    free(rows);
    return 0;
}

#endif
