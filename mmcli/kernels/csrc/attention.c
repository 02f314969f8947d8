/* Attention in float32 on the CPU, built by kernels/cpu.py: out = softmax(q k^T / sqrt(d)) v for
   every head, without a mask (the vision tower's blocks) or causal (the decoder's prefill: query i
   of n sees the keys up to i + keys - n, after any cached ones), with `group` query heads sharing
   each key and value head (GQA).

   Each task is a key/value head (or a share of its queries where there are fewer heads than
   threads): its keys packed once, transposed, a panel of NR at a time, and its values copied
   together; then for each of its query heads and each block of QB queries their scores against
   the keys they see, a softmax over each row in place, the probabilities times the values, and
   each row divided by its sum. Both products run on float_tiles.h's tiles, or on bfloat16 pairs:
   AVX-512 BF16's dot products, or the AMX tiles where the build has them (docs/performance.md
   compares torch's CPU flash kernel on these shapes). */
#include <stdlib.h>

#include "float_tiles.h"
#if defined(__AMX_BF16__)
#include "amx_tiles.h"
#endif

/* the `products` attention() takes */
enum { FLOAT32_PRODUCTS, PAIR_PRODUCTS, TILE_PRODUCTS };

#define QB 96 /* queries per task: their scores against 1024 keys are 384 KiB, in L2 */

/* A tensor's layout: a row (position) every `row` floats, a head every `head` floats, d values
   contiguous. */
struct heads {
    const float *data;
    int64_t row, head;
};

/* panel[i][j] = k[key0 + j][i] for i < d, j < NR (keys past `keys`: zero). */
static void pack_keys(struct heads k, int64_t key0, int keys, int64_t d, float *panel) {
    const float *base = k.data + key0 * k.row;
    const int64_t whole = d / GL * GL;
    for (int64_t j0 = 0; j0 < NR; j0 += GL) {
        if (j0 + GL <= keys) {
            for (int64_t i0 = 0; i0 < whole; i0 += GL) {
                vec r[GL];
                for (int j = 0; j < GL; j++) r[j] = vload(base + (j0 + j) * k.row + i0);
                transpose(r);
                for (int i = 0; i < GL; i++) vstore(panel + (i0 + i) * NR + j0, r[i]);
            }
        } else {
            for (int64_t i = 0; i < whole; i++)
                for (int64_t j = j0; j < j0 + GL; j++)
                    panel[i * NR + j] = j < keys ? base[j * k.row + i] : 0.0f;
        }
    }
    for (int64_t i = whole; i < d; i++)
        for (int64_t j = 0; j < NR; j++) panel[i * NR + j] = j < keys ? base[j * k.row + i] : 0.0f;
}

/* The largest of a row's first n (>= 1) scores: four vectors of maxima, so that each vmax waits
   on the one four before it (one chain waited its latency on every vector: a sixth of the vision
   tower's attention outside its products on an AMX Xeon) */
static float row_largest(const float *row, int64_t n) {
    int64_t k = 0;
    vec top[4] = {vset(row[0]), vset(row[0]), vset(row[0]), vset(row[0])};
    for (; k + 4 * GL <= n; k += 4 * GL)
        for (int i = 0; i < 4; i++) top[i] = vmax(top[i], vload(row + k + i * GL));
    for (; k + GL <= n; k += GL) top[0] = vmax(top[0], vload(row + k));
    float largest = vlargest(vmax(vmax(top[0], top[1]), vmax(top[2], top[3])));
    for (; k < n; k++) largest = row[k] > largest ? row[k] : largest;
    return largest;
}

/* A row's first n scores -> e^(scale (s - max)) in place; returns 1 / their sum. */
static float softmax_row(float *row, int64_t n, float scale) {
    const float largest = row_largest(row, n);
    int64_t k;
    vec total = vzero(), shift = vset(largest), factor = vset(scale);
    for (k = 0; k + GL <= n; k += GL) {
        vec e = vexp(vmul(vsub(vload(row + k), shift), factor));
        vstore(row + k, e);
        total = vadd(total, e);
    }
    float sum = vsum(total);
    if (k < n) { /* the last, partial vector */
        lanes tail = first_lanes((int)(n - k));
        vstore_some(row + k, vexp(vmul(vsub(vload_some(row + k, tail), shift), factor)), tail);
        for (; k < n; k++) sum += row[k];
    }
    return 1.0f / sum;
}

/* Each of `rows` rows of s (`lds` apart): the softmax of its first min(seen + r, keys) scores,
   the rest up to `keys` zero (causal; seen >= keys: every score); 1 / each sum in inverse[r]. */
static void softmax_rows(float *s, int64_t lds, int64_t rows, int64_t keys, int64_t seen,
                         float scale, float *inverse) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * lds;
        const int64_t n = seen + r < keys ? seen + r : keys;
        for (int64_t k = n; k < keys; k++) row[k] = 0.0f;
        inverse[r] = softmax_row(row, n, scale);
    }
}

/* A head's keys and values, packed once for all its query blocks: keys transposed a panel of NR
   at a time (panels[p][i][j] = k[p NR + j][i]), values in chunks of NR channels (values[c][key][j]
   = v[key][c NR + j]); v's rows lie a page or more apart, copied together they are read from L2. */
static void pack_head(struct heads k, struct heads v, int64_t keys, int64_t d, int64_t d_pad,
                      float *panels, float *values) {
    for (int64_t key0 = 0; key0 < keys; key0 += NR)
        pack_keys(k, key0, keys - key0 < NR ? (int)(keys - key0) : NR, d, panels + key0 * d_pad);
    for (int64_t d0 = 0; d0 < d; d0 += NR) {
        const int width = d - d0 < NR ? (int)(d - d0) : NR;
        lanes some[GV];
        for (int j = 0; j < GV; j++) {
            int left = width - j * GL;
            some[j] = first_lanes(left < 0 ? 0 : left > GL ? GL : left);
        }
        float *chunk = values + d0 * keys;
        for (int64_t key = 0; key < keys; key++)
            for (int j = 0; j < GV; j++)
                vstore(chunk + key * NR + j * GL,
                       vload_some(v.data + key * v.row + d0 + j * GL, some[j]));
    }
}

/* One head's queries q0 .. q0 + rows, the first seeing `seen` keys and each next one more
   (seen >= keys: every query sees every key): scores, softmax, times v, each row scaled by 1 / its
   sum. `packed`: the keys packed (the values' chunk stride). */
static void attend_block(struct heads q, const float *panels, const float *values, float *out,
                         int64_t out_row, int64_t q0, int64_t rows, int64_t packed, int64_t seen,
                         int64_t d, int64_t d_pad, float *scores, int64_t lds, float *inverse) {
    const struct ends plain = {1, 1, NONE, 0};
    const float *queries = q.data + q0 * q.row;
    /* the keys the block's last query sees */
    const int64_t keys = seen + rows - 1 < packed ? seen + rows - 1 : packed;
    for (int64_t key0 = 0; key0 < keys; key0 += NR) {
        const int width = keys - key0 < NR ? (int)(keys - key0) : NR;
        panel_rows(queries, q.row, panels + key0 * d_pad, NR, d, scores + key0, lds, rows, plain,
                   width);
    }
    softmax_rows(scores, lds, rows, keys, seen, 1.0f / __builtin_sqrtf((float)d), inverse);
    float *o = out + q0 * out_row;
    for (int64_t d0 = 0; d0 < d; d0 += NR) {
        const int width = d - d0 < NR ? (int)(d - d0) : NR;
        panel_rows(scores, lds, values + d0 * packed, NR, keys, o + d0, out_row, rows, plain,
                   width);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) o[r * out_row + i] *= inverse[r];
}

/* A thread's scratch for the pairs: a head's keys (panels[p][i][j]: key p NR + j's pair i) and
   values (values[c][i][j]: keys 2i and 2i + 1 of channel c NR + j, zero past the keys up to
   PAIRS(keys) rows), a block's queries and probabilities as pairs, and NR keys' rows on their way
   into a panel; `tiles`: the products on the AMX tiles. */
struct pairs {
    uint32_t *panels, *values, *queries, *probabilities, *rows;
    int tiles;
};

#if defined(__AVX512BF16__)
/* bfloat16 products, for the runs whose products are bfloat16 (AVX-512 BF16's vdpbf16ps: 32
   products into 16 float32 lanes an instruction, twice the FMAs' rate): q, k, v and the
   probabilities rounded to nearest even on the way in, the sums, the softmax and the scaling in
   float32 as above. A pair is two bfloat16 in 32 bits, the lower the first, as vdpbf16ps takes
   them: a row rounded to bfloat16 is a row of pairs. */

#define PAIRS(n) (((n) + 31) / 32 * 16) /* pairs a row of n values takes, whole vectors */

/* n floats -> PAIRS(n) pairs at out, rounded to nearest even, zeros after n: whole vectors, then
   the masked rest (a mask made for every vector: the prompt's causal attention took 1.02-1.04x) */
static void round_pairs(const float *x, int64_t n, uint32_t *out) {
    uint16_t *half = (uint16_t *)out;
    int64_t i = 0;
    for (; i + GL <= n; i += GL)
        _mm256_storeu_si256((__m256i *)(half + i), (__m256i)_mm512_cvtneps_pbh(vload(x + i)));
    for (; i < 2 * PAIRS(n); i += GL) {
        const int64_t left = n - i;
        const __m512 v = vload_some(x + i, first_lanes(left < 0 ? 0 : (int)left));
        _mm256_storeu_si256((__m256i *)(half + i), (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* softmax_rows with the probabilities rounded to pairs as they are made (out, PAIRS(keys) pairs a
   row, o_pairs apart; zeros past each row's keys): e^(scale (s - max)), as 2^(scale log2(e)
   (s - max)), summed in float32. */
static void softmax_pair_rows(const float *s, int64_t lds, int64_t rows, int64_t keys, int64_t seen,
                              float scale, uint32_t *out, int64_t o_pairs, float *inverse) {
    const float base2 = scale * 1.44269504088896341f;
    const vec factor = vset(base2);
    for (int64_t r = 0; r < rows; r++) {
        const float *row = s + r * lds;
        const int64_t n = seen + r < keys ? seen + r : keys, whole = n / GL * GL;
        const lanes tail = first_lanes((int)(n - whole));
        const vec shift = vset(-row_largest(row, n) * base2);
        vec total = vzero();
        __m256i *half = (__m256i *)(out + r * o_pairs);
        int64_t k = 0;
        for (; k < whole; k += GL) {
            const vec e = vexp2_softmax(vfma(vload(row + k), factor, shift));
            total = vadd(total, e);
            _mm256_storeu_si256(half++, (__m256i)_mm512_cvtneps_pbh(e));
        }
        if (k < n) {
            const vec e =
                _mm512_maskz_mov_ps(tail, vexp2_softmax(vfma(vload(row + k), factor, shift)));
            total = vadd(total, e);
            _mm256_storeu_si256(half++, (__m256i)_mm512_cvtneps_pbh(e));
            k += GL;
        }
        for (; k < 2 * PAIRS(keys); k += GL) _mm256_storeu_si256(half++, _mm256_setzero_si256());
        inverse[r] = 1.0f / vsum(total);
    }
}

/* y (M rows, ldy apart) = x (M rows of kc pairs, ldx pairs apart) times the panel's pairs (kc
   rows of NR channels, ldp pairs apart), for the panel's first `channels`. */
static inline __attribute__((always_inline)) void pair_tile(const uint32_t *x, int64_t ldx,
                                                            const uint32_t *panel, int64_t ldp,
                                                            int64_t kc, float *y, int64_t ldy,
                                                            int mr, int channels) {
    __m512 acc[GR][GV];
    lanes some[GV];
    for (int j = 0; j < GV; j++) {
        const int left = channels - j * GL;
        some[j] = first_lanes(left < 0 ? 0 : left > GL ? GL : left);
        for (int m = 0; m < mr; m++) acc[m][j] = vzero();
    }
    for (int64_t k = 0; k < kc; k++) {
        __m512bh b[GV];
        for (int j = 0; j < GV; j++)
            b[j] = (__m512bh)_mm512_maskz_loadu_epi32(some[j], panel + k * ldp + j * GL);
        for (int m = 0; m < mr; m++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x[m * ldx + k]);
            for (int j = 0; j < GV; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, b[j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < GV; j++) vstore_some(y + m * ldy + j * GL, acc[m][j], some[j]);
}

/* Every row of y (M rows) for one panel: GR rows at a time, each row count its own loop. */
static void pair_rows(const uint32_t *x, int64_t ldx, const uint32_t *panel, int64_t ldp,
                      int64_t kc, float *y, int64_t ldy, int64_t M, int channels) {
    for (int64_t m = 0; m < M; m += GR) {
        const uint32_t *xm = x + m * ldx;
        float *ym = y + m * ldy;
        switch (M - m < GR ? (int)(M - m) : GR) {
        case 1: pair_tile(xm, ldx, panel, ldp, kc, ym, ldy, 1, channels); break;
        case 2: pair_tile(xm, ldx, panel, ldp, kc, ym, ldy, 2, channels); break;
        case 3: pair_tile(xm, ldx, panel, ldp, kc, ym, ldy, 3, channels); break;
        case 4: pair_tile(xm, ldx, panel, ldp, kc, ym, ldy, 4, channels); break;
        case 5: pair_tile(xm, ldx, panel, ldp, kc, ym, ldy, 5, channels); break;
        default: pair_tile(xm, ldx, panel, ldp, kc, ym, ldy, GR, channels);
        }
    }
}

#if defined(__AMX_BF16__)
#if NR != 64
#error "a panel of NR channels is four tiles of 16"
#endif

/* 16 rows of x (kc pairs, ldx apart; kc a multiple of 16) times the panel (kc rows of NR pairs,
   ldp apart) into tmm0-3, the 16 rows' sums for the panel's four tiles of 16 channels: tmm4 the
   rows' pairs, tmm5-7 the panel's. */
static void tile_block(const uint32_t *x, int64_t ldx, const uint32_t *panel, int64_t ldp,
                       int64_t kc) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < kc; k += 16) {
        const uint32_t *b = panel + k * ldp;
        _tile_loadd(4, x + k, ldx * 4);
        _tile_loadd(5, b, ldp * 4);
        _tile_loadd(6, b + 16, ldp * 4);
        _tile_loadd(7, b + 32, ldp * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, b + 48, ldp * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 4, 5);
    }
}

/* pair_rows on the tiles (tdpbf16ps: 16 x 16 x 32 products an instruction): kc a multiple of 16,
   x readable to a multiple of 16 rows (rows past M computed, not stored). Whole blocks of 16 rows
   and channels are stored from the tiles, the rest through `spill`. */
static void tile_rows(const uint32_t *x, int64_t ldx, const uint32_t *panel, int64_t ldp,
                      int64_t kc, float *y, int64_t ldy, int64_t M, int channels) {
    float spill[16 * NR] __attribute__((aligned(64)));
    for (int64_t m = 0; m < M; m += 16) {
        tile_block(x + m * ldx, ldx, panel, ldp, kc);
        float *ym = y + m * ldy;
        const int64_t stride = ldy * 4;
        if (M - m >= 16 && channels % 16 == 0) {
            if (channels > 0) _tile_stored(0, ym, stride);
            if (channels > 16) _tile_stored(1, ym + 16, stride);
            if (channels > 32) _tile_stored(2, ym + 32, stride);
            if (channels > 48) _tile_stored(3, ym + 48, stride);
            continue;
        }
        _tile_stored(0, spill, NR * 4);
        _tile_stored(1, spill + 16, NR * 4);
        _tile_stored(2, spill + 32, NR * 4);
        _tile_stored(3, spill + 48, NR * 4);
        for (int64_t r = 0; r < 16 && m + r < M; r++)
            for (int j = 0; j < channels; j += GL) {
                const lanes some = first_lanes(channels - j > GL ? GL : channels - j);
                vstore_some(ym + r * ldy + j, vload(spill + r * NR + j), some);
            }
    }
}

/* Every thread's tiles: 16 rows of 64 bytes. */
static void configure_attention_tiles(void) {
    const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    configure_tiles(rows);
}
#endif

/* pair_rows, on the tiles where `tiles` (kc then a multiple of 16, x's rows readable to one) */
static void products_of_pairs(int tiles, const uint32_t *x, int64_t ldx, const uint32_t *panel,
                              int64_t ldp, int64_t kc, float *y, int64_t ldy, int64_t M,
                              int channels) {
#if defined(__AMX_BF16__)
    if (tiles) {
        tile_rows(x, ldx, panel, ldp, kc, y, ldy, M, channels);
        return;
    }
#endif
    (void)tiles;
    pair_rows(x, ldx, panel, ldp, kc, y, ldy, M, channels);
}

/* keys [key0, key0 + NR) (past `keys`: zero) -> panel[i][j] = key key0 + j's pair i */
static void pack_key_pairs(struct heads k, int64_t key0, int64_t keys, int64_t d, uint32_t *rows,
                           uint32_t *panel) {
    const int64_t pairs = PAIRS(d);
    for (int64_t j = 0; j < NR; j++)
        round_pairs(k.data + (key0 + j) * k.row, key0 + j < keys ? d : 0, rows + j * pairs);
    for (int64_t j0 = 0; j0 < NR; j0 += GL)
        for (int64_t i0 = 0; i0 < pairs; i0 += GL) {
            vec r[GL];
            for (int j = 0; j < GL; j++) r[j] = vload((const float *)rows + (j0 + j) * pairs + i0);
            transpose(r); /* the pairs' bits moved whole, as floats */
            for (int i = 0; i < GL; i++) vstore((float *)panel + (i0 + i) * NR + j0, r[i]);
        }
}

/* values' channels [c0, c0 + NR) of keys 2i and 2i + 1 (past `keys`: zero) -> chunk[i][j] */
static void pack_value_pairs(struct heads v, int64_t keys, int64_t d, int64_t c0, uint32_t *chunk) {
    /* lane j of the result: the first row's channel j, then the second's */
    const __m512i interleave =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t i = 0; i < PAIRS(keys); i++)
        for (int64_t j = 0; j < NR; j += GL) {
            const int64_t left = d - c0 - j;
            const lanes some = first_lanes(left < 0 ? 0 : left > GL ? GL : (int)left);
            const lanes first = 2 * i < keys ? some : 0, second = 2 * i + 1 < keys ? some : 0;
            const __m512 a = vload_some(v.data + 2 * i * v.row + c0 + j, first);
            const __m512 b = vload_some(v.data + (2 * i + 1) * v.row + c0 + j, second);
            const __m512i both =
                _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(a)),
                                   (__m256i)_mm512_cvtneps_pbh(b), 1);
            _mm512_storeu_si512(chunk + i * NR + j, _mm512_permutexvar_epi16(interleave, both));
        }
}

static void pack_head_pairs(struct heads k, struct heads v, int64_t keys, int64_t d,
                            struct pairs *s) {
    for (int64_t key0 = 0; key0 < keys; key0 += NR)
        pack_key_pairs(k, key0, keys, d, s->rows, s->panels + key0 * PAIRS(d));
    for (int64_t c0 = 0; c0 < d; c0 += NR)
        pack_value_pairs(v, keys, d, c0, s->values + c0 * PAIRS(keys));
}

/* attend_block on the pairs: the block's queries rounded, their scores, the softmax, the
   probabilities rounded, times the values. */
static void attend_block_pairs(struct heads q, const struct pairs *s, float *out, int64_t out_row,
                               int64_t q0, int64_t rows, int64_t packed, int64_t seen, int64_t d,
                               float *scores, int64_t lds, float *inverse) {
    const int64_t pairs = PAIRS(d), keys = seen + rows - 1 < packed ? seen + rows - 1 : packed;
    const int64_t p_pairs = PAIRS(lds);
    for (int64_t r = 0; r < rows; r++)
        round_pairs(q.data + (q0 + r) * q.row, d, s->queries + r * pairs);
    for (int64_t key0 = 0; key0 < keys; key0 += NR) {
        const int width = keys - key0 < NR ? (int)(keys - key0) : NR;
        products_of_pairs(s->tiles, s->queries, pairs, s->panels + key0 * pairs, NR, pairs,
                          scores + key0, lds, rows, width);
    }
    softmax_pair_rows(scores, lds, rows, keys, seen, 1.0f / __builtin_sqrtf((float)d),
                      s->probabilities, p_pairs, inverse);
    float *o = out + q0 * out_row;
    for (int64_t c0 = 0; c0 < d; c0 += NR) {
        const int width = d - c0 < NR ? (int)(d - c0) : NR;
        /* the tiles take whole tiles of pairs: the probabilities and values are zero past keys */
        const int64_t kc = s->tiles ? PAIRS(keys) : (keys + 1) / 2;
        products_of_pairs(s->tiles, s->probabilities, p_pairs, s->values + c0 * PAIRS(packed), NR,
                          kc, o + c0, out_row, rows, width);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) o[r * out_row + i] *= inverse[r];
}
#endif

/* A thread's scratch: the scores of a block, and its head's keys and values packed as floats,
   or (bf16) as pairs; NULL members where an allocation failed. */
struct scratch {
    float *scores, *panels, *values;
    struct pairs pairs;
};

static int allocate(struct scratch *s, int64_t keys, int64_t d, int64_t lds, int bf16) {
    const int64_t key_rows = (keys + NR - 1) / NR * NR, chunks = (d + NR - 1) / NR;
    *s = (struct scratch){aligned_alloc(64, sizeof(float) * QB * lds), NULL, NULL, {0}};
    if (!bf16) {
        s->panels = aligned_alloc(64, sizeof(float) * key_rows * ((d + GL - 1) / GL * GL));
        s->values = aligned_alloc(64, sizeof(float) * chunks * NR * keys);
        return s->scores && s->panels && s->values;
    }
#if defined(__AVX512BF16__)
    const int64_t pairs = PAIRS(d);
    struct pairs *p = &s->pairs;
    p->panels = aligned_alloc(64, 4 * key_rows * pairs);
    p->values = aligned_alloc(64, 4 * chunks * NR * PAIRS(keys));
    p->queries = aligned_alloc(64, 4 * QB * pairs);
    p->probabilities = aligned_alloc(64, 4 * QB * PAIRS(lds));
    p->rows = aligned_alloc(64, 4 * NR * pairs);
    return s->scores && p->panels && p->values && p->queries && p->probabilities && p->rows;
#else
    return 0;
#endif
}

static void release(struct scratch *s) {
    free(s->scores);
    free(s->panels);
    free(s->values);
#if defined(__AVX512BF16__)
    free(s->pairs.panels);
    free(s->pairs.values);
    free(s->pairs.queries);
    free(s->pairs.probabilities);
    free(s->pairs.rows);
#endif
}

/* One task's blocks [first, last) of each of its `group` query heads (head h0 on). */
static void attend_heads(struct heads q, int64_t h0, int64_t group, const struct scratch *s,
                         float *out, int64_t out_row, int64_t first, int64_t last, int64_t queries,
                         int64_t keys, int causal, int64_t d, int64_t d_pad, int64_t lds,
                         int bf16) {
    float inverse[QB];
    (void)bf16; /* read only where this build has the pairs */
    for (int64_t h = h0; h < h0 + group; h++) {
        const struct heads qh = {q.data + h * q.head, q.row, q.head};
        for (int64_t b = first; b < last; b++) {
            const int64_t q0 = b * QB, rows = queries - q0 < QB ? queries - q0 : QB;
            const int64_t seen = causal ? keys - queries + q0 + 1 : keys;
#if defined(__AVX512BF16__)
            if (bf16) {
                attend_block_pairs(qh, &s->pairs, out + h * d, out_row, q0, rows, keys, seen, d,
                                   s->scores, lds, inverse);
                continue;
            }
#endif
            attend_block(qh, s->panels, s->values, out + h * d, out_row, q0, rows, keys, seen, d,
                         d_pad, s->scores, lds, inverse);
        }
    }
}

/* out (queries x heads x d, a row every out_row floats, a head every d) for q (queries positions,
   `heads` heads), k and v (keys positions, heads / group heads), each given by its data, row
   stride and head stride; causal: query i sees keys up to i + keys - queries; `products`: in
   float32, on bfloat16 pairs or on the AMX tiles (where this build has them). Returns 0, -1 where
   a thread's scratch could not be allocated (out is then incomplete), -2 where the products are
   not this build's, -3 where Linux did not grant the tiles. */
int attention(const float *q, int64_t q_row, int64_t q_head, const float *k, int64_t k_row,
              int64_t k_head, const float *v, int64_t v_row, int64_t v_head, float *out,
              int64_t out_row, int64_t queries, int64_t keys, int64_t heads, int64_t group,
              int causal, int64_t d, int products, int threads) {
    const int bf16 = products != FLOAT32_PRODUCTS, tiles = products == TILE_PRODUCTS;
#if !defined(__AVX512BF16__)
    if (bf16) return -2;
#endif
#if defined(__AMX_BF16__)
    if (tiles && amx_request()) return -3;
#else
    if (tiles) return -2;
#endif
    const int64_t lds = (keys + GL - 1) / GL * GL, d_pad = (d + GL - 1) / GL * GL;
    const int64_t blocks = (queries + QB - 1) / QB, kv_heads = heads / group;
    /* a task is a key/value head's share of its query blocks: every thread busy when there are
       fewer of those heads than threads */
    const int64_t shares = kv_heads >= threads ? 1 : (threads + kv_heads - 1) / kv_heads;
    const int64_t per_share = (blocks + shares - 1) / shares;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        struct scratch s;
        failed = !allocate(&s, keys, d, lds, bf16);
        s.pairs.tiles = tiles;
#if defined(__AMX_BF16__)
        if (tiles) configure_attention_tiles();
#endif
/* one task at a time to whichever thread is free, as bf16_linear.c shares out its rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < kv_heads * shares; t++) {
            const int64_t g = t / shares, first = (t % shares) * per_share;
            if (failed || first >= blocks) continue;
            const int64_t last = first + per_share < blocks ? first + per_share : blocks;
            struct heads kh = {k + g * k_head, k_row, k_head}, vh = {v + g * v_head, v_row, v_head};
#if defined(__AVX512BF16__)
            if (bf16)
                pack_head_pairs(kh, vh, keys, d, &s.pairs);
            else
#endif
                pack_head(kh, vh, keys, d, d_pad, s.panels, s.values);
            const struct heads qs = {q, q_row, q_head};
            attend_heads(qs, g * group, group, &s, out, out_row, first, last, queries, keys, causal,
                         d, d_pad, lds, bf16);
        }
        release(&s);
#if defined(__AMX_BF16__)
        if (tiles) _tile_release(); /* as amx.c's kernels: the thread's tile state given back */
#endif
    }
    return failed ? -1 : 0;
}
