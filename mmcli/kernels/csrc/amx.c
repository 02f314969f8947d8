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
   unsigned) the A operand, int32 sums exact (tdpbusd), the same integers. */
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "float_tiles.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_COLUMNS 16 /* rows of activations (bfloat16: B's columns) a tile holds */

/* Linux hands out the tiles' state only on request, once a process: 0 once granted. */
int amx_request(void) {
    static int granted = -1;
    if (granted != 0)
        granted = (int)syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
    return granted;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Every tile 16 rows of 64 bytes: A, B and C of a 16 x 16 x 32 (bfloat16) or 16 x 16 x 64 (int8)
   product. Each thread configures its own. */
static void configure(int a_rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    c.rows[4] = (uint8_t)a_rows; /* int8's activations, and the sums: the rows there are */
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)a_rows;
    _tile_loadconfig(&c);
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

/* No software prefetch: the tile loads' 16 (to 64) row streams are what the hardware's
   prefetchers follow best (fetching ahead in each row or in order measured slower). */

static void bf16_block1(const uint16_t *w, const uint32_t *xb, int64_t K, int64_t n0, int nb,
                        float *out) {
    /* one channel block against up to 4 column blocks: A in tmm4, B in tmm6, C in tmm0..3 */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride = K * 2, panel = K / 2 * 16; /* uint32 per column block */
    for (int64_t k = 0; k < K; k += 32) {
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

static void bf16_blocks4(const uint16_t *w, const uint32_t *xb, int64_t K, int64_t n0, float *out) {
    /* four channel blocks against one column block: A in tmm4/5, B in tmm6, C in tmm0..3 */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride = K * 2;
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(6, xb + (k / 2) * 16, 64);
        _tile_loadd(4, w + n0 * K + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, w + (n0 + 16) * K + k, stride);
        _tile_dpbf16ps(1, 5, 6);
        _tile_loadd(4, w + (n0 + 32) * K + k, stride);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, w + (n0 + 48) * K + k, stride);
        _tile_dpbf16ps(3, 5, 6);
    }
    _tile_stored(0, out, 256);
    _tile_stored(1, out + 16 * 64, 256);
    _tile_stored(2, out + 32 * 64, 256);
    _tile_stored(3, out + 48 * 64, 256);
}

/* y[m][n] from out[channel][column] (16 channels a block, 64 floats a channel) */
static void store_columns(const float *out, int blocks, int64_t n0, int64_t M, int64_t N, int split,
                          float *y) {
    for (int b = 0; b < blocks; b++)
        for (int i = 0; i < 16; i++) {
            const float *sums = out + (b * 16 + i) * 64;
            for (int64_t m = 0; m < M; m++)
                y[m * N + n0 + b * 16 + i] = split ? sums[m] + sums[M + m] : sums[m];
        }
}

/* y (M x N, float32) = x (M x K, float32) @ w.T (N x K, bfloat16 bits). M * (split ? 2 : 1) <=
   64, N a multiple of 16, K of 32; returns nonzero (and computes nothing) otherwise or where the
   tiles are not granted. */
int amx_bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int split, int threads) {
    const int64_t columns = M * (split ? 2 : 1);
    if (M < 1 || columns > 64 || N % 16 || K % 32 || amx_request()) return 1;
    const int nb = (int)((columns + 15) / 16);
    uint32_t *xb = aligned_alloc(64, (size_t)nb * (K / 2) * 16 * 4);
    if (!xb) return 1;
    for (int j = 0; j < nb; j++) pack_columns(x, M, K, split, j, xb + j * (K / 2) * 16);
    /* channel blocks a pass: 4 against one column block, else 1 (16 row streams: two blocks
       against two column blocks measured 15% slower at 32 rows) */
    const int per = nb == 1 ? 4 : 1;
    const int64_t passes = N / 16 / per, rest = N / 16 % per;
#pragma omp parallel num_threads(threads)
    {
        float out[4 * 16 * 64] __attribute__((aligned(64)));
        configure(16);
#pragma omp for schedule(static)
        for (int64_t p = 0; p < passes + rest; p++) {
            /* whole passes first; the rest's channel blocks one at a time */
            const int64_t n0 = p < passes ? p * per * 16 : (passes * per + (p - passes)) * 16;
            const int blocks = p < passes ? per : 1;
            if (blocks == 4)
                bf16_blocks4(w, xb, K, n0, out);
            else
                bf16_block1(w, xb, K, n0, nb, out);
            store_columns(out, blocks, n0, M, N, split, y);
        }
        _tile_release();
    }
    free(xb);
    return 0;
}

/* ---- amx_int8_linear ---- */

/* y rows m0 .. m0 + rows (<= 16) for channels n0 .. n0 + 64 from C tiles tmm0..3 */
static void int8_store(const int32_t *acc, int rows, int64_t n0, const float *x_scale,
                       const int32_t *w_sum, const float *w_scale, const float *bias, float *y,
                       int64_t Np) {
    for (int b = 0; b < 4; b++) {
        const int64_t c = n0 + b * 16;
        const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(w_sum + c), 6);
        const __m512 scale = _mm512_loadu_ps(w_scale + c), add = _mm512_loadu_ps(bias + c);
        for (int m = 0; m < rows; m++) {
            __m512i sums = _mm512_loadu_si512(acc + b * 256 + m * 16);
            __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, offset));
            v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(x_scale[m])), scale);
            _mm512_storeu_ps(y + m * Np + c, _mm512_add_ps(v, add));
        }
    }
}

/* 64 channels of up to 16 rows over the whole of Kp: the rows' A tile in tmm4, the 4 channel
   blocks' B tiles (1 KiB each, contiguous in the weights' layout) in tmm5..7, C in tmm0..3 */
static void int8_tile(const uint8_t *x, const int8_t *w, int64_t Kp, int64_t n0, int32_t *acc) {
    const int8_t *block = w + (n0 / 16) * Kp * 16;
    const int64_t group = Kp * 16; /* bytes between channel blocks */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < Kp; k += 64) {
        _tile_loadd(4, x + k, Kp);
        _tile_loadd(5, block + k * 16, 64);
        _tile_dpbusd(0, 4, 5);
        _tile_loadd(6, block + group + k * 16, 64);
        _tile_dpbusd(1, 4, 6);
        _tile_loadd(7, block + 2 * group + k * 16, 64);
        _tile_dpbusd(2, 4, 7);
        _tile_loadd(5, block + 3 * group + k * 16, 64);
        _tile_dpbusd(3, 4, 5);
    }
    _tile_stored(0, acc, 64);
    _tile_stored(1, acc + 256, 64);
    _tile_stored(2, acc + 512, 64);
    _tile_stored(3, acc + 768, 64);
}

#define INT8_ROWS 256 /* rows whose activations (256 x Kp bytes) stay in L2 over a weight pass */

/* int8_linear's y for Np a multiple of 64 and Kp of 64; nonzero (nothing computed) otherwise. */
int amx_int8_linear(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                    const float *w_scale, const float *bias, float *y, int64_t M, int64_t Np,
                    int64_t Kp, int threads) {
    if (M < 1 || Np % 64 || Kp % 64 || amx_request()) return 1;
    const int64_t tiles = Np / 64;
    for (int64_t m0 = 0; m0 < M; m0 += INT8_ROWS) {
        const int64_t chunk = M - m0 < INT8_ROWS ? M - m0 : INT8_ROWS;
#pragma omp parallel num_threads(threads)
        {
            int32_t acc[4 * 256] __attribute__((aligned(64)));
            int configured = 0;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++)
                for (int64_t m = m0; m < m0 + chunk; m += 16) {
                    const int rows = M - m < 16 ? (int)(M - m) : 16;
                    if (rows != configured) {
                        configure(rows);
                        configured = rows;
                    }
                    int8_tile(x + m * Kp, w, Kp, t * 64, acc);
                    int8_store(acc, rows, t * 64, x_scale + m, w_sum, w_scale, bias, y + m * Np,
                               Np);
                }
            if (configured) _tile_release();
        }
    }
    return 0;
}
