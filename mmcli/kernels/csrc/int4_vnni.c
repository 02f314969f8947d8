/* int4 weights in torch's CPU layout (blocks of 64 output channels, each input's 64 values in 32
   bytes, the low nibbles the block's first 32; scales and zeros [K / 32][N][2] bfloat16) times a
   decode step's few rows on the vector units' int8 dot products (AVX-512 VNNI, with VBMI's byte
   permutes to spread the nibbles), where the CPU has both; else (AVX2) blocks of 32 channels, the
   layout torch packs there, on vpmaddubsw, in torch's layout or the blocks form (below; the
   loader puts them so where the plan's kernels are their only readers). For a decode step's few
   rows the weights' integers are multiplied as they are, where torch's int4 kernel and the tiles'
   panels dequantize every weight first. */
#include <stdint.h>
#include <stdlib.h>

#include "float_tiles.h"

/* Each build's (below): x's rows quantized to int8 per group of 32 inputs, and their products.
   `blocks`: the weights in the blocks form (weight_forms.Int4Weight.in_blocks): the scales and
   zeros by block ([N / block][K / 32][block][2], a block's groups one after another), and each 4
   inputs' bytes of a block as quadruples (byte c of the 4 inputs side by side); else torch's
   layout (the scales by group, [K / 32][N][2]). A build that does not read that form
   (READS_BLOCKS) refuses it. */
void int4_quantize_rows(const float *x, int64_t rows, int64_t K, int8_t *xq, float *scales,
                        int32_t *sums, int threads);
int int4_vnni_products(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                       const uint8_t *packed, const uint16_t *scales_zeros, int blocks, float *y,
                       int64_t M, int64_t N, int64_t K, int threads);

typedef int (*int4_products)(const int8_t *, const float *, const int32_t *, const uint8_t *,
                             const uint16_t *, int, float *, int64_t, int64_t, int64_t, int);

/* Group g's scales and zeros of block `block` (of `channels` channels), in the blocks form or
   torch's layout */
static inline const uint32_t *group_pairs(const uint32_t *pairs, int64_t N, int64_t groups,
                                          int64_t channels, int64_t block, int64_t g, int blocks) {
    return blocks ? pairs + (block * groups + g) * channels : pairs + g * N + block * channels;
}

/* y = x @ W.T by `products` for x (M x K, float32), its rows quantized on the way; nonzero where
   the shapes are not the kernel's or its rows' buffers could not be allocated. */
static int int4_quantized_rows(int4_products products, const float *x, const uint8_t *packed,
                               const uint16_t *scales_zeros, int blocks, float *y, int64_t M,
                               int64_t N, int64_t K, int threads) {
    if (M < 1 || N % 64 || K % 32) return 1;
    int8_t *xq = malloc((size_t)(M * K));
    float *scales = malloc((size_t)(M * (K / 32)) * sizeof(float));
    int32_t *sums = malloc((size_t)(M * (K / 32)) * sizeof(int32_t));
    int failed = !xq || !scales || !sums;
    if (!failed) {
        int4_quantize_rows(x, M, K, xq, scales, sums, threads);
        failed = products(xq, scales, sums, packed, scales_zeros, blocks, y, M, N, K, threads);
    }
    free(xq);
    free(scales);
    free(sums);
    return failed;
}

/* int8_linear.c's: its tiles of int8 weights (a block of channels widened to int8 here), and x's
   rows quantized for them, 8 bits offset by 128 */
void int8_linear_tile(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                      const float *w_scale, const float *bias, float *y, int64_t M, int64_t ldy,
                      int64_t Kp);
int amx_int8_block(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                   const float *w_scale, const float *bias, float *y, int64_t M, int64_t ldy,
                   int64_t Kp);
int amx_int8_linear(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                    const float *w_scale, const float *bias, float *y, int64_t M, int64_t Np,
                    int64_t Kp, int act, int threads);
void quantize_rows_8bit(const float *x, int64_t M, int64_t K, uint8_t *q, int64_t Kp,
                        float *x_scale, int threads);

/* The next block's bytes (blocks of `channels` channels, K * channels / 2 bytes), spread over
   the groups of this block's passes of `rows` rows (vectors.h). One pass of rows too: a decode
   step of one row 3-14% faster with it on a 2-core Zen 4, 1.2x for the kernel on a 2-core Zen 1
   (AVX2). The last block has none after it (no pointer past the weights' end is formed). */
static struct ahead ahead_of(const uint8_t *packed, int64_t K, int64_t N, int64_t channels,
                             int64_t block, int64_t M, int rows, int64_t pass) {
    const int64_t groups = K / 32, passes = (M + rows - 1) / rows, bytes = K * channels / 2;
    const int64_t steps = passes * groups, lines = (bytes / 64 + steps - 1) / steps;
    struct ahead a = {NULL, NULL, 0};
    if ((block + 1) * channels >= N) return a;
    const int64_t start = pass * groups * lines * 64; /* past the end: none */
    a.end = (const char *)(packed + (block + 1) * bytes) + bytes;
    a.next = a.end - bytes + (start < bytes ? start : bytes), a.lines = lines;
    return a;
}

/* int4_vnni_products for x (M x K, float32), its rows quantized on the way. */
int int4_vnni_rows(const float *x, const uint8_t *packed, const uint16_t *scales_zeros, int blocks,
                   float *y, int64_t M, int64_t N, int64_t K, int threads) {
    return int4_quantized_rows(int4_vnni_products, x, packed, scales_zeros, blocks, y, M, N, K,
                               threads);
}

/* In a block's first pass of rows, the next block's scales and zeros of group g by group
   (`next_pairs`: NULL in the other passes, for the last block and by block, where they follow
   this block's and the hardware's prefetcher has them): each group's are N * 4 bytes apart, a
   new page every group, where the hardware's prefetcher stops. Always inlined: GCC finds a
   function whose only effect is a prefetch const and drops a call it has not inlined first (both
   builds lost these prefetches so; int4's step at one row took 1.2x as long on an AMX Xeon). */
static inline __attribute__((always_inline)) void
fetch_pairs_ahead(const uint32_t *next_pairs, int64_t N, int64_t g, int channels) {
    if (next_pairs)
        for (int i = 0; i < channels * 4; i += 64)
            _mm_prefetch((const char *)(next_pairs + g * N) + i, _MM_HINT_T2);
}

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)

/* For a decode step's few rows the tiles' per-group stores cost more than the products: the
   vector units' int8 dot products (vpdpbusd) take the weights' integers q (0..15) as they are,
   each row quantized to int8 per group of 32 inputs (scale its largest value over 127, as
   llama.cpp's Q8 activations), and the sums stay in registers across the group:
   (q - 8) * scale + zero summed over a group is scale * sum(xq * q) + (zero - 8 scale) * sum(xq),
   times the row's group scale. */

#define VNNI_ROWS 4    /* rows a block's sums hold in registers; more rows pass again */
#define READS_BLOCKS 0 /* torch's layout only */

/* inputs k .. k + 3 of a block (4 x 32 contiguous bytes) as vpdpbusd's quadruples: lane c of
   w[t] holds channel 16 t + c's q for the 4 inputs (w[0], w[1]: the low nibbles of bytes 0..15
   and 16..31; w[2], w[3]: their high nibbles, channels 32..63) */
static inline void int4_quads(const uint8_t *first, __m512i w[4]) {
    const __m512i low = _mm512_set1_epi8(0x0F), lanes = _mm512_set1_epi32(0x60402000);
    const __m512i step = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* byte j of lane c: byte c of input j (j * 32 + c) of the 128 */
    const __m512i first_half =
        _mm512_add_epi8(lanes, _mm512_mullo_epi32(step, _mm512_set1_epi32(0x01010101)));
    const __m512i second_half = _mm512_add_epi8(first_half, _mm512_set1_epi8(16));
    const __m512i a = _mm512_loadu_si512(first), b = _mm512_loadu_si512(first + 64);
    const __m512i p0 = _mm512_permutex2var_epi8(a, first_half, b);
    const __m512i p1 = _mm512_permutex2var_epi8(a, second_half, b);
    w[0] = _mm512_and_si512(p0, low);
    w[1] = _mm512_and_si512(p1, low);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low);
    w[3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low);
}

/* x (rows x K float32) as int8 per group of 32 inputs: xq, each group's scale and sum(xq). The
   vector units' rounding (to nearest, ties to even) is lrintf's, and each group's products and
   quotient are the scalar ones: the same integers as a loop of lrintf, at a fraction of its time
   (a decode step of 32 rows spent a quarter of its time in that loop). */
void int4_quantize_rows(const float *x, int64_t rows, int64_t K, int8_t *xq, float *scales,
                        int32_t *sums, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * K >= PARALLEL_VALUES)
    for (int64_t i = 0; i < rows * (K / 32); i++) {
        const __m512 a = _mm512_loadu_ps(x + i * 32), b = _mm512_loadu_ps(x + i * 32 + 16);
        const float largest =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
        _mm_storeu_si128((__m128i *)(xq + i * 32), _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(xq + i * 32 + 16), _mm512_cvtepi32_epi8(qb));
        scales[i] = largest / 127.0f;
        sums[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* y's `rows` (a constant once inlined: the sums in registers) x the 64 channels of `block`; the
   next block's bytes fetched ahead, and in the first pass (`next_pairs` not NULL) its scales and
   zeros, a group's 256 bytes at each group */
static inline __attribute__((always_inline)) void
int4_vnni_block(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                const uint8_t *packed, const uint32_t *pairs_of, int64_t K, int64_t N,
                int64_t block, const int rows, float *y, struct ahead *ahead,
                const uint32_t *next_pairs) {
    const int64_t groups = K / 32;
    const uint8_t *bytes = packed + block * K * 32;
    __m512 acc[VNNI_ROWS][4];
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < 4; t++) acc[m][t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        fetch_ahead(ahead);
        fetch_pairs_ahead(next_pairs, N, g, 64);
        __m512i sums[VNNI_ROWS][4];
        for (int m = 0; m < rows; m++)
            for (int t = 0; t < 4; t++) sums[m][t] = _mm512_setzero_si512();
        for (int r = 0; r < 8; r++) {
            __m512i w[4];
            int4_quads(bytes + (g * 32 + 4 * r) * 32, w);
            for (int m = 0; m < rows; m++) {
                const int32_t four = ((const int32_t *)xq)[m * (K / 4) + g * 8 + r];
                const __m512i x4 = _mm512_set1_epi32(four);
                for (int t = 0; t < 4; t++) sums[m][t] = _mm512_dpbusd_epi32(sums[m][t], w[t], x4);
            }
        }
        const uint32_t *pairs = pairs_of + g * N + block * 64;
        for (int t = 0; t < 4; t++) {
            __m512 scale, zero;
            scale_zero(pairs + t * 16, &scale, &zero);
            const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
            for (int m = 0; m < rows; m++) {
                const int64_t at = m * groups + g;
                __m512 v = _mm512_mul_ps(shift, _mm512_set1_ps((float)x_sums[at]));
                v = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(sums[m][t]), v);
                acc[m][t] = _mm512_fmadd_ps(_mm512_set1_ps(x_scales[at]), v, acc[m][t]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(y + m * N + block * 64 + t * 16, acc[m][t]);
}

/* rows m .. m + VNNI_ROWS (at most M) of `block`: each row count its own loop, the sums held in
   registers */
static void rows_of_block(const int8_t *xq, const float *scales, const int32_t *sums,
                          const uint8_t *packed, const uint32_t *pairs, int64_t K, int64_t N,
                          int64_t block, int64_t m, int64_t M, float *y) {
    const int64_t groups = K / 32;
    struct ahead ahead = ahead_of(packed, K, N, 64, block, M, VNNI_ROWS, m / VNNI_ROWS);
    const uint32_t *next_pairs = ahead.lines && m == 0 ? pairs + (block + 1) * 64 : NULL;
    xq += m * K, scales += m * groups, sums += m * groups, y += m * N;
#define ROWS(R)                                                                                    \
    int4_vnni_block(xq, scales, sums, packed, pairs, K, N, block, R, y, &ahead, next_pairs)
    switch (M - m) {
    case 1: ROWS(1); break;
    case 2: ROWS(2); break;
    case 3: ROWS(3); break;
    default: ROWS(4); break;
    }
#undef ROWS
}

/* y (M x N, float32) = x @ W.T for int4 W in torch's CPU layout (group 32) and x's rows as
   int4_quantize_rows made them, VNNI_ROWS rows at a time over each block of 64 channels (its
   weights, 32 bytes an input, read again from the cache); nonzero (nothing computed) where N is
   not a multiple of 64 or K of 32, or the weights are in the blocks form. */
int int4_vnni_products(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                       const uint8_t *packed, const uint16_t *scales_zeros, int blocks, float *y,
                       int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || N % 64 || K % 32 || blocks) return 1;
    const uint32_t *pairs = (const uint32_t *)scales_zeros;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < N / 64; block++) {
        for (int64_t m = 0; m < M; m += VNNI_ROWS)
            rows_of_block(xq, x_scales, x_sums, packed, pairs, K, N, block, m, M, y);
    }
    return 0;
}

#ifdef __AMX_INT8__
#include "amx_tiles.h"

/* ---- int4_tile_rows: a decode step's rows on the tiles' int8 products (the AMX build) ----

   Past a few rows the dot products above cost more than the weights' bytes take to arrive. The
   tiles take the same integers: a group's 32 inputs are one product (tdpbssd) of a row tile (xq,
   up to 16 rows x 32 bytes) and a channel tile (8 quadruples of int4_quads' lanes as they are: 16
   channels x 4 inputs), its int32 sums stored and scaled as int4_vnni_block scales them, in the
   same order: the same floats. A block's quadruples are made once, for every row. */

#define TILE_GROUPS 3  /* groups a block's quadruples are made for at a time: 6 KiB, in L1 */
#define TILE_QUADS 512 /* bytes of a channel tile of one group */

/* tmm0-2 three groups' sums (`rows` rows), tmm3-5 their rows of x (32 inputs), tmm6, 7 channel
   tiles */
static void configure_int4_tiles(int rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 6 ? (uint8_t)rows : 8;
        c.colsb[t] = t >= 3 && t < 6 ? 32 : 64;
    }
    _tile_loadconfig(&c);
}

/* Groups g0 .. g0 + groups of a block as channel tiles: quads[(g * 4 + t) * TILE_QUADS] */
static void int4_block_quads(const uint8_t *bytes, int64_t g0, int groups, int8_t *quads) {
    for (int g = 0; g < groups; g++)
        for (int r = 0; r < 8; r++) {
            __m512i w[4];
            int4_quads(bytes + ((g0 + g) * 32 + 4 * r) * 32, w);
            for (int t = 0; t < 4; t++)
                _mm512_store_si512(quads + (g * 4 + t) * TILE_QUADS + r * 64, w[t]);
        }
}

/* acc[m] += group g's sums (int32, 16 a row) scaled, for `rows` rows (a constant once inlined) */
static inline __attribute__((always_inline)) void
scale_group_sums(const int32_t *sums, const uint32_t *pairs, const float *x_scales,
                 const float *x_sums, int64_t groups, int64_t g, const int rows, __m512 *acc) {
    __m512 scale, zero;
    scale_zero(pairs, &scale, &zero);
    const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
    for (int m = 0; m < rows; m++) {
        const int64_t at = m * groups + g;
        __m512 v = _mm512_mul_ps(shift, _mm512_set1_ps(x_sums[at]));
        v = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(_mm512_load_si512(sums + m * 16)), v);
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x_scales[at]), v, acc[m]);
    }
}

/* Group g0 + C's product for channel tile t into sums tile C (tmm0-2), from its rows tile A
   (loaded once for the four channel tiles) and channel tile B */
#define GROUP_PRODUCT(C, A, B, t)                                                                  \
    do {                                                                                           \
        _tile_zero(C);                                                                             \
        _tile_loadd(B, quads + (C * 4 + (t)) * TILE_QUADS, 64);                                    \
        _tile_dpbssd(C, A, B);                                                                     \
    } while (0)

/* Sums tile C stored, and group C's product for channel tile t + 1 begun in it (t < 3) */
#define STORE_AND_NEXT(C, A, B, t)                                                                 \
    do {                                                                                           \
        _tile_stored(C, sums[(t) & 1][C], 64);                                                     \
        if ((t) < 3) GROUP_PRODUCT(C, A, B, (t) + 1);                                              \
    } while (0)

/* OP(C, A, B, t) for each of the `count` groups (<= 3): its sums tile, rows tile and a channel
   tile */
#define EACH_GROUP(OP, t)                                                                          \
    do {                                                                                           \
        OP(0, 3, 6, t);                                                                            \
        if (count > 1) OP(1, 4, 7, t);                                                             \
        if (count > 2) OP(2, 5, 6, t);                                                             \
    } while (0)

/* y's `rows` rows (<= 16, a constant once inlined) x a block's 4 channel tiles over groups g0 ..
   g0 + count (<= 3, their quadruples made); y holds the sums of the groups before g0 unless g0
   is 0. The tiles do not wait on the scaling: each sums tile, once stored, takes the next
   channel tile's product while the vector units scale this one's. */
static inline __attribute__((always_inline)) void
int4_tile_block(const int8_t *xq, const float *x_scales, const float *x_sums, const int8_t *quads,
                const uint32_t *pairs, int64_t K, int64_t N, int64_t g0, int count, const int rows,
                float *y, struct ahead *ahead) {
    const int64_t groups = K / 32;
    int32_t sums[2][TILE_GROUPS][16 * 16] __attribute__((aligned(64)));
    _tile_loadd(3, xq + g0 * 32, K);
    if (count > 1) _tile_loadd(4, xq + (g0 + 1) * 32, K);
    if (count > 2) _tile_loadd(5, xq + (g0 + 2) * 32, K);
    EACH_GROUP(GROUP_PRODUCT, 0); /* then each channel tile's as the last one's are stored */
    for (int t = 0; t < 4; t++) {
        EACH_GROUP(STORE_AND_NEXT, t);
        __m512 acc[16];
        for (int m = 0; m < rows; m++)
            acc[m] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(y + m * N + t * 16);
        for (int j = 0; j < count; j++) {
            /* a few lines a group: a dozen at once, a call a channel tile, stalled the loop on
               its own prefetches (a third of its samples under perf at 8 rows) */
            fetch_ahead(ahead);
            scale_group_sums(sums[t & 1][j], pairs + (g0 + j) * N + t * 16, x_scales, x_sums,
                             groups, g0 + j, rows, acc);
        }
        for (int m = 0; m < rows; m++) _mm512_storeu_ps(y + m * N + t * 16, acc[m]);
    }
}
#undef EACH_GROUP
#undef STORE_AND_NEXT
#undef GROUP_PRODUCT

/* Rows m .. m + rows (<= 16) of a block over groups g0 .. g0 + count: each row count its own
   loop, a channel tile's float sums held in registers */
static void int4_tile_rows_of(const int8_t *xq, const float *x_scales, const float *x_sums,
                              const int8_t *quads, const uint32_t *pairs, int64_t K, int64_t N,
                              int64_t g0, int count, int rows, float *y, struct ahead *ahead) {
#define ROWS(R) int4_tile_block(xq, x_scales, x_sums, quads, pairs, K, N, g0, count, R, y, ahead)
    switch (rows) {
    case 1: ROWS(1); break;
    case 2: ROWS(2); break;
    case 3: ROWS(3); break;
    case 4: ROWS(4); break;
    case 5: ROWS(5); break;
    case 6: ROWS(6); break;
    case 7: ROWS(7); break;
    case 8: ROWS(8); break;
    case 9: ROWS(9); break;
    case 10: ROWS(10); break;
    case 11: ROWS(11); break;
    case 12: ROWS(12); break;
    case 13: ROWS(13); break;
    case 14: ROWS(14); break;
    case 15: ROWS(15); break;
    default: ROWS(16); break;
    }
#undef ROWS
}

/* The next block's bytes, spread over this block's calls of scale_group_sums (its chunks of
   groups and rows, 4 channel tiles, each group: vectors.h) */
static struct ahead tile_ahead(const uint8_t *packed, int64_t K, int64_t N, int64_t block,
                               int64_t M) {
    const int64_t chunks = (K / 32 + TILE_GROUPS - 1) / TILE_GROUPS;
    const int64_t bytes = K * 32, steps = chunks * 4 * TILE_GROUPS * ((M + 15) / 16);
    struct ahead a = {NULL, NULL, 0};
    if ((block + 1) * 64 >= N) return a; /* the last block: none after it */
    a.next = (const char *)(packed + (block + 1) * bytes), a.end = a.next + bytes;
    a.lines = (bytes / 64 + steps - 1) / steps;
    return a;
}

/* Groups g0 .. g0 + TILE_GROUPS's scales and zeros of a block (a group's 256 bytes, N * 4 apart);
   always inlined, as fetch_pairs_ahead */
static inline __attribute__((always_inline)) void fetch_pairs(const uint32_t *pairs, int64_t N,
                                                              int64_t g0, int64_t groups) {
    for (int64_t g = g0; g < g0 + TILE_GROUPS && g < groups; g++)
        for (int i = 0; i < 4; i++)
            _mm_prefetch((const char *)(pairs + g * N) + 64 * i, _MM_HINT_T0);
}

/* int4_vnni_products' y on the tiles: each block's quadruples made TILE_GROUPS groups at a time
   and multiplied by every 16 rows of x; nonzero (nothing computed) where the shapes are not the
   kernel's (the blocks form too) or the tiles are not granted. */
int int4_tile_products(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                       const uint8_t *packed, const uint16_t *scales_zeros, int blocks, float *y,
                       int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || N % 64 || K % 32 || blocks || amx_request()) return 1;
    const uint32_t *pairs = (const uint32_t *)scales_zeros;
    const int64_t groups = K / 32;
    /* the sums as floats once (each is scaled for every channel tile) */
    float *sums = malloc((size_t)(M * groups) * sizeof(float));
    if (!sums) return 1;
    for (int64_t i = 0; i < M * groups; i++) sums[i] = (float)x_sums[i];
#pragma omp parallel num_threads(threads)
    {
        int8_t quads[TILE_GROUPS * 4 * TILE_QUADS] __attribute__((aligned(64)));
        int configured = 0;
#pragma omp for schedule(static)
        for (int64_t block = 0; block < N / 64; block++) {
            const uint8_t *bytes = packed + block * K * 32;
            struct ahead ahead = tile_ahead(packed, K, N, block, M);
            /* the next block's scales and zeros, the groups of each chunk (none after the last) */
            const uint32_t *next_pairs = (block + 1) * 64 < N ? pairs + (block + 1) * 64 : NULL;
            for (int64_t g0 = 0; g0 < groups; g0 += TILE_GROUPS) {
                const int count = groups - g0 < TILE_GROUPS ? (int)(groups - g0) : TILE_GROUPS;
                int4_block_quads(bytes, g0, count, quads);
                fetch_pairs(pairs + block * 64, N, g0 + TILE_GROUPS, groups);
                for (int64_t g = g0; g < g0 + count; g++) fetch_pairs_ahead(next_pairs, N, g, 64);
                for (int64_t m = 0; m < M; m += 16) {
                    const int rows = M - m < 16 ? (int)(M - m) : 16;
                    if (rows != configured) configure_int4_tiles(configured = rows);
                    int4_tile_rows_of(xq + m * K, x_scales + m * groups, sums + m * groups, quads,
                                      pairs + block * 64, K, N, g0, count, rows,
                                      y + m * N + block * 64, &ahead);
                }
            }
        }
        if (configured) _tile_release();
    }
    free(sums);
    return 0;
}

/* The same for x (M x K, float32), its rows quantized on the way (int4_quantize_rows). */
int int4_tile_rows(const float *x, const uint8_t *packed, const uint16_t *scales_zeros, int blocks,
                   float *y, int64_t M, int64_t N, int64_t K, int threads) {
    return int4_quantized_rows(int4_tile_products, x, packed, scales_zeros, blocks, y, M, N, K,
                               threads);
}
#endif

/* A prompt's many rows (more than a decode step's) on int8_linear.c's tiles (the AMX build: the
   tiles' tdpbusd), at the int8 rate (int4_widened_rows, below both builds): each block of 64
   channels widened to int8 once, in a buffer every row reads, and the rows quantized to 8 bits
   with a scale a row. The per-group scaling above costs as much as the products at any row
   count; a block widened once costs a few rows' products. */

#define WIDE_BLOCK 64     /* channels a widened block holds: torch's block here */
#define WEIGHT_TOP 127.0f /* a widened weight's largest level */

/* A widened block's products: on the AMX tiles where the build has them and the shapes fit
   (amx.c: the same integers), else the vector units' dot products */
static int widened_products(const uint8_t *x, const float *x_scale, const int8_t *w,
                            const int32_t *w_sum, const float *w_scale, const float *bias, float *y,
                            int64_t M, int64_t ldy, int64_t Kp) {
#ifdef __AMX_INT8__
    if (!amx_int8_block(x, x_scale, w, w_sum, w_scale, bias, y, M, ldy, Kp)) return 0;
#endif
    int8_linear_tile(x, x_scale, w, w_sum, w_scale, bias, y, M, ldy, Kp);
    return 0;
}

/* Byte `j` of each lane (lane c: channel c's q for 4 inputs) as its int8 level, q * a + b
   rounded (ties to even), in byte `j` of the result; the levels added to *sum */
static inline __m512i widen_byte(__m512i q4, int j, __m512 a, __m512 b, __m512i *sum) {
    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(q4, 8 * j), _mm512_set1_epi32(0xFF));
    const __m512i level = _mm512_cvtps_epi32(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q), a, b));
    *sum = _mm512_add_epi32(*sum, level);
    return _mm512_slli_epi32(_mm512_and_si512(level, _mm512_set1_epi32(0xFF)), 8 * j);
}

/* Block `block`'s 64 channels in int8_linear.c's layout (w: 4 groups of 16 channels, K * 16
   bytes each): each channel's values (q - 8) * scale + zero over its scale, the largest
   magnitude its groups' values reach (q at 0 or 15) / WEIGHT_TOP, rounded; w_sum, w_scale its
   sums and scales. */
static void widen_block(const uint8_t *packed, const uint32_t *pairs, int blocks, int64_t K,
                        int64_t N, int64_t block, int8_t *w, int32_t *w_sum, float *w_scale) {
    const int64_t groups = K / 32;
    __m512 top[4], inverse[4];
    __m512i sum[4];
    for (int t = 0; t < 4; t++) {
        top[t] = _mm512_set1_ps(1e-12f * WEIGHT_TOP); /* a channel of zeros: level 1e-12 */
        sum[t] = _mm512_setzero_si512();
    }
    for (int64_t g = 0; g < groups; g++)
        for (int t = 0; t < 4; t++) {
            __m512 scale, zero;
            scale_zero(group_pairs(pairs, N, groups, 64, block, g, blocks) + t * 16, &scale, &zero);
            const __m512 lowest = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
            const __m512 highest = _mm512_fmadd_ps(_mm512_set1_ps(7.0f), scale, zero);
            const __m512 reach = _mm512_max_ps(_mm512_abs_ps(lowest), _mm512_abs_ps(highest));
            top[t] = _mm512_max_ps(top[t], reach);
        }
    for (int t = 0; t < 4; t++) {
        _mm512_storeu_ps(w_scale + t * 16, _mm512_div_ps(top[t], _mm512_set1_ps(WEIGHT_TOP)));
        inverse[t] = _mm512_div_ps(_mm512_set1_ps(WEIGHT_TOP), top[t]);
    }
    const uint8_t *bytes = packed + block * K * 32;
    for (int64_t g = 0; g < groups; g++) {
        __m512 a[4], b[4];
        for (int t = 0; t < 4; t++) {
            __m512 scale, zero;
            scale_zero(group_pairs(pairs, N, groups, 64, block, g, blocks) + t * 16, &scale, &zero);
            a[t] = _mm512_mul_ps(scale, inverse[t]);
            b[t] = _mm512_mul_ps(_mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero), inverse[t]);
        }
        for (int r = 0; r < 8; r++) {
            const int64_t k = g * 32 + 4 * r;
            __m512i q[4];
            int4_quads(bytes + k * 32, q);
            for (int t = 0; t < 4; t++) {
                __m512i levels = widen_byte(q[t], 0, a[t], b[t], &sum[t]);
                for (int j = 1; j < 4; j++)
                    levels = _mm512_or_si512(levels, widen_byte(q[t], j, a[t], b[t], &sum[t]));
                _mm512_storeu_si512(w + t * K * 16 + k * 16, levels);
            }
        }
    }
    for (int t = 0; t < 4; t++) _mm512_storeu_si512(w_sum + t * 16, sum[t]);
}

#else /* AVX2: torch packs blocks of 32 channels there */

/* The same products on AVX2's byte multiplies, for torch's AVX2 layout (blocks of 32 channels:
   kernels/cpu.py uses them where torch packs so): vpmaddubsw's pairs (q at most 15, |xq| at most
   127: 3,810) added in int16 over a group (16 inputs a lane, at most 30,480: none saturates),
   then to int32 by vpmaddwd, the exact sums vpdpbusd makes, scaled in the same order: the same
   floats as the AVX-512 build's. A block's sums for two rows fill AVX2's 16 registers. */

#define AVX2_ROWS 2 /* rows a half block's sums hold in registers; more rows pass again */
/* torch's layout or the blocks form (put so at load where the plan's kernels are the weights'
   only readers). In torch's, each group's scales and zeros are N * 4 bytes from the last, a new
   page every group: a decode step's row read its weights at 1.4x a stream's time however far
   ahead they were fetched, and at 1.15x by block (a 2-core Zen 1). And its nibbles take 10
   shuffles every 4 inputs to reach vpmaddubsw's quadruples, which the blocks form holds as they
   are: the products 1.3-1.4x as fast at 8 rows, 1.2-2.0x at 32 (a 2-core Zen 3). */
#define READS_BLOCKS 1

/* x's rows as int4_quantize_rows above makes them: the same integers, scales and sums */
void int4_quantize_rows(const float *x, int64_t rows, int64_t K, int8_t *xq, float *scales,
                        int32_t *sums, int threads) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * K >= PARALLEL_VALUES)
    for (int64_t i = 0; i < rows * (K / 32); i++) {
        __m256 v[4], top = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + i * 32 + 8 * j);
            top = _mm256_max_ps(top, _mm256_and_ps(v[j], magnitude));
        }
        __m128 half = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        half = _mm_max_ps(half, _mm_movehl_ps(half, half));
        const float largest = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
        const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
        __m256i q[4], total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
            total = _mm256_add_epi32(total, q[j]);
        }
        /* packs interleave the 128-bit lanes: 32-bit groups 0, 2, 4, 6 then 1, 3, 5, 7 */
        const __m256i bytes =
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + i * 32), _mm256_permutevar8x32_epi32(bytes, order));
        __m128i sum =
            _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
        sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1));
        scales[i] = largest / 127.0f;
        sums[i] = _mm_cvtsi128_si32(sum);
    }
}

/* Inputs k .. k + 3 of a block of 32 channels (torch's AVX2 layout: 4 x 16 bytes, byte c
   holding channel c's q in its low nibble and c + 16's in its high) as vpmaddubsw's
   quadruples: w[t] channels 8 t .. 8 t + 7's 4 inputs, a byte each (0 .. 15) */
static inline void avx2_nibbles(const uint8_t *first, __m256i w[4]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m128i a = _mm_loadu_si128((const __m128i *)first);
    const __m128i b = _mm_loadu_si128((const __m128i *)(first + 16));
    const __m128i c = _mm_loadu_si128((const __m128i *)(first + 32));
    const __m128i d = _mm_loadu_si128((const __m128i *)(first + 48));
    const __m128i ab0 = _mm_unpacklo_epi8(a, b), ab1 = _mm_unpackhi_epi8(a, b);
    const __m128i cd0 = _mm_unpacklo_epi8(c, d), cd1 = _mm_unpackhi_epi8(c, d);
    /* channels 0 .. 7 and 8 .. 15 in the low nibbles, 16 .. 31 in the high */
    const __m256i q0 = _mm256_set_m128i(_mm_unpackhi_epi16(ab0, cd0), _mm_unpacklo_epi16(ab0, cd0));
    const __m256i q1 = _mm256_set_m128i(_mm_unpackhi_epi16(ab1, cd1), _mm_unpacklo_epi16(ab1, cd1));
    w[0] = _mm256_and_si256(q0, nibble), w[1] = _mm256_and_si256(q1, nibble);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(q0, 4), nibble);
    w[3] = _mm256_and_si256(_mm256_srli_epi16(q1, 4), nibble);
}

/* The same from the blocks form, whose bytes are avx2_nibbles' quadruples (before the nibbles
   are parted) */
static inline void avx2_quads(const uint8_t *first, __m256i w[4]) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)first);
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(first + 32));
    w[0] = _mm256_and_si256(q0, nibble), w[1] = _mm256_and_si256(q1, nibble);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(q0, 4), nibble);
    w[3] = _mm256_and_si256(_mm256_srli_epi16(q1, 4), nibble);
}

/* Inputs k .. k + 3 of a block as vpmaddubsw's quadruples, from either form */
static inline void avx2_weights(const uint8_t *first, int blocks, __m256i w[4]) {
    if (blocks)
        avx2_quads(first, w);
    else
        avx2_nibbles(first, w);
}

/* int4's scale and zero of 8 channels from their bfloat16 pairs (scale the lower half) */
static inline void avx2_scale_zero(const uint32_t *pairs, __m256 *scale, __m256 *zero) {
    const __m256i sz = _mm256_loadu_si256((const __m256i *)pairs);
    *scale = _mm256_castsi256_ps(_mm256_slli_epi32(sz, 16));
    *zero = _mm256_castsi256_ps(_mm256_and_si256(sz, _mm256_set1_epi32(~0xFFFF)));
}

/* y's `rows` (a constant once inlined) x the 32 channels of `block`, each channel's float sum
   as int4_vnni_block's; the next block fetched ahead as there */
static inline __attribute__((always_inline)) void
int4_avx2_block(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                const uint8_t *packed, const uint32_t *pairs_of, int blocks, int64_t K, int64_t N,
                int64_t block, const int rows, float *y, struct ahead *ahead,
                const uint32_t *next_pairs) {
    const int64_t groups = K / 32;
    const uint8_t *bytes = packed + block * K * 16;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[AVX2_ROWS][4];
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        fetch_ahead(ahead);
        fetch_pairs_ahead(next_pairs, N, g, 32);
        __m256i sums[AVX2_ROWS][4];
        for (int m = 0; m < rows; m++)
            for (int j = 0; j < 4; j++) sums[m][j] = _mm256_setzero_si256();
        for (int r = 0; r < 8; r++) {
            __m256i w[4];
            avx2_weights(bytes + (g * 32 + 4 * r) * 16, blocks, w);
            for (int m = 0; m < rows; m++) {
                const int32_t four = ((const int32_t *)xq)[m * (K / 4) + g * 8 + r];
                const __m256i x4 = _mm256_set1_epi32(four);
                for (int j = 0; j < 4; j++)
                    sums[m][j] = _mm256_add_epi16(sums[m][j], _mm256_maddubs_epi16(w[j], x4));
                /* keeps GCC from moving the sums through the stack at every step: 2 rows then
                   took twice 1 row's time, where they take 1.6x (a 2-core Zen 1) */
                __asm__(""
                        : "+x"(sums[m][0]), "+x"(sums[m][1]), "+x"(sums[m][2]), "+x"(sums[m][3]));
            }
        }
        const uint32_t *pairs = group_pairs(pairs_of, N, groups, 32, block, g, blocks);
        for (int j = 0; j < 4; j++) {
            __m256 scale, zero;
            avx2_scale_zero(pairs + 8 * j, &scale, &zero);
            const __m256 shift = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
            for (int m = 0; m < rows; m++) {
                const int64_t at = m * groups + g;
                __m256 v = _mm256_mul_ps(shift, _mm256_set1_ps((float)x_sums[at]));
                const __m256i exact = _mm256_madd_epi16(sums[m][j], ones);
                v = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(exact), v);
                acc[m][j] = _mm256_fmadd_ps(_mm256_set1_ps(x_scales[at]), v, acc[m][j]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + m * N + block * 32 + 8 * j, acc[m][j]);
}

/* int4_vnni_products (above) on AVX2: AVX2_ROWS rows at a time over each block, in either
   form */
int int4_vnni_products(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                       const uint8_t *packed, const uint16_t *scales_zeros, int blocks, float *y,
                       int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || N % 32 || K % 32) return 1;
    const uint32_t *pairs = (const uint32_t *)scales_zeros;
    const int64_t groups = K / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < N / 32; block++)
        for (int64_t m = 0; m < M; m += AVX2_ROWS) {
            const int8_t *rows_xq = xq + m * K;
            const float *scales = x_scales + m * groups;
            const int32_t *sums = x_sums + m * groups;
            struct ahead ahead = ahead_of(packed, K, N, 32, block, M, AVX2_ROWS, m / AVX2_ROWS);
            const int first = ahead.lines && m == 0 && !blocks;
            const uint32_t *next = first ? pairs + (block + 1) * 32 : NULL;
#define ROWS(B, R)                                                                                 \
    int4_avx2_block(rows_xq, scales, sums, packed, pairs, B, K, N, block, R, y + m * N, &ahead,    \
                    next)
            /* each a constant in its own copy: a test of blocks a group cost the groups' copy
               15% at one row */
            if (blocks)
                M - m == 1 ? ROWS(1, 1) : ROWS(1, 2);
            else
                M - m == 1 ? ROWS(0, 1) : ROWS(0, 2);
#undef ROWS
        }
    return 0;
}

/* ---- A prompt's many rows, widened to int8 for int8_linear.c's tiles (AVX2) ----

   As the AVX-512 build widens its blocks (above), for torch's AVX2 blocks of 32 channels: each
   widened once into int8_linear.c's layout, to 7-bit levels (at most 63), and x's rows to 8 bits
   (offset by 128): a pair of vpmaddubsw's products is then at most 2 * 255 * 63, within int16.
   (8-bit weights with int8_linear.c's own 7-bit rows keep that bound too, at more error: 6.0%
   against 5.2% of the tiny dense model's prompt logits, and 3.4% with VBMI's 8 and 8 bits.)
   int4's prompt on AVX2 then runs at the int8 rate where its dequantized tiles ran at
   float32's. */

#define WIDE_BLOCK 32    /* channels a widened block holds: torch's block here */
#define WEIGHT_TOP 63.0f /* a widened weight's largest level */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define INT8_TILE 64 /* int8_linear.c's tiles in this build: wider than a block (refused) */
#else
#define INT8_TILE 16
#endif

/* Byte `j` of each lane (lane c: channel c's q for 4 inputs) as its int8 level, q * a + b
   rounded (ties to even), in byte `j` of the result; the levels added to *sum */
static inline __m256i widen_byte(__m256i q4, int j, __m256 a, __m256 b, __m256i *sum) {
    const __m256i q = _mm256_and_si256(_mm256_srli_epi32(q4, 8 * j), _mm256_set1_epi32(0xFF));
    const __m256i level = _mm256_cvtps_epi32(_mm256_fmadd_ps(_mm256_cvtepi32_ps(q), a, b));
    *sum = _mm256_add_epi32(*sum, level);
    return _mm256_slli_epi32(_mm256_and_si256(level, _mm256_set1_epi32(0xFF)), 8 * j);
}

/* Block `block`'s 32 channels in int8_linear.c's layout (w: 2 groups of 16 channels, K * 16
   bytes each), as the AVX-512 build's widen_block makes its 64, to WEIGHT_TOP's levels. Vector t
   of avx2_nibbles holds channels 8 t .. 8 t + 7. */
static void widen_block(const uint8_t *packed, const uint32_t *pairs, int blocks, int64_t K,
                        int64_t N, int64_t block, int8_t *w, int32_t *w_sum, float *w_scale) {
    const int64_t groups = K / 32;
    __m256 top[4], inverse[4];
    __m256i sum[4];
    for (int t = 0; t < 4; t++) {
        top[t] = _mm256_set1_ps(1e-12f * WEIGHT_TOP); /* a channel of zeros: level 1e-12 */
        sum[t] = _mm256_setzero_si256();
    }
    for (int64_t g = 0; g < groups; g++)
        for (int t = 0; t < 4; t++) {
            __m256 scale, zero;
            avx2_scale_zero(group_pairs(pairs, N, groups, 32, block, g, blocks) + 8 * t, &scale,
                            &zero);
            const __m256 lowest = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);
            const __m256 highest = _mm256_fmadd_ps(_mm256_set1_ps(7.0f), scale, zero);
            const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
            const __m256 reach =
                _mm256_max_ps(_mm256_and_ps(lowest, magnitude), _mm256_and_ps(highest, magnitude));
            top[t] = _mm256_max_ps(top[t], reach);
        }
    for (int t = 0; t < 4; t++) {
        _mm256_storeu_ps(w_scale + t * 8, _mm256_div_ps(top[t], _mm256_set1_ps(WEIGHT_TOP)));
        inverse[t] = _mm256_div_ps(_mm256_set1_ps(WEIGHT_TOP), top[t]);
    }
    const uint8_t *bytes = packed + block * K * 16;
    for (int64_t g = 0; g < groups; g++) {
        __m256 a[4], b[4];
        for (int t = 0; t < 4; t++) {
            __m256 scale, zero;
            avx2_scale_zero(group_pairs(pairs, N, groups, 32, block, g, blocks) + 8 * t, &scale,
                            &zero);
            a[t] = _mm256_mul_ps(scale, inverse[t]);
            b[t] = _mm256_mul_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero), inverse[t]);
        }
        for (int r = 0; r < 8; r++) {
            const int64_t k = g * 32 + 4 * r;
            __m256i q[4];
            avx2_weights(bytes + k * 16, blocks, q);
            for (int t = 0; t < 4; t++) {
                __m256i levels = widen_byte(q[t], 0, a[t], b[t], &sum[t]);
                for (int j = 1; j < 4; j++)
                    levels = _mm256_or_si256(levels, widen_byte(q[t], j, a[t], b[t], &sum[t]));
                /* channels 8 t ..: group t / 2, the second half of its 16 for odd t */
                _mm256_storeu_si256((__m256i *)(w + (t / 2) * K * 16 + k * 16 + (t % 2) * 32),
                                    levels);
            }
        }
    }
    for (int t = 0; t < 4; t++) _mm256_storeu_si256((__m256i *)(w_sum + t * 8), sum[t]);
}

/* A widened block's products, a tile of int8_linear.c's 16 channels at a time; nonzero (nothing
   computed) where its tiles are wider than a block (an AVX-512 build without VBMI) */
static int widened_products(const uint8_t *x, const float *x_scale, const int8_t *w,
                            const int32_t *w_sum, const float *w_scale, const float *bias, float *y,
                            int64_t M, int64_t ldy, int64_t Kp) {
    if (WIDE_BLOCK % INT8_TILE) return 1;
    for (int c = 0; c < WIDE_BLOCK; c += INT8_TILE)
        int8_linear_tile(x, x_scale, w + c * Kp, w_sum + c, w_scale + c, bias + c, y + c, M, ldy,
                         Kp);
    return 0;
}

#endif

/* widen_block for int8_linear.c's tiles: its sums twice over (see int4_widened_rows) */
static void widen_for_tiles(const uint8_t *packed, const uint32_t *pairs, int blocks, int64_t K,
                            int64_t N, int64_t block, int8_t *w, int32_t *w_sum, float *w_scale) {
    widen_block(packed, pairs, blocks, K, N, block, w, w_sum, w_scale);
    for (int c = 0; c < WIDE_BLOCK; c++) w_sum[c] *= 2;
}

#ifdef __AMX_INT8__
#define ROWS_IN_L2 (2 << 20) /* bytes of 8-bit rows L2 holds beside a block: the Xeons' 2 MiB */

/* Each block of W widened into one int8 matrix in int8_linear.c's layout (a block's 4 groups of
   16 channels are that layout's), with its sums and scales */
static void widen_blocks(const uint8_t *packed, const uint32_t *pairs, int blocks, int64_t K,
                         int64_t N, int8_t *w, int32_t *w_sum, float *w_scale, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < N / WIDE_BLOCK; block++) {
        const int64_t c = block * WIDE_BLOCK;
        widen_for_tiles(packed, pairs, blocks, K, N, block, w + c * K, w_sum + c, w_scale + c);
    }
}

/* int4_widened_rows' products on the AMX build for rows that L2 does not hold (more than
   ROWS_IN_L2 bytes of levels): the whole of W widened once (N x K bytes, a prompt's buffer) for
   amx_int8_linear, which takes the rows in chunks that stay in L2 over a pass of the weights. A
   block at a time, each block's products read every row from L3. On a 2-core AMX Xeon
   (6144 x 2048, 1,300 rows) 9.5 ms where a block at a time took 14.7 (int8's own 8.6); with
   fewer rows the widened matrix's trip through memory costs more than it saves (64 rows: 1.40
   ms against 1.09). Nonzero (nothing computed) where a buffer could not be allocated or the
   tiles do not take the shapes. */
static int widened_matrix(const uint8_t *levels, const float *x_scale, const uint8_t *packed,
                          const uint32_t *pairs, int blocks, float *y, int64_t M, int64_t N,
                          int64_t K, int threads) {
    int8_t *w = K % 64 ? NULL : aligned_alloc(64, (size_t)(N * K));
    int32_t *w_sum = malloc((size_t)N * sizeof(int32_t));
    float *w_scale = malloc((size_t)N * sizeof(float)), *bias = calloc((size_t)N, sizeof(float));
    int failed = !w || !w_sum || !w_scale || !bias;
    if (!failed) {
        widen_blocks(packed, pairs, blocks, K, N, w, w_sum, w_scale, threads);
        failed =
            amx_int8_linear(levels, x_scale, w, w_sum, w_scale, bias, y, M, N, K, NONE, threads);
    }
    free(w);
    free(w_sum);
    free(w_scale);
    free(bias);
    return failed;
}
#endif

/* y (M x N, float32) = x @ W.T for int4 W (either form where the build reads both), each block of
   WIDE_BLOCK channels widened to int8 (widen_block) and x's rows to 8 bits (quantize_rows_8bit):
   the levels offset by 128, twice the 64 int8_linear.c's tiles take off, so they are handed twice
   the sums; nonzero where the shapes are not the kernel's (the blocks form where this build does
   not read it) or a buffer could not be allocated. */
int int4_widened_rows(const float *x, const uint8_t *packed, const uint16_t *scales_zeros,
                      int blocks, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || N % WIDE_BLOCK || K % 32 || (blocks && !READS_BLOCKS)) return 1;
    const uint32_t *pairs = (const uint32_t *)scales_zeros;
    uint8_t *levels = malloc((size_t)(M * K));
    float *x_scale = malloc((size_t)M * sizeof(float));
    int failed = !levels || !x_scale;
    if (failed) {
        free(levels);
        free(x_scale);
        return 1;
    }
    quantize_rows_8bit(x, M, K, levels, K, x_scale, threads);
#ifdef __AMX_INT8__
    if (M * K > ROWS_IN_L2 &&
        !widened_matrix(levels, x_scale, packed, pairs, blocks, y, M, N, K, threads)) {
        free(levels);
        free(x_scale);
        return 0;
    }
#endif
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        int8_t *w = aligned_alloc(64, (size_t)K * WIDE_BLOCK);
        int32_t w_sum[WIDE_BLOCK];
        float w_scale[WIDE_BLOCK], bias[WIDE_BLOCK] = {0};
        failed |= !w;
#pragma omp for schedule(dynamic, 1)
        for (int64_t block = 0; block < N / WIDE_BLOCK; block++) {
            if (!w || failed) continue;
            widen_for_tiles(packed, pairs, blocks, K, N, block, w, w_sum, w_scale);
            failed |= widened_products(levels, x_scale, w, w_sum, w_scale, bias,
                                       y + block * WIDE_BLOCK, M, N, K);
        }
        free(w);
    }
    free(levels);
    free(x_scale);
    return failed;
}
