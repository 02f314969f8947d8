/* y = (x @ w.T) * x_scale[m] * w_scale[n] + bias[n], summed exactly in int32: the int8 kernel
   kernels/cpu.py builds.

   x: M rows of Kp bytes, each activation a 7-bit integer in [-63, 63] stored plus 64 (so unsigned,
   in [1, 127]). w: the weights in the layout weights/int8.py's quantize_int8 writes and the
   prepared file stores as it is: groups of 16 output channels, and in each group, for every 4 input
   channels, the 16 channels' 4 bytes (the operand layout of vpdpbusd; Np a multiple of 16, Kp of 4,
   zero padded). A weight lies in [-127, 127]. w_sum[n] is the sum of row n: the 64 added to x is
   taken off as 64
   * w_sum[n]. Activations of 7 bits keep vpmaddubsw (AVX2) from saturating: a pair of products is
   at most 2 * 127 * 127, within int16. With AVX-512 VNNI one vpdpbusd does the 64 products and sums
   of a 16-channel, 4-input step; both paths give the same integers. */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "vectors.h" /* vgelu_tanh, enum activation: the activation at the last store */

/* A step's few rows are bound by reading the weights: a tile of them fetches, as it goes, the
   same bytes of the tile `threads` tiles on (the one this thread likely takes next: the tiles go
   to whichever thread is free), for a new tile starts a new page, where the hardware's
   prefetcher stops. On a 2-core Zen 1 (AVX2) the logits of one row (151936 x 2048) took 17-19
   ms where they took 22-23, a 6144 x 2048 layer's 1.05-1.1x less. To 4 rows, as the AMX build
   takes them here (int8_step_rows): int8's decode step at 3 and 4 sequences 1.02-1.03x on an AMX
   Xeon, 1 and 2 unchanged (bench/kernel_ab.py, two runs). To a step's 32 rows, each of a tile's
   passes of rows fetching its share of the lines (one in `passes` of its steps, `struct fetch`):
   else the first pass read the tile from memory, the arithmetic waiting, and the others from the
   cache while memory idled. */
#define FETCH_ROWS 32

/* What a tile fetches: the bytes `bytes` on from its own (none: 0), in pass `pass` of `passes`
   over it its lines pass, pass + passes, ... */
struct fetch {
    int64_t bytes;
    int pass, passes;
};

/* Whether this step of a tile fetches its line ahead: a countdown (no division a step) */
static inline int fetch_now(const struct fetch *f, int *countdown) {
    if (!f->bytes) return 0;
    if (f->passes == 1) return 1; /* one pass: every line */
    if (--*countdown) return 0;
    *countdown = f->passes;
    return 1;
}

/* The bytes from tile `t` to the tile `threads` on (FETCH_ROWS), 0 where that is not a whole tile
   of the `tiles` (no pointer past the weights' end is formed) */
static inline int64_t ahead_bytes(int64_t t, int64_t tiles, int64_t tile_bytes, int threads) {
    return t + threads < tiles ? threads * tile_bytes : 0;
}

#ifndef KC
/* inputs per block, a multiple of 4: a whole row of the layers here. Between blocks every row's
   int32 sums go out to y and back, which cost more than reading a block's weights from L2: at
   256 inputs a block, the products of 219-784 rows ran at 590-690 G(OP)/s on a 2-core Zen 4,
   whole rows at 800-855 (oneDNN's int8 GEMM: 865); the AVX2 build 365-385 against 405-425. */
#define KC 8192
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MR 6 /* x rows per tile */
#define NV 4 /* vectors per tile: 64 output channels */
#define VLEN 16
#define EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)
#define EACH_VECTOR(X, m) X(m, 0) X(m, 1) X(m, 2) X(m, 3)
typedef __m512i ivec;
static inline ivec izero(void) { return _mm512_setzero_si512(); }
static inline ivec iload(const int32_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline void istore(int32_t *p, ivec v) { _mm512_storeu_si512((void *)p, v); }
static inline ivec wload(const int8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline ivec xbroadcast(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
static inline ivec dot4(ivec acc, ivec x, ivec w) { return _mm512_dpbusd_epi32(acc, x, w); }
static inline void store(float *y, ivec acc, const int32_t *w_sum, const float *w_scale,
                         const float *bias, float xs, int act) {
    __m512 v =
        _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_slli_epi32(_mm512_loadu_si512(w_sum), 6)));
    v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(xs)), _mm512_loadu_ps(w_scale));
    v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, act == GELU_TANH ? vgelu_tanh(v) : v);
}
#else
#define MR 4
#define NV 2 /* 16 output channels: one group */
#define VLEN 8
#define EACH_ROW(X) X(0) X(1) X(2) X(3)
#define EACH_VECTOR(X, m) X(m, 0) X(m, 1)
typedef __m256i ivec;
static inline ivec izero(void) { return _mm256_setzero_si256(); }
static inline ivec iload(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline void istore(int32_t *p, ivec v) { _mm256_storeu_si256((__m256i *)p, v); }
static inline ivec wload(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline ivec xbroadcast(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
static inline ivec dot4(ivec acc, ivec x, ivec w) {
    return _mm256_add_epi32(acc,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
}
static inline void store(float *y, ivec acc, const int32_t *w_sum, const float *w_scale,
                         const float *bias, float xs, int act) {
    __m256i sums = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)w_sum), 6);
    __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc, sums));
    v = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(xs)), _mm256_loadu_ps(w_scale));
    v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y, act == GELU_TANH ? vgelu_tanh(v) : v);
}
#endif

/* Where output channel c's bytes start: its group of 16, and its place in that group. */
static inline const int8_t *column_of(const int8_t *w, int64_t Kp, int64_t c) {
    return w + (c / 16) * Kp * 16 + (c % 16) * 4;
}

/* Output channels n0 .. n0 + nv * VLEN of rows x[0 .. mr), over inputs k0 .. k1: the int32 sums so
   far are kept in y's own memory (as int32) between input blocks, and the last block writes the
   scaled float32 values over them. Its share of the bytes `ahead` (struct fetch) is fetched as it
   goes (FETCH_ROWS). */
static inline __attribute__((always_inline)) void
tile(const uint8_t *x, const int8_t *w, int64_t Kp, int64_t k0, int64_t k1, int64_t n0, int mr,
     int nv, const float *x_scale, const int32_t *w_sum, const float *w_scale, const float *bias,
     float *y, int64_t ldy, int act, struct fetch ahead) {
    const int8_t *column[NV];
    int countdown = ahead.pass + 1;
    for (int j = 0; j < nv; j++) column[j] = column_of(w, Kp, n0 + j * VLEN);
    ivec acc[MR][NV];
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nv; j++)
            acc[m][j] = k0 ? iload((const int32_t *)(y + m * ldy + n0 + j * VLEN)) : izero();
    for (int64_t k = k0; k < k1; k += 4) {
        /* a step's bytes of a group of 16 channels are one cache line */
        if (fetch_now(&ahead, &countdown))
            for (int j = 0; j < nv; j += 16 / VLEN)
                _mm_prefetch((const char *)(column[j] + k * 16) + ahead.bytes, _MM_HINT_T0);
        ivec wv[NV];
        for (int j = 0; j < nv; j++) wv[j] = wload(column[j] + k * 16);
        for (int m = 0; m < mr; m++) {
            ivec xb = xbroadcast(x + m * Kp + k);
            for (int j = 0; j < nv; j++) acc[m][j] = dot4(acc[m][j], xb, wv[j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nv; j++) {
            int64_t c = n0 + j * VLEN;
            if (k1 < Kp)
                istore((int32_t *)(y + m * ldy + c), acc[m][j]);
            else
                store(y + m * ldy + c, acc[m][j], w_sum + c, w_scale + c, bias + c, x_scale[m],
                      act);
        }
}

/* The same for a whole MR x NV tile, the hot path, with each accumulator a variable of its own: GCC
   keeps an array of them in registers only with a copy to the stack at every step. */
static void tile_full(const uint8_t *x, const int8_t *w, int64_t Kp, int64_t k0, int64_t k1,
                      int64_t n0, const float *x_scale, const int32_t *w_sum, const float *w_scale,
                      const float *bias, float *y, int64_t ldy, int act, struct fetch ahead) {
    const int8_t *column[NV];
    int countdown = ahead.pass + 1;
    for (int j = 0; j < NV; j++) column[j] = column_of(w, Kp, n0 + j * VLEN);
#define DECLARE(m, j)                                                                              \
    ivec a##m##j = k0 ? iload((const int32_t *)(y + m * ldy + n0 + j * VLEN)) : izero();
#define DECLARE_ROW(m) EACH_VECTOR(DECLARE, m)
    EACH_ROW(DECLARE_ROW)
    for (int64_t k = k0; k < k1; k += 4) {
        if (fetch_now(&ahead, &countdown))
            for (int j = 0; j < NV; j += 16 / VLEN)
                _mm_prefetch((const char *)(column[j] + k * 16) + ahead.bytes, _MM_HINT_T0);
#define LOAD(m, j) ivec w##j = wload(column[j] + k * 16);
        EACH_VECTOR(LOAD, 0)
#define DOT(m, j) a##m##j = dot4(a##m##j, xb, w##j);
#define DOT_ROW(m)                                                                                 \
    {                                                                                              \
        ivec xb = xbroadcast(x + m * Kp + k);                                                      \
        EACH_VECTOR(DOT, m)                                                                        \
    }
        EACH_ROW(DOT_ROW)
    }
#define FINISH(m, j)                                                                               \
    if (k1 < Kp)                                                                                   \
        istore((int32_t *)(y + m * ldy + n0 + j * VLEN), a##m##j);                                 \
    else                                                                                           \
        store(y + m * ldy + n0 + j * VLEN, a##m##j, w_sum + n0 + j * VLEN,                         \
              w_scale + n0 + j * VLEN, bias + n0 + j * VLEN, x_scale[m], act);
#define FINISH_ROW(m) EACH_VECTOR(FINISH, m)
    EACH_ROW(FINISH_ROW)
}

#define TILE(R, V)                                                                                 \
    tile(x, w, Kp, k0, k1, n0, R, V, x_scale, w_sum, w_scale, bias, y, ldy, act, ahead)
/* R rows, NV vectors wide or, in a last narrow tile, one */
#define TILE_ROWS(R) (nv == NV ? TILE(R, NV) : TILE(R, 1))

/* The edges: fewer than MR rows, or a last tile narrower than NV vectors (one vector at a time),
   each size a constant for the compiler. */
static void tile_edge(const uint8_t *x, const int8_t *w, int64_t Kp, int64_t k0, int64_t k1,
                      int64_t n0, int mr, int nv, const float *x_scale, const int32_t *w_sum,
                      const float *w_scale, const float *bias, float *y, int64_t ldy, int act,
                      struct fetch ahead) {
    switch (mr) {
    case 1: TILE_ROWS(1); break;
    case 2: TILE_ROWS(2); break;
    case 3: TILE_ROWS(3); break;
#if MR > 4
    case 4: TILE_ROWS(4); break;
    case 5: TILE_ROWS(5); break;
#endif
    default: TILE(MR, 1); /* MR rows come here only in a narrow tile */
    }
}

/* Output channels n0 .. n0 + nv * VLEN of every row, a block of KC inputs at a time: the block's
   weights (nv * VLEN x KC bytes) stay in L2 while every row passes over them; `ahead` as tile's
   (FETCH_ROWS rows at most). */
static void columns(const uint8_t *x, const int8_t *w, int64_t Kp, int64_t n0, int nv, int64_t M,
                    const float *x_scale, const int32_t *w_sum, const float *w_scale,
                    const float *bias, float *y, int64_t Np, int act, int64_t ahead) {
    for (int64_t k0 = 0; k0 < Kp; k0 += KC) {
        int64_t k1 = k0 + KC < Kp ? k0 + KC : Kp;
        for (int64_t m = 0; m < M; m += MR) {
            int mr = M - m >= MR ? MR : (int)(M - m);
            struct fetch f = {M <= FETCH_ROWS ? ahead : 0, (int)(m / MR), (int)((M + MR - 1) / MR)};
            if (mr == MR && nv == NV)
                tile_full(x + m * Kp, w, Kp, k0, k1, n0, x_scale + m, w_sum, w_scale, bias,
                          y + m * Np, Np, act, f);
            else
                tile_edge(x + m * Kp, w, Kp, k0, k1, n0, mr, nv, x_scale + m, w_sum, w_scale, bias,
                          y + m * Np, Np, act, f);
        }
    }
}

/* Every row of x times one tile of NV * VLEN output channels whose weights are `w` alone (its
   w_sum, w_scale, bias and y from that tile's first channel on, y's rows ldy apart), no
   activation: int4_vnni.c hands its blocks of channels, widened to int8, to these tiles. */
void int8_linear_tile(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                      const float *w_scale, const float *bias, float *y, int64_t M, int64_t ldy,
                      int64_t Kp) {
    columns(x, w, Kp, 0, NV, M, x_scale, w_sum, w_scale, bias, y, ldy, NONE, 0);
}

int amx_int8_linear(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                    const float *w_scale, const float *bias, float *y, int64_t M, int64_t Np,
                    int64_t Kp, int act, int threads);

/* y is M x Np float32; w_sum, w_scale and bias hold Np values (zero past the layer's own
   channels); act (enum activation) is applied as each output is stored. The AMX build computes
   more than `vnni_rows` rows on the tiles (amx.c: the same integers) where the shapes fit them. */
void int8_linear(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                 const float *w_scale, const float *bias, float *y, int64_t M, int64_t Np,
                 int64_t Kp, int64_t vnni_rows, int act, int threads) {
#ifdef __AMX_INT8__
    if (M > vnni_rows &&
        !amx_int8_linear(x, x_scale, w, w_sum, w_scale, bias, y, M, Np, Kp, act, threads))
        return;
#else
    (void)vnni_rows;
#endif
    const int64_t width = NV * VLEN, tiles = (Np + width - 1) / width;
/* a tile at a time to whichever thread is free, as bf16_linear.c shares out its rows */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * width, ahead = ahead_bytes(t, Np / width, width * Kp, threads);
        if (Np - n0 >= width)
            columns(x, w, Kp, n0, NV, M, x_scale, w_sum, w_scale, bias, y, Np, act, ahead);
        else /* a last, narrower tile: a vector at a time */
            for (int64_t n = n0; n < Np; n += VLEN)
                columns(x, w, Kp, n, 1, M, x_scale, w_sum, w_scale, bias, y, Np, act, 0);
    }
}

/* The logits' products (the lm_head): each activation on 14 bits (int16 levels in [-8191, 8191]),
   where int8_linear's 7 bits would move every log-prob by twice what the int8 weights do. On
   AVX2 one vpmaddwd makes 16 products, as many as its vpmaddubsw and vpmaddwd make 32: the rate
   of 7-bit rows, twice that of two rows of 7-bit levels a token. The weights are int8_linear's
   layout, widened to int16 in registers (vpmovsxbw): 16 bytes are 4 channels' 4 inputs, each
   lane of 32 bits the sum of one channel's two products. A lane sums at most WIDE_KC / 2 products
   of 8191 x 127 within int32; each block's sums go out to y as float32. */
#define WIDE_TOP 8191
#define WIDE_KC 4096
#define WIDE_MR 4 /* rows per tile at most: 8 accumulators */
#define EACH_ACCUMULATOR(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

/* 8 channels' float32 sums from two vectors of their halves (channels 0-3, 4-7) */
static inline __m256 wide_sums(__m256i lo, __m256i hi) {
    __m256i pairs = _mm256_hadd_epi32(lo, hi); /* 0 1 4 5 | 2 3 6 7 */
    return _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(pairs, 0xd8));
}

/* 8 channels' sums of a row after a block: scaled and biased at the last (k1 == Kp), else (as
   float32 sums) added to the earlier blocks' in y */
static inline void wide_store(__m256i lo, __m256i hi, int64_t k0, int64_t k1, int64_t Kp, float xs,
                              const float *w_scale, const float *bias, float *out) {
    __m256 v = wide_sums(lo, hi);
    if (k0) v = _mm256_add_ps(v, _mm256_loadu_ps(out));
    if (k1 == Kp) {
        v = _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(xs)), _mm256_loadu_ps(w_scale));
        v = _mm256_add_ps(v, _mm256_loadu_ps(bias));
    }
    _mm256_storeu_ps(out, v);
}

/* Rows x[0 .. mr) times output channels n0 .. n0 + 4 * nv (nv vectors of 4 channels' 16 weights
   widened), inputs k0 .. k1, with mr * nv <= 8 accumulators a0 .. a7 (row m's vector j in
   a[m * nv + j]), each a variable of its own (as tile_full's). */
static inline __attribute__((always_inline)) void
wide_tile(const int16_t *x, const int8_t *w, int64_t Kp, int64_t k0, int64_t k1, int64_t n0, int mr,
          int nv, const float *x_scale, const float *w_scale, const float *bias, float *y,
          int64_t ldy, int64_t ahead) {
    const int8_t *column = column_of(w, Kp, n0);
    __m256i a0, a1, a2, a3, a4, a5, a6, a7;
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 4) {
        if (ahead) _mm_prefetch((const char *)(column + k * 16) + ahead, _MM_HINT_T0);
        const __m128i *p = (const __m128i *)(column + k * 16);
        __m256i wv[4], xb[WIDE_MR];
        for (int j = 0; j < nv; j++) wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(p + j));
        for (int m = 0; m < mr; m++)
            xb[m] = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(x + m * Kp + k)));
#define WIDE_PRODUCT(i)                                                                            \
    if (i < mr * nv) a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(wv[i % nv], xb[i / nv]));
        EACH_ACCUMULATOR(WIDE_PRODUCT)
#undef WIDE_PRODUCT
        /* keeps GCC from moving the accumulators through the stack at every step */
        __asm__(""
                : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7));
    }
    __m256i a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < nv; j += 2)
            wide_store(a[m * nv + j], a[m * nv + j + 1], k0, k1, Kp, x_scale[m],
                       w_scale + n0 + j * 4, bias + n0 + j * 4, y + m * ldy + n0 + j * 4);
}

/* Every row times a group's channels n0 .. n0 + 16, inputs k0 .. k1: up to 2 rows in one pass over
   all 16 (a step's few rows, bound by reading the weights: one pass keeps the reads going),
   more 4 rows at a time over each half (fewer widenings a product: many rows are bound by the
   arithmetic). */
static void wide_rows(const int16_t *x, const int8_t *w, int64_t Kp, int64_t k0, int64_t k1,
                      int64_t n0, int64_t M, const float *x_scale, const float *w_scale,
                      const float *bias, float *y, int64_t Np, int64_t ahead) {
#define WIDE(R, V, m, n, ahead)                                                                    \
    wide_tile(x + (m) * Kp, w, Kp, k0, k1, n, R, V, x_scale + (m), w_scale, bias, y + (m) * Np,    \
              Np, ahead)
    if (M <= 2) {
        if (M == 2)
            WIDE(2, 4, 0, n0, ahead);
        else
            WIDE(1, 4, 0, n0, ahead);
        return;
    }
    for (int64_t n = n0; n < n0 + 16; n += 8)
        for (int64_t m = 0; m < M; m += WIDE_MR) switch (M - m >= WIDE_MR ? WIDE_MR : M - m) {
            case 1: WIDE(1, 2, m, n, 0); break;
            case 2: WIDE(2, 2, m, n, 0); break;
            case 3: WIDE(3, 2, m, n, 0); break;
            default: WIDE(WIDE_MR, 2, m, n, 0);
            }
#undef WIDE
}

/* y (M x Np float32) = x (M x Kp int16 levels) @ w.T, scaled and biased as int8_linear's; w in
   int8_linear's layout (its w_sum is not needed: the levels are signed). */
void int8_linear_wide(const int16_t *x, const float *x_scale, const int8_t *w, const float *w_scale,
                      const float *bias, float *y, int64_t M, int64_t Np, int64_t Kp, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t g = 0; g < Np / 16; g++) {
        const int64_t ahead = ahead_bytes(g, Np / 16, 16 * Kp, threads);
        for (int64_t k0 = 0; k0 < Kp; k0 += WIDE_KC) {
            int64_t k1 = k0 + WIDE_KC < Kp ? k0 + WIDE_KC : Kp;
            wide_rows(x, w, Kp, k0, k1, g * 16, M, x_scale, w_scale, bias, y, Np, ahead);
        }
    }
}

/* A row's scale: its largest magnitude / top, at least 1e-12 */
static float row_scale(const float *row, int64_t K, int top) {
    __m256 most = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        most = _mm256_max_ps(most, _mm256_and_ps(_mm256_loadu_ps(row + k), magnitude));
    float lanes[8], largest = 0.0f;
    _mm256_storeu_ps(lanes, most);
    for (int i = 0; i < 8; i++) largest = lanes[i] > largest ? lanes[i] : largest;
    for (; k < K; k++) largest = fabsf(row[k]) > largest ? fabsf(row[k]) : largest;
    float s = largest / (float)top;
    return s < 1e-12f ? 1e-12f : s;
}

/* Each row of x (M x K float32) as levels of `top`: its scale (largest magnitude / top, at least
   1e-12) in x_scale[m], and its values divided by it, rounded to the nearest (ties to even), into
   q (M x Kp, the padding zero levels): bytes offset by top + 1 (int8_linear's unsigned operand)
   or, with `words`, int16 as they are (vpmaddwd's signed words). The same arithmetic as
   quantized.py's float32 path, in one pass over x. */
static void quantize_rows_to(const float *x, int64_t M, int64_t K, void *q, int64_t Kp,
                             float *x_scale, int top, int words, int threads) {
    const int offset = words ? 0 : top + 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= PARALLEL_VALUES)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * K;
        uint8_t *bytes = (uint8_t *)q + m * Kp;
        int16_t *halves = (int16_t *)q + m * Kp;
        float s = row_scale(row, K, top);
        x_scale[m] = s;
        const __m256 vs = _mm256_set1_ps(s);
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(row + k), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(offset));
            __m128i w16 =
                _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
            if (words)
                _mm_storeu_si128((__m128i *)(halves + k), w16);
            else
                _mm_storel_epi64((__m128i *)(bytes + k), _mm_packus_epi16(w16, w16));
        }
        for (; k < Kp; k++) {
            const int32_t level =
                k < K ? (int32_t)__builtin_roundevenf(row[k] / s) + offset : offset;
            if (words)
                halves[k] = (int16_t)level;
            else
                bytes[k] = (uint8_t)level;
        }
    }
}

/* int8_linear's activations: 7 bits, offset by 64 */
void quantize_rows(const float *x, int64_t M, int64_t K, uint8_t *q, int64_t Kp, float *x_scale,
                   int threads) {
    quantize_rows_to(x, M, K, q, Kp, x_scale, 63, 0, threads);
}

/* 8 bits, offset by 128, for the vector units' int8 dot products alone (vpdpbusd does not
   saturate, AVX2's pairs would): int4_vnni.c's widened products */
void quantize_rows_8bit(const float *x, int64_t M, int64_t K, uint8_t *q, int64_t Kp,
                        float *x_scale, int threads) {
    quantize_rows_to(x, M, K, q, Kp, x_scale, 127, 0, threads);
}

/* int8_linear_wide's activations: each row's levels in [-WIDE_TOP, WIDE_TOP], signed (vpmaddwd
   multiplies signed words), zero past K */
void quantize_rows_wide(const float *x, int64_t M, int64_t K, int16_t *q, int64_t Kp,
                        float *x_scale, int threads) {
    quantize_rows_to(x, M, K, q, Kp, x_scale, WIDE_TOP, 1, threads);
}
