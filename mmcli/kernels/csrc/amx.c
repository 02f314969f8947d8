/* Products on the AMX tiles (Sapphire Rapids and later), built by kernels/cpu.py only where the
   CPU has them, with the weights in the layouts the other kernels already read: no copy at load.

   amx_bf16_linear, bfloat16 weights (N x K, row-major, as loaded) with float32 activations, for
   the few rows of a decode step: the weights are the A operand (16 output channels x 32 inputs a
   tile, loaded straight from their rows), the activations, rounded to bfloat16, the B operand
   (pairs of inputs for up to 16 rows, transposed once a call: a few KiB). Each tile product does
   16 x 16 x 32 multiply-adds, so the weights stream at the memory's rate at 32 rows where the
   float32 FMAs stop at a few. The sums are float32 and stay float32 (oneDNN's bfloat16 GEMM
   rounds its output). `split`: each activation as the sum of two bfloat16 (its high half and the
   rounded rest: 16 of float32's 24 bits), both multiplied, for the logits' near-float32 products.

   amx_int8_linear, int8_linear.c's operands and result: its weights' layout (16 output channels,
   4 inputs interleaved) is the tiles' B layout as it is, its activations (7 bits plus 64,
   unsigned) the A operand, int32 sums exact (tdpbusd), the same integers.

   amx_int4_rows and amx_int4_gemm, int4 weights in torch's CPU layout: a few rows on the
   weights' integers (bfloat16 rows on the tiles), each group's sums scaled after; more rows on
   panels dequantized once (fewer rows: int4_vnni.c, the vector units' int8 dot products). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx_tiles.h"
#include "float_tiles.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the tiles' state only on request, once a process: 0 once granted. */
int amx_request(void) {
    static int granted = -1;
    if (granted != 0)
        granted = (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
    return granted;
}

/* Every tile 64 bytes a row; `rows` (<= 32) rows of activations: tmm0, 1 (sums) and 4 (A) the
   first 16, tmm2, 3 and 5 the rest; tmm6, 7 16 rows (B). Each thread configures its own. */
static void configure_rows(int rows) {
    const int first = rows < 16 ? rows : 16, rest = rows > 16 ? rows - 16 : first;
    const int tile_rows[8] = {first, first, rest, rest, first, rest, 16, 16};
    configure_tiles(tile_rows);
}

/* ---- amx_bf16_linear ---- */

/* The B operand of column block j for every 32 inputs: xb[(k / 2) * 16 + c] holds column c's
   inputs k and k + 1 as a pair of bfloat16 (its low half the first), column c being row j * 16 +
   c of `rows` (x for c < M; with `split`, x's rounding rest for M <= c < 2M), zero past them. */
static void pack_columns(const float *x, int64_t M, int64_t K, int split, int64_t j, uint32_t *xb) {
    const int64_t columns = M * (split ? 2 : 1);
    for (int64_t k = 0; k < K; k += 32) {
        __m512 pairs[16];
        for (int c = 0; c < 16; c++) {
            const int64_t row = j * 16 + c;
            if (row >= columns) {
                pairs[c] = _mm512_setzero_ps();
                continue;
            }
            const float *from = x + (row % M) * K + k;
            __m512 first = _mm512_loadu_ps(from), second = _mm512_loadu_ps(from + 16);
            if (row >= M) { /* the rest after the high half's rounding */
                first = _mm512_sub_ps(first, _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(first)));
                second = _mm512_sub_ps(second, _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(second)));
            }
            pairs[c] = (__m512)_mm512_cvtne2ps_pbh(second, first); /* inputs k .. k + 31 */
        }
        transpose(pairs); /* 16 columns x 16 pairs -> 16 pairs x 16 columns */
        for (int i = 0; i < 16; i++) _mm512_storeu_ps((float *)(xb + (k / 2 + i) * 16), pairs[i]);
    }
}

/* The tile loads' 16 row streams are what the hardware's prefetchers follow best (fetching ahead
   in each row, or the weights laid out a tile after another, measured slower). What they cannot
   see coming is the next block's 16 rows: their first NEXT_AHEAD values are fetched over this
   block's last steps, a line a row a step (the default decode step 1.02-1.04x at 1, 8 and 32
   sequences on an AMX Xeon, bench/kernel_ab.py). */
#define NEXT_AHEAD 256

static void bf16_block1(const uint16_t *w, const uint32_t *xb, int64_t K, int64_t n0, int nb,
                        const uint16_t *next, float *out) {
    /* one channel block against up to 4 column blocks: A in tmm4, B in tmm6, C in tmm0..3 */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride = K * 2, panel = K / 2 * 16; /* uint32 per column block */
    for (int64_t k = 0; k < K; k += 32) {
        if (next && K >= NEXT_AHEAD && k + NEXT_AHEAD >= K)
            for (int r = 0; r < 16; r++)
                _mm_prefetch((const char *)(next + r * K + k + NEXT_AHEAD - K), _MM_HINT_T0);
        _tile_loadd(4, w + n0 * K + k, stride);
        _tile_loadd(6, xb + (k / 2) * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (nb > 1) {
            _tile_loadd(7, xb + panel + (k / 2) * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (nb > 2) {
            _tile_loadd(6, xb + 2 * panel + (k / 2) * 16, 64);
            _tile_dpbf16ps(2, 4, 6);
        }
        if (nb > 3) {
            _tile_loadd(7, xb + 3 * panel + (k / 2) * 16, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
    }
    _tile_stored(0, out, 256);
    _tile_stored(1, out + 16, 256);
    _tile_stored(2, out + 32, 256);
    _tile_stored(3, out + 48, 256);
}

/* y[m][n0 .. n0 + 15] from out[channel][column] (64 floats a channel): 16 columns at a time
   turned into rows in registers, a row one store. A value at a time, it took a fifth of the
   kernel's samples at 32 rows on an AMX Xeon (perf), the decode step 1.14x slower. */
static void store_columns(const float *out, int64_t n0, int64_t M, int64_t N, int split, float *y) {
    const int64_t columns = M * (split ? 2 : 1);
    float rows[64 * 16] __attribute__((aligned(64))); /* rows[column][channel] */
    for (int64_t c0 = 0; c0 < columns; c0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(out + i * 64 + c0);
        transpose(r);
        for (int c = 0; c < 16; c++) _mm512_store_ps(rows + (c0 + c) * 16, r[c]);
    }
    for (int64_t m = 0; m < M; m++) {
        __m512 sums = _mm512_load_ps(rows + m * 16);
        if (split) sums = _mm512_add_ps(sums, _mm512_load_ps(rows + (M + m) * 16));
        _mm512_storeu_ps(y + m * N + n0, sums);
    }
}

/* The B operand's buffer, kept by the calling thread and grown as needed: a fresh one a call
   (hundreds a decode step, some past malloc's mmap threshold) measured 8% slower at one row. */
static uint32_t *column_buffer(size_t bytes) {
    static _Thread_local uint32_t *held;
    static _Thread_local size_t size;
    if (bytes > size) {
        free(held);
        held = aligned_alloc(64, bytes);
        size = held ? bytes : 0;
    }
    return held;
}

/* y (M x N, float32) = x (M x K, float32) @ w.T (N x K, bfloat16 bits). M * (split ? 2 : 1) <=
   64, N a multiple of 16, K of 32; returns nonzero (and computes nothing) otherwise or where the
   tiles are not granted. */
int amx_bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int split, int threads) {
    const int64_t columns = M * (split ? 2 : 1);
    if (M < 1 || columns > 64 || N % 16 || K % 32 || amx_request()) return 1;
    const int nb = (int)((columns + 15) / 16);
    uint32_t *xb = column_buffer((size_t)nb * (K / 2) * 16 * 4);
    if (!xb) return 1;
    for (int j = 0; j < nb; j++) pack_columns(x, M, K, split, j, xb + j * (K / 2) * 16);
    /* one channel block at a time against every column block: 16 row streams of weights, which
       the hardware prefetchers follow (four blocks' 64 streams measured 5-16 GB/s against 20 at
       1-16 rows, bench/float_kernels.py) */
#pragma omp parallel num_threads(threads)
    {
        float out[16 * 64] __attribute__((aligned(64)));
        configure_rows(32); /* every tile 16 x 64 bytes */
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 16) {
            const uint16_t *next = n0 + 16 < N ? w + (n0 + 16) * K : NULL;
            bf16_block1(w, xb, K, n0, nb, next, out);
            store_columns(out, n0, M, N, split, y);
        }
        _tile_release();
    }
    return 0;
}

/* ---- amx_int4_gemm ---- */

/* A block of 64 output channels over all K inputs as the tiles' B operand, a "panel":
   [K / 32][4 channel tiles][16 pairs of inputs][16 channels][2] bfloat16, made once per block
   (int4_panel) and read from L2 by every row of x. Dequantizing costs about 14 vector
   operations per 32 weights, which many rows amortize (2.6x torch's int4 kernel at 32 rows,
   1.6x the dequantized tiles on oneDNN at 256); amx_int4_rows takes fewer. */
#define PANEL_CHANNELS 64
#define PANEL_TILE 512 /* bfloat16 a B tile */

/* int4 weights in torch's CPU layout (blocks of 64 channels, each input's 64 values in 32
   bytes, the low nibbles the block's first 32; scales_zeros [K / 32][N][2] bfloat16): value =
   (q - 8) * scale + zero, rounded to the nearest bfloat16 (ties to even) as int4_tiles.c. */
static void int4_panel(const uint8_t *weights, const uint16_t *scales_zeros, int64_t K, int64_t N,
                       int64_t block, uint16_t *panel) {
    const uint8_t *packed = weights + block * K * 32;
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                           16, 0); /* [a0, b0, a1, b1, ...] from [a, b] */
    const __m256i low = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    for (int64_t g = 0; g < K / 32; g++) {
        const uint32_t *pairs = (const uint32_t *)scales_zeros + g * N + block * PANEL_CHANNELS;
        __m512 scale[4], zero[4];
        for (int t = 0; t < 4; t++) scale_zero(pairs + t * 16, &scale[t], &zero[t]);
        for (int i = 0; i < 16; i++) {
            __m512 v[2][4];
            for (int j = 0; j < 2; j++) {
                __m256i b =
                    _mm256_loadu_si256((const __m256i *)(packed + (g * 32 + 2 * i + j) * 32));
                __m256i lo = _mm256_sub_epi8(_mm256_and_si256(b, low), eight);
                __m256i hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(b, 4), low), eight);
                __m128i q[4] = {_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1),
                                _mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)};
                for (int t = 0; t < 4; t++)
                    v[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q[t])),
                                              scale[t], zero[t]);
            }
            for (int t = 0; t < 4; t++) {
                __m512i both = (__m512i)_mm512_cvtne2ps_pbh(v[1][t], v[0][t]);
                vstore((float *)(panel + ((g * 4 + t) * 16 + i) * 32),
                       _mm512_castsi512_ps(_mm512_permutexvar_epi16(order, both)));
            }
        }
    }
}

/* y rows [m0, m0 + rows) (rows <= 32), channels of the panel: two passes of 2 channel tiles,
   each over the rows' two A tiles (tmm4/5), 4 C tiles (tmm0..3) stored straight into y */
static void panel_tiles(const uint16_t *x, const uint16_t *panel, int64_t K, int64_t N, int rows,
                        float *y) {
    const int64_t a_stride = K * 2, y_stride = N * 4;
    for (int pass = 0; pass < 2; pass++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t g = 0; g < K / 32; g++) {
            const uint16_t *b = panel + (g * 4 + 2 * pass) * PANEL_TILE;
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + PANEL_TILE, 64);
            _tile_loadd(4, x + g * 32, a_stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (rows > 16) {
                _tile_loadd(5, x + 16 * K + g * 32, a_stride);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        float *out = y + pass * 32;
        _tile_stored(0, out, y_stride);
        _tile_stored(1, out + 16, y_stride);
        if (rows > 16) {
            _tile_stored(2, out + 16 * N, y_stride);
            _tile_stored(3, out + 16 * N + 16, y_stride);
        }
    }
}

#define PANEL_ROWS 512 /* rows of x (512 x K bfloat16) a block's panel serves while in L2 */

/* y (M x N, float32) = x (M x K, bfloat16) @ W.T for int4 W (torch's CPU layout of N x K,
   group 32, its scales and zeros by group: not `by_block`); N a multiple of 64, K of 32. Nonzero
   (nothing computed) otherwise, or where the tiles are not granted or the panel buffer cannot
   be had. */
int amx_int4_gemm(const uint16_t *x, const uint8_t *packed, const uint16_t *scales_zeros,
                  int by_block, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || N % PANEL_CHANNELS || K % 32 || by_block || amx_request()) return 1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *panel = aligned_alloc(64, (size_t)K * PANEL_CHANNELS * 2);
        int configured = 0;
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t m0 = 0; m0 < M && panel; m0 += PANEL_ROWS) {
            const int64_t chunk = M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS;
#pragma omp for schedule(dynamic, 1)
            for (int64_t block = 0; block < N / PANEL_CHANNELS; block++) {
                int4_panel(packed, scales_zeros, K, N, block, panel);
                for (int64_t m = m0; m < m0 + chunk; m += 32) {
                    const int rows = m0 + chunk - m < 32 ? (int)(m0 + chunk - m) : 32;
                    if (rows != configured) {
                        configure_rows(rows);
                        configured = rows;
                    }
                    panel_tiles(x + m * K, panel, K, N, rows, y + m * N + block * PANEL_CHANNELS);
                }
            }
        }
        if (configured) _tile_release();
        free(panel);
    }
    return failed;
}

/* ---- amx_int4_rows: a few rows ---- */

/* For a few rows, dequantizing every weight (the panels) costs more than reading it. Instead the
   tiles multiply the weights' integers, exactly: B holds 128 + q as bfloat16 (whose bits are
   0x4300 | q: one ternary logic operation from the nibble), and each group's sums are scaled
   after the product: (q - 8) * scale + zero summed over a group of 32 inputs is scale * sum(x *
   (128 + q)) + (zero - 136 * scale) * sum(x). The weights are never rounded to bfloat16. */

/* B tiles of group g for a block's 4 channel tiles from torch's layout: for inputs k, k + 1 and
   channels c, c + 32 the bytes interleaved, widened to 16 bits, each nibble or'd into 0x4300 */
static void int4_group_tiles(const uint8_t *block, int64_t g, uint16_t *tiles) {
    const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
    for (int r = 0; r < 16; r++) {
        const uint8_t *first = block + (g * 32 + 2 * r) * 32, *second = first + 32;
        for (int half = 0; half < 2; half++) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(first + half * 16));
            const __m128i b = _mm_loadu_si128((const __m128i *)(second + half * 16));
            const __m256i pairs =
                _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
            const __m512i words = _mm512_cvtepu8_epi16(pairs);
            const __m512i low = _mm512_ternarylogic_epi32(words, nibble, exponent, 0xEA);
            const __m512i high =
                _mm512_ternarylogic_epi32(_mm512_srli_epi16(words, 4), nibble, exponent, 0xEA);
            _mm512_storeu_si512(tiles + (half * 16 + r) * 32, low);        /* channels 16 half .. */
            _mm512_storeu_si512(tiles + ((2 + half) * 16 + r) * 32, high); /* 32 + 16 half .. */
        }
    }
}

static void configure_few(int rows) {
    /* sums and A: the rows; B: 16 pairs */
    const int tile_rows[8] = {rows, rows, rows, rows, rows, 16, 16, 16};
    configure_tiles(tile_rows);
}

/* y rows (<= 16) x the 64 channels of `block` */
static void int4_block_rows(const uint16_t *x, const float *x_sums, const uint8_t *packed,
                            const uint16_t *scales_zeros, int64_t K, int64_t N, int64_t block,
                            int rows, float *y) {
    uint16_t tiles[4 * 512] __attribute__((aligned(64)));
    float sums[4 * 256] __attribute__((aligned(64)));
    __m512 acc[16][4];
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < 4; t++) acc[m][t] = _mm512_setzero_ps();
    const uint8_t *bytes = packed + block * K * 32;
    for (int64_t g = 0; g < K / 32; g++) {
        int4_group_tiles(bytes, g, tiles);
        _tile_loadd(4, x + g * 32, K * 2);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(5, tiles, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, tiles + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, tiles + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, tiles + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
        _tile_stored(0, sums, 64);
        _tile_stored(1, sums + 256, 64);
        _tile_stored(2, sums + 512, 64);
        _tile_stored(3, sums + 768, 64);
        const uint32_t *pairs = (const uint32_t *)scales_zeros + g * N + block * 64;
        for (int t = 0; t < 4; t++) {
            __m512 scale, zero;
            scale_zero(pairs + t * 16, &scale, &zero);
            const __m512 shift = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), scale, zero);
            for (int m = 0; m < rows; m++) {
                acc[m][t] =
                    _mm512_fmadd_ps(scale, _mm512_load_ps(sums + t * 256 + m * 16), acc[m][t]);
                acc[m][t] =
                    _mm512_fmadd_ps(shift, _mm512_set1_ps(x_sums[m * (K / 32) + g]), acc[m][t]);
            }
        }
    }
    for (int m = 0; m < rows; m++)
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(y + m * N + block * 64 + t * 16, acc[m][t]);
}

/* y (M x N, float32) = x (M x K, bfloat16) @ W.T for int4 W in torch's CPU layout (group 32,
   the scales by group: not `by_block`), M <= 16; nonzero (nothing computed) otherwise or where
   the tiles are not granted. */
int amx_int4_rows(const uint16_t *x, const uint8_t *packed, const uint16_t *scales_zeros,
                  int by_block, float *y, int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || M > 16 || N % 64 || K % 32 || by_block || amx_request()) return 1;
    float *x_sums = malloc((size_t)(M * (K / 32)) * sizeof(float)); /* each row's group sums */
    if (!x_sums) return 1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / 32; g++) {
            float total = 0.0f;
            for (int k = 0; k < 32; k++) total += bf16_to_float(x[m * K + g * 32 + k]);
            x_sums[m * (K / 32) + g] = total;
        }
#pragma omp parallel num_threads(threads)
    {
        configure_few((int)M);
#pragma omp for schedule(static)
        for (int64_t block = 0; block < N / 64; block++)
            int4_block_rows(x, x_sums, packed, scales_zeros, K, N, block, (int)M, y);
        _tile_release();
    }
    free(x_sums);
    return 0;
}

/* ---- amx_int8_linear ---- */

/* y rows [0, rows) (rows <= 32) of channels n0 .. n0 + 32 from int8_tiles' sums:
   acc[row block][channel tile][16 rows][16 channels], the activation (enum activation) applied as
   they are stored (a pass of its own would read the outputs back from memory); with `stream`,
   past the caches (vectors.h) */
static void int8_store(const int32_t *acc, int rows, int64_t n0, const float *x_scale,
                       const int32_t *w_sum, const float *w_scale, const float *bias, float *y,
                       int64_t Np, int act, int stream) {
    for (int t = 0; t < 2; t++) {
        const int64_t c = n0 + t * 16;
        const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(w_sum + c), 6);
        const __m512 scale = _mm512_loadu_ps(w_scale + c), add = _mm512_loadu_ps(bias + c);
        for (int m = 0; m < rows; m++) {
            __m512i sums = _mm512_loadu_si512(acc + (m / 16) * 512 + t * 256 + (m % 16) * 16);
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offset));
            v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(x_scale[m])), scale);
            v = _mm512_add_ps(v, add);
            if (act == GELU_TANH) v = vgelu_tanh(v);
            if (stream)
                vstream(y + m * Np + c, v);
            else
                vstore(y + m * Np + c, v);
        }
    }
}

/* 32 channels of up to 32 rows over the whole of Kp: the rows' two A tiles in tmm4/5, the two
   channel tiles' B tiles (1 KiB each, contiguous in the weights' layout) in tmm6/7, C in
   tmm0..3 (configure_rows). Each B tile's products follow its own load, so that the second's
   load overlaps the first's products; the next block's weights are fetched ahead (vectors.h):
   a decode step of 32 rows 1.03-1.06x, of 8 rows 1.01-1.02x (bench/kernel_ab.py, int8). */
static void int8_tiles(const uint8_t *x, const int8_t *w, int64_t Kp, int64_t n0, int rows,
                       int32_t *acc, struct ahead *ahead) {
    const int8_t *first = w + (n0 / 16) * Kp * 16, *second = first + Kp * 16;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < Kp; k += 64) {
        fetch_ahead(ahead);
        _tile_loadd(6, first + k * 16, 64);
        _tile_loadd(4, x + k, Kp);
        _tile_dpbusd(0, 4, 6);
        if (rows > 16) {
            _tile_loadd(5, x + 16 * Kp + k, Kp);
            _tile_dpbusd(2, 5, 6);
        }
        _tile_loadd(7, second + k * 16, 64);
        _tile_dpbusd(1, 4, 7);
        if (rows > 16) _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    if (rows > 16) {
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
    }
}

#define INT8_ROWS 256 /* rows whose activations (256 x Kp bytes) stay in L2 over a weight pass */

/* y rows [m, m + rows) (rows <= 32) of channels n0 .. n0 + 32, y's rows ldy apart, the tiles
   configured for `rows` first where *configured says they are not */
static void int8_block_rows(const uint8_t *x, const float *x_scale, const int8_t *w,
                            const int32_t *w_sum, const float *w_scale, const float *bias, float *y,
                            int64_t m, int rows, int64_t n0, int64_t ldy, int64_t Kp, int act,
                            int stream, int *configured, struct ahead *ahead) {
    int32_t acc[4 * 256] __attribute__((aligned(64)));
    if (rows != *configured) {
        configure_rows(rows);
        *configured = rows;
    }
    int8_tiles(x + m * Kp, w, Kp, n0, rows, acc, ahead);
    int8_store(acc, rows, n0, x_scale + m, w_sum, w_scale, bias, y + m * ldy, ldy, act, stream);
}

/* Every row of x times one block of 64 channels whose int8 weights are `w` alone, as
   int8_linear_tile takes them (w_sum, w_scale, bias and y from the block's first channel, y's
   rows ldy apart, no activation), on the calling thread's tiles: int4_vnni.c's widened blocks.
   Nonzero (nothing computed) where Kp is not a multiple of 64 or the tiles are not granted. */
int amx_int8_block(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                   const float *w_scale, const float *bias, float *y, int64_t M, int64_t ldy,
                   int64_t Kp) {
    if (M < 1 || Kp % 64 || amx_request()) return 1;
    int configured = 0;
    for (int64_t m = 0; m < M; m += 32) {
        const int rows = M - m < 32 ? (int)(M - m) : 32;
        for (int64_t n0 = 0; n0 < 64; n0 += 32) {
            struct ahead none = {NULL, NULL, 0};
            int8_block_rows(x, x_scale, w, w_sum, w_scale, bias, y, m, rows, n0, ldy, Kp, NONE, 0,
                            &configured, &none);
        }
    }
    _tile_release();
    return 0;
}

/* The next block's weights (32 channels, Kp * 32 bytes after this block's), a 64th of them at
   each of this block's steps of 64 inputs in its first pass of rows (the first chunk's: the
   others read them again from the cache); none after the last block */
static struct ahead int8_ahead(const int8_t *w, int64_t Np, int64_t Kp, int64_t n0, int64_t m0) {
    struct ahead a = {NULL, NULL, 0};
    if (m0 > 0 || n0 + 32 >= Np) return a;
    a.next = (const char *)(w + (n0 + 32) * Kp), a.end = a.next + Kp * 32;
    a.lines = 32; /* Kp * 32 bytes over Kp / 64 steps: 32 lines a step */
    return a;
}

/* int8_linear's y for Np a multiple of 32 and Kp of 64; nonzero (nothing computed) otherwise. */
int amx_int8_linear(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                    const float *w_scale, const float *bias, float *y, int64_t M, int64_t Np,
                    int64_t Kp, int act, int threads) {
    if (M < 1 || Np % 32 || Kp % 64 || amx_request()) return 1;
    const int stream = STREAMED(y, M * Np, Np);
    for (int64_t m0 = 0; m0 < M; m0 += INT8_ROWS) {
        const int64_t chunk = M - m0 < INT8_ROWS ? M - m0 : INT8_ROWS;
#pragma omp parallel num_threads(threads)
        {
            int configured = 0;
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < Np; n0 += 32) {
                struct ahead ahead = int8_ahead(w, Np, Kp, n0, m0);
                for (int64_t m = m0; m < m0 + chunk; m += 32) {
                    const int rows = m0 + chunk - m < 32 ? (int)(m0 + chunk - m) : 32;
                    int8_block_rows(x, x_scale, w, w_sum, w_scale, bias, y, m, rows, n0, Np, Kp,
                                    act, stream, &configured, &ahead);
                }
            }
            if (stream) _mm_sfence(); /* the streamed stores seen before the threads join */
            if (configured) _tile_release();
        }
    }
    return 0;
}
