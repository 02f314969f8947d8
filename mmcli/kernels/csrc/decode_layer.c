/* A decode step (one token of each of a few sequences) through a Qwen3 attention layer with
   bfloat16 or int8 weights and float32 arithmetic, built by kernels/cpu.py: the same operations as
   the decoder's DecoderLayer (the norms, q/k/v, the q/k norms, the rotary, the cache write,
   attention over each row's own context, o, the MLP, both residual adds) in one call. A step's
   weight reads are bf16_linear's, amx.c's or int8_linear's; what this saves is the two dozen
   tensor operations around them, each of which costs more to dispatch than to compute for a few
   tokens (and runs slower still after a weight read has flushed the caches), and the batched
   step's copy of every row's context. */
#include <stdlib.h>
#include <string.h>

#include "float_tiles.h"

void bf16_pairs(const float *x, float *pairs, int64_t M, int64_t K);
void bf16_linear(const float *pairs, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                 int threads);
void rms_norm(const float *x, int64_t ld, const float *w, float *out, int64_t rows, int64_t width,
              float eps, int threads);
void rotary(const float *x, int64_t x_row, int64_t x_head, float *out, int64_t rows, int64_t heads,
            int64_t d, const float *cos, const float *sin, int64_t rot, int threads);
void silu_times(float *gate, const float *up, int64_t n, int threads);
int amx_bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int split, int threads);
int bf16_dot_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int split, int threads);
void quantize_rows(const float *x, int64_t M, int64_t K, uint8_t *q, int64_t Kp, float *x_scale,
                   int threads);
void int8_linear(const uint8_t *x, const float *x_scale, const int8_t *w, const int32_t *w_sum,
                 const float *w_scale, const float *bias, float *y, int64_t M, int64_t Np,
                 int64_t Kp, int64_t vnni_rows, int act, int threads);
void int4_quantize_rows(const float *x, int64_t rows, int64_t K, int8_t *xq, float *scales,
                        int32_t *sums, int threads);
int int4_vnni_products(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                       const uint8_t *packed, const uint16_t *scales_zeros, int blocks, float *y,
                       int64_t M, int64_t N, int64_t K, int threads);
int int4_tile_products(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                       const uint8_t *packed, const uint16_t *scales_zeros, int blocks, float *y,
                       int64_t M, int64_t N, int64_t K, int threads);

/* A linear's weights (out x in): bfloat16 bits as loaded; int8 in int8_linear.c's layout with
   each output channel's sum of values, scale and bias; or int4 (values) with its scales and zeros
   (scales_zeros), in torch's CPU layout or in the blocks form where int4_blocks is set
   (int4_vnni.c); the fields a form has not are NULL (zero). */
struct decode_matrix {
    const void *values;
    const int32_t *sums;
    const float *scale, *bias;
    const uint16_t *scales_zeros;
    int64_t int4_blocks;
};

/* A layer's weights (the norms float32) and sizes, set once by cpu.DecodeLayer. */
struct decode_layer {
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    struct decode_matrix q, k, v, o, gate, up, down;
    int64_t hidden, heads, kv_heads, d, intermediate;
    float eps;
    int32_t bf16_products;  /* bfloat16 products (the run's precision has them): AMX, BF16 */
    int32_t int8;           /* int8 weights: each product's rows quantized a row at a time */
    int64_t vnni_rows;      /* int8_linear's: the AMX build's tiles above this many rows */
    int32_t int4;           /* int4 weights: int4_vnni_products (set where the build has it) */
    int64_t int4_vnni_rows; /* int4's: the AMX build's tiles above this many rows */
};

/* A product's input rows: float32, and their form made once for the products that share them
   (q, k and v; gate and up): for int8 weights a row's levels and scale (quantize_rows), for int4
   each group's levels, scale and sum (int4_quantize_rows), for bfloat16 ones on bf16_linear the
   rows in pairs' order (bf16_pairs, in the levels' room). */
struct rows_in {
    const float *x;
    uint8_t *levels;
    float *scale;
    int32_t *group_sums;
};

static void take_rows(const struct decode_layer *l, struct rows_in *in, const float *x, int64_t M,
                      int64_t K, int threads) {
    in->x = x;
    if (l->int8) quantize_rows(x, M, K, in->levels, K, in->scale, threads);
    if (l->int4)
        int4_quantize_rows(x, M, K, (int8_t *)in->levels, in->scale, in->group_sums, threads);
    /* bfloat16 products take x as it is; their tiles' rare refusals make pairs (linear) */
    if (!l->int8 && !l->int4 && !l->bf16_products) bf16_pairs(x, (float *)in->levels, M, K);
}

/* int4's products on the vector units' int8 dot products, or above int4_vnni_rows rows the AMX
   build's tiles (the same floats; where the tiles are not granted, the vector units) */
static int int4_products(const struct decode_layer *l, const struct rows_in *in,
                         const struct decode_matrix *w, float *y, int64_t M, int64_t N, int64_t K,
                         int threads) {
    const int8_t *levels = (const int8_t *)in->levels;
#ifdef __AMX_INT8__
    if (M > l->int4_vnni_rows &&
        !int4_tile_products(levels, in->scale, in->group_sums, w->values, w->scales_zeros,
                            (int)w->int4_blocks, y, M, N, K, threads))
        return 0;
#endif
    return int4_vnni_products(levels, in->scale, in->group_sums, w->values, w->scales_zeros,
                              (int)w->int4_blocks, y, M, N, K, threads);
}

/* The step's products: int8 on int8_linear; int4 on int4_products; bfloat16 where the
   layer asks for them, on the AMX tiles where this build has them, else on AVX-512 BF16's dot
   products (at every row count: both sum each row alone, so a sequence's logits do not depend on
   how many share its step); else bf16_linear's float32 FMAs. */
static void linear(const struct decode_layer *l, const struct rows_in *in,
                   const struct decode_matrix *w, float *y, int64_t M, int64_t N, int64_t K,
                   int threads) {
    if (l->int8) {
        int8_linear(in->levels, in->scale, w->values, w->sums, w->scale, w->bias, y, M, N, K,
                    l->vnni_rows, NONE, threads);
        return;
    }
    if (l->int4 && !int4_products(l, in, w, y, M, N, K, threads)) return;
#ifdef __AMX_BF16__
    if (l->bf16_products && !amx_bf16_linear(in->x, w->values, y, M, N, K, 0, threads)) return;
#endif
#ifdef __AVX512BF16__
    if (l->bf16_products && !bf16_dot_linear(in->x, w->values, y, M, N, K, 0, threads)) return;
#endif
    if (l->bf16_products) bf16_pairs(in->x, (float *)in->levels, M, K);
    bf16_linear((const float *)in->levels, w->values, y, M, N, K, threads);
}

/* The KV cache holds float32, or bfloat16 where the run's products are bfloat16 (half the bytes
   a step reads over its context). `bf16` is a constant where these are inlined, so each form
   has its own loops. Element `at` of a cache: */
static inline void *kv_element(void *cache, int64_t at, int bf16) {
    return (char *)cache + at * (bf16 ? 2 : 4);
}

/* GL values of a cache row from element i, widened exactly */
static inline vec kv_load(const void *p, int64_t i, const int bf16) {
    return bf16 ? widen((const uint16_t *)p + i) : vload((const float *)p + i);
}

static inline float kv_at(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* q (d floats) . the cache row's d values from element `at` */
static inline float kv_dot(const float *q, const void *k, int64_t at, int64_t d, const int bf16) {
    vec sum = vzero();
    int64_t i = 0;
    for (; i + GL <= d; i += GL) sum = vfma(vload(q + i), kv_load(k, at + i, bf16), sum);
    float total = vsum(sum);
    for (; i < d; i++) total += q[i] * kv_at(k, at + i, bf16);
    return total;
}

/* s[j] <- e^(s[j] - the largest), for the first n; returns their sum */
static float exp_scores(float *s, int64_t n) {
    float largest = -__builtin_inff();
    for (int64_t j = 0; j < n; j++) largest = s[j] > largest ? s[j] : largest;
    float total = 0.0f;
    int64_t j = 0;
    for (; j + GL <= n; j += GL) {
        vec e = vexp(vsub(vload(s + j), vset(largest)));
        vstore(s + j, e);
        total += vsum(e);
    }
    if (j < n) {
        lanes tail = first_lanes((int)(n - j));
        vec e = vexp(vsub(vload_some(s + j, tail), vset(largest)));
        vstore_some(s + j, e, tail);
        for (; j < n; j++) total += s[j];
    }
    return total;
}

/* out[d] = softmax(q k^T / sqrt(d)) v over the first n rows of k and v (a row every d values);
   `scores` holds n floats. Any d. */
static inline __attribute__((always_inline)) void attend_head(const float *q, const void *k,
                                                              const void *v, int64_t n, int64_t d,
                                                              float *scores, float *out,
                                                              const int bf16) {
    const float scale = 1.0f / __builtin_sqrtf((float)d);
    for (int64_t j = 0; j < n; j++) scores[j] = kv_dot(q, k, j * d, d, bf16) * scale;
    const float inverse = 1.0f / exp_scores(scores, n);
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const vec p = vset(scores[j]);
        int64_t i = 0;
        for (; i + GL <= d; i += GL)
            vstore(out + i, vfma(p, kv_load(v, j * d + i, bf16), vload(out + i)));
        for (; i < d; i++) out[i] += scores[j] * kv_at(v, j * d + i, bf16);
    }
    for (int64_t i = 0; i < d; i++) out[i] *= inverse;
}

#if defined(__AVX512F__)
/* Vector c of a cache row's d values. float32: its c-th 16. bfloat16: from the 32 values a load
   brings, the even ones (c even) or the odd ones (c odd), each widened by one operation (no
   conversion of 16 values to 32 bits a vector): the queries and the outputs are held in that
   order (to_kv_order, from_kv_order). */
static inline vec kv_vector(const void *row, int c, const int bf16) {
    if (!bf16) return vload((const float *)row + c * GL);
    const vec pairs = _mm512_loadu_ps((const uint16_t *)row + (c / 2) * 32);
    return c % 2 ? high_bf16(pairs) : low_bf16(pairs);
}

/* q's vector c in kv_vector's order */
static inline vec to_kv_order(const float *q, int c, const int bf16) {
    if (!bf16) return vload(q + c * GL);
    const __m512i even =
        _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i pick = _mm512_add_epi32(even, _mm512_set1_epi32(c % 2));
    return _mm512_permutex2var_ps(vload(q + (c / 2) * 32), pick, vload(q + (c / 2) * 32 + 16));
}

/* outputs in kv_vector's order (a[c]) into out, in order */
static inline void from_kv_order(const vec *a, int NV, vec scale, float *out, const int bf16) {
    if (!bf16) {
        for (int c = 0; c < NV; c++) vstore(out + c * GL, vmul(a[c], scale));
        return;
    }
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int c = 0; c < NV; c += 2) {
        vstore(out + c * GL, vmul(_mm512_permutex2var_ps(a[c], low, a[c + 1]), scale));
        vstore(out + (c + 1) * GL, vmul(_mm512_permutex2var_ps(a[c], high, a[c + 1]), scale));
    }
}

/* Rows of keys and values fetched ahead of their use: a bfloat16 cache's attention at 8 and 32
   rows 10% and 15% faster with them on an AMX Xeon (a float32 cache's the same; no change from
   16 rows ahead to 64). Into L2 (T2): fetched into L1 (T0) they filled its fill buffers, and the
   loop waited on its own prefetches (most of its samples under perf on that Xeon) */
#define AHEAD 32

/* Row `row` of k's n rows and then v's (d values each) into the cache, where there is one */
static inline __attribute__((always_inline)) void
fetch_row(const void *k, const void *v, int64_t row, int64_t n, int64_t d, const int bf16) {
    if (row >= 2 * n) return;
    const char *at =
        row < n ? kv_element((void *)k, row * d, bf16) : kv_element((void *)v, (row - n) * d, bf16);
    for (int64_t line = 0; line < d * (bf16 ? 2 : 4); line += 64)
        _mm_prefetch(at + line, _MM_HINT_T2);
}

/* attend_head for G query heads (d apart in q, out and n apart in scores) of d = NV vectors
   against the one key/value head they share, G * NV <= 16: each key and value is read once for
   the G heads, the queries and the outputs stay in registers, and the scores of 16 keys are
   summed across their lanes by one tree (sum16). The loads were the bound: a dot product that
   loads its query for every key, and an output read and written back for every value, ran at
   2.5x the FMAs' time on a Zen 4. */
static inline __attribute__((always_inline)) void
attend_heads(const float *q, const void *k, const void *v, int64_t n, float *scores, float *out,
             const int NV, const int G, const int bf16) {
    const int64_t d = NV * GL;
    const float scale = 1.0f / __builtin_sqrtf((float)d);
    vec qv[16], acc[16];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < NV; c++) qv[h * NV + c] = to_kv_order(q + h * d, c, bf16);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        vec a[2][16];
        for (int t = 0; t < 16; t++) {
            const void *key = kv_element((void *)k, (j + t) * d, bf16);
            fetch_row(k, v, j + t + AHEAD, n, d, bf16); /* past the keys: the first values */
            for (int h = 0; h < G; h++) {
                vec sum = vzero();
                for (int c = 0; c < NV; c++)
                    sum = vfma(qv[h * NV + c], kv_vector(key, c, bf16), sum);
                a[h][t] = sum;
            }
        }
        for (int h = 0; h < G; h++) vstore(scores + h * n + j, vmul(sum16(a[h]), vset(scale)));
    }
    for (; j < n; j++)
        for (int h = 0; h < G; h++)
            scores[h * n + j] = kv_dot(q + h * d, k, j * d, d, bf16) * scale;
    float inverse[2];
    for (int h = 0; h < G; h++) inverse[h] = 1.0f / exp_scores(scores + h * n, n);
    for (int i = 0; i < G * NV; i++) acc[i] = vzero();
    for (j = 0; j < n; j++) {
        const void *value = kv_element((void *)v, j * d, bf16);
        fetch_row(k, v, n + j + AHEAD, n, d, bf16);
        for (int h = 0; h < G; h++) {
            const vec p = vset(scores[h * n + j]);
            for (int c = 0; c < NV; c++)
                acc[h * NV + c] = vfma(p, kv_vector(value, c, bf16), acc[h * NV + c]);
        }
    }
    for (int h = 0; h < G; h++)
        from_kv_order(acc + h * NV, NV, vset(inverse[h]), out + h * d, bf16);
}
#else
/* The lane sums of 8 vectors as one vector, each by vsum's tree (kv_dot's bits) */
static inline vec sum8(const vec a[8]) {
    vec b[4];
    for (int t = 0; t < 4; t++)
        b[t] = vadd(_mm256_permute2f128_ps(a[t], a[t + 4], 0x20),
                    _mm256_permute2f128_ps(a[t], a[t + 4], 0x31));
    const vec z1 = vadd(_mm256_unpacklo_ps(b[0], b[1]), _mm256_unpackhi_ps(b[0], b[1]));
    const vec z2 = vadd(_mm256_unpacklo_ps(b[2], b[3]), _mm256_unpackhi_ps(b[2], b[3]));
    return vadd(_mm256_shuffle_ps(z1, z2, 0x44), _mm256_shuffle_ps(z1, z2, 0xEE));
}

/* 2 GL values of a cache row from element i, as two vectors. float32: in order. bfloat16: one load
   of 2 GL values, the even ones and the odd ones each widened by one operation, half the
   operations of widening GL in order (the attention alone over a bfloat16 cache, 8 and 32 rows
   of 300 and 1,000 columns: 1.1-1.2x as fast on a 2-core Zen 3); the queries and the outputs are
   held in that order (bf16_pairs makes it, from_kv_pairs undoes it). */
static inline void kv_pair(const void *row, int64_t i, vec *first, vec *second, const int bf16) {
    if (!bf16) {
        *first = vload((const float *)row + i), *second = vload((const float *)row + i + GL);
        return;
    }
    const vec pairs = vload((const float *)((const uint16_t *)row + i));
    *first = low_bf16(pairs), *second = high_bf16(pairs);
}

/* n values in kv_pair's order back in order, each times `scale` */
static void from_kv_pairs(float *out, int64_t n, float scale, const int bf16) {
    const vec s = vset(scale);
    for (int64_t i = 0; i < n; i += 2 * GL) {
        const vec even = vload(out + i), odd = vload(out + i + GL);
        if (!bf16) {
            vstore(out + i, vmul(even, s)), vstore(out + i + GL, vmul(odd, s));
            continue;
        }
        const vec low = _mm256_unpacklo_ps(even, odd), high = _mm256_unpackhi_ps(even, odd);
        vstore(out + i, vmul(_mm256_permute2f128_ps(low, high, 0x20), s));
        vstore(out + i + GL, vmul(_mm256_permute2f128_ps(low, high, 0x31), s));
    }
}

/* q (in kv_pair's order) . the cache row's d values from element `at`: kv_dot's sum in that
   order, the bits of the tiles' sums (sum8 is vsum's tree) */
static inline float kv_dot_pairs(const float *q, const void *k, int64_t at, int64_t d,
                                 const int bf16) {
    vec sum = vzero();
    for (int64_t c = 0; c < d; c += 2 * GL) {
        vec first, second;
        kv_pair(k, at + c, &first, &second, bf16);
        sum = vfma(vload(q + c), first, sum);
        sum = vfma(vload(q + c + GL), second, sum);
    }
    return vsum(sum);
}

/* out[c:c+NV GL] of a head (in kv_pair's order) += its probabilities times `count` value rows'
   vectors from `c`, the outputs held in registers over those rows */
static inline __attribute__((always_inline)) void add_values(const float *p, const void *v,
                                                             int64_t count, int64_t d, int64_t c,
                                                             float *out, const int NV,
                                                             const int bf16) {
    vec acc[8];
    for (int i = 0; i < NV; i++) acc[i] = vload(out + c + i * GL);
    for (int64_t j = 0; j < count; j++) {
        const vec pj = vset(p[j]);
        for (int i = 0; i < NV; i += 2) {
            vec first, second;
            kv_pair(v, j * d + c + i * GL, &first, &second, bf16);
            acc[i] = vfma(pj, first, acc[i]);
            acc[i + 1] = vfma(pj, second, acc[i + 1]);
        }
    }
    for (int i = 0; i < NV; i++) vstore(out + c + i * GL, acc[i]);
}

/* value rows a block (16 KiB of float32 at d = 128, read from memory once for every head), and
   query heads a call at most */
#define VALUE_ROWS 32
#define GROUP 8
#define MAX_D 256 /* the head sizes a group's queries in kv_pair's order hold: Qwen's 64-256 */

/* Scores of H = 1 or 2 heads (q in kv_pair's order, d apart; n apart in scores) against 8 / H
   keys at a time from key j on: 8 chains of FMAs (one key's chain waits on each FMA's latency),
   and each key's vectors loaded once for both heads of a pair, 6 loads every 8 FMAs where one
   head against 8 keys loads 9 (a float32 cache; a bfloat16 one's load makes two vectors). A
   step's attention over a float32 cache, 8 and 32 rows of 300 and 1,000 columns, 16 heads on 8:
   heads in pairs 1.09-1.25x as fast, 1.2-1.4x a stream of the cache where it was 1.4-1.7x (a
   2-core Zen 3). kv_dot_pairs' sums in its order (its bits). */
static inline __attribute__((always_inline)) void score_heads(const float *q, const void *k,
                                                              int64_t n, int64_t d, float scale,
                                                              float *scores, const int H,
                                                              const int bf16) {
    const int keys = 8 / H;
    int64_t j = 0;
    for (; j + keys <= n; j += keys) {
        vec a[8], qv[2][2];
        for (int t = 0; t < 8; t++) a[t] = vzero();
        for (int64_t c = 0; c < d; c += 2 * GL) {
            for (int h = 0; h < H; h++)
                qv[h][0] = vload(q + h * d + c), qv[h][1] = vload(q + h * d + c + GL);
            for (int t = 0; t < keys; t++) {
                vec first, second;
                kv_pair(k, (j + t) * d + c, &first, &second, bf16);
                for (int h = 0; h < H; h++)
                    a[h * keys + t] = vfma(qv[h][0], first, a[h * keys + t]);
                for (int h = 0; h < H; h++)
                    a[h * keys + t] = vfma(qv[h][1], second, a[h * keys + t]);
            }
        }
        const vec s = vmul(sum8(a), vset(scale)); /* head h's keys in lanes h * keys on */
        if (H == 1) {
            vstore(scores + j, s);
            continue;
        }
        _mm_storeu_ps(scores + j, _mm256_castps256_ps128(s));
        _mm_storeu_ps(scores + n + j, _mm256_extractf128_ps(s, 1));
    }
    for (; j < n; j++)
        for (int h = 0; h < H; h++)
            scores[h * n + j] = kv_dot_pairs(q + h * d, k, j * d, d, bf16) * scale;
}

/* attend_head for the G <= GROUP query heads (d apart in q and out, n apart in scores) that share
   one key and value head, d a multiple of 2 GL and at most MAX_D: the scores of two heads at a
   time, a last lone head's alone (score_heads), and each block of values read once for every
   head, the outputs in registers across it (where each value's products read and wrote their
   outputs). A float32 cache's sums are attend_head's, in its order (its bits). */
static inline __attribute__((always_inline)) void attend_heads(const float *q, int64_t G,
                                                               const void *k, const void *v,
                                                               int64_t n, int64_t d, float *scores,
                                                               float *out, const int bf16) {
    const float scale = 1.0f / __builtin_sqrtf((float)d);
    float pairs[GROUP * MAX_D];
    if (bf16) bf16_pairs(q, pairs, G, d); /* each head's d values in kv_pair's order */
    const float *qp = bf16 ? pairs : q;
    int64_t h = 0;
    for (; h + 2 <= G; h += 2) score_heads(qp + h * d, k, n, d, scale, scores + h * n, 2, bf16);
    if (h < G) score_heads(qp + h * d, k, n, d, scale, scores + h * n, 1, bf16);
    float inverse[GROUP];
    for (int64_t h = 0; h < G; h++) {
        inverse[h] = 1.0f / exp_scores(scores + h * n, n);
        for (int64_t i = 0; i < d; i++) out[h * d + i] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < n; j0 += VALUE_ROWS) {
        const int64_t count = n - j0 < VALUE_ROWS ? n - j0 : VALUE_ROWS;
        const void *rows = kv_element((void *)v, j0 * d, bf16);
        for (int64_t h = 0; h < G; h++) {
            const float *p = scores + h * n + j0;
            int64_t c = 0;
            for (; c + 8 * GL <= d; c += 8 * GL)
                add_values(p, rows, count, d, c, out + h * d, 8, bf16);
            for (; c < d; c += 2 * GL) add_values(p, rows, count, d, c, out + h * d, 2, bf16);
        }
    }
    for (int64_t h = 0; h < G; h++) from_kv_pairs(out + h * d, d, inverse[h], bf16);
}
#endif

/* the `group` query heads of one key/value head: two at a time where their sizes allow */
static void attend_kv_head(const float *q, int64_t group, const void *k, const void *v, int64_t n,
                           int64_t d, float *scores, float *out, int bf16) {
    int64_t h = 0;
#if defined(__AVX512F__)
#define HEADS(NV, G, B) attend_heads(q + h * d, k, v, n, scores + h * n, out + h * d, NV, G, B)
#define PAIRED(NV, B)                                                                              \
    case NV:                                                                                       \
        for (; h + 2 <= group; h += 2) HEADS(NV, 2, B);                                            \
        for (; h < group; h++) HEADS(NV, 1, B);                                                    \
        break;
#define SIZES(B)                                                                                   \
    switch (d % GL ? 0 : d / GL) {                                                                 \
        PAIRED(2, B)                                                                               \
        PAIRED(4, B)                                                                               \
        PAIRED(8, B)                                                                               \
    case 16:                                                                                       \
        for (; h < group; h++) HEADS(16, 1, B);                                                    \
        break;                                                                                     \
    }
    if (bf16)
        SIZES(1)
    else
        SIZES(0)
#undef SIZES
#undef PAIRED
#undef HEADS
#else
    for (; d % (2 * GL) == 0 && d <= MAX_D && h < group; h += GROUP) {
        const int64_t G = group - h < GROUP ? group - h : GROUP;
        if (bf16)
            attend_heads(q + h * d, G, k, v, n, d, scores + h * n, out + h * d, 1);
        else
            attend_heads(q + h * d, G, k, v, n, d, scores + h * n, out + h * d, 0);
    }
#endif
    for (; h < group; h++) {
        if (bf16)
            attend_head(q + h * d, k, v, n, d, scores + h * n, out + h * d, 1);
        else
            attend_head(q + h * d, k, v, n, d, scores + h * n, out + h * d, 0);
    }
}

static void add_into(float *x, const float *y, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= PARALLEL_VALUES)
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* d values from `from` into the cache at element `at`, rounded to bfloat16 where it holds them */
static void kv_write(void *cache, int64_t at, const float *from, int64_t d, int bf16) {
    if (!bf16) {
        memcpy(kv_element(cache, at, 0), from, sizeof(float) * d);
        return;
    }
    uint16_t *to = kv_element(cache, at, 1);
    for (int64_t i = 0; i < d; i++) to[i] = bf16_rounded(from[i]);
}

/* Every row's attention: its key and value (k, v: KV values a row) written at column
   positions[r] of its cache row, then its query heads against that row's first positions[r] + 1
   columns (a head every head_stride values, a column every d), a task a row and key/value head,
   each task's scores at its own place in `scores` (longest floats a head). The writes are the
   tasks' own: each lands on lines of its own, far from the last (a stall on memory each), which
   a loop of them on one thread made 4% of a step of 32 rows. */
static void attend_rows(const struct decode_layer *l, const float *q, const float *k,
                        const float *v, void *k_cache, void *v_cache, int kv_bf16, int64_t rows,
                        const int64_t *slots, const int64_t *positions, int64_t head_stride,
                        int64_t longest, float *scores, float *attn, int threads) {
    const int64_t d = l->d, group = l->heads / l->kv_heads, Q = l->heads * d;
    const int64_t KV = l->kv_heads * d, slot_stride = l->kv_heads * head_stride;
/* the context's keys and values are the step's largest read after the weights: both
   threads' share of the memory bandwidth; each output is its task's alone, whichever thread
   makes it */
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t task = 0; task < rows * l->kv_heads; task++) {
        const int64_t r = task / l->kv_heads, g = task % l->kv_heads;
        const int64_t at = slots[r] * slot_stride + g * head_stride, first = g * group;
        const int64_t column = at + positions[r] * d;
        kv_write(k_cache, column, k + r * KV + g * d, d, kv_bf16);
        kv_write(v_cache, column, v + r * KV + g * d, d, kv_bf16);
        attend_kv_head(q + r * Q + first * d, group, kv_element(k_cache, at, kv_bf16),
                       kv_element(v_cache, at, kv_bf16), positions[r] + 1, d,
                       scores + (r * l->heads + first) * longest, attn + r * Q + first * d,
                       kv_bf16);
    }
}

/* A decode step's attention alone, for the layers decode_layer does not run (Qwen3.5's gated
   attention, a sparse model's): attend_rows on q (rows x heads x d) with k and v (rows x kv_heads
   x d, written into the caches first) -> out (rows x heads x d). The caches as decode_layer takes
   them. Nonzero (nothing done) where the scores' scratch could not be allocated. */
int decode_attention(const float *q, const float *k, const float *v, void *k_cache, void *v_cache,
                     int64_t columns, int kv_bf16, const int64_t *slots, const int64_t *positions,
                     int64_t rows, int64_t heads, int64_t kv_heads, int64_t d, float *out,
                     int threads) {
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++)
        longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    float *scores = malloc(sizeof(float) * (size_t)(rows * heads * longest));
    if (!scores) return 1;
    struct decode_layer l = {0};
    l.heads = heads, l.kv_heads = kv_heads, l.d = d;
    attend_rows(&l, q, k, v, k_cache, v_cache, kv_bf16, rows, slots, positions, columns * d,
                longest, scores, out, threads);
    free(scores);
    return 0;
}

/* x (rows x hidden) <- the layer's output for each row's token: row r's key and value written
   at column positions[r] of cache row slots[r] (k_cache and v_cache: [cache rows, kv_heads,
   columns, d], contiguous, float32 or with kv_bf16 bfloat16) and attended over positions[r] + 1
   columns. cos/sin: d values a row.
   scratch: rows * (hidden * 2 + heads * d * 2 + kv_heads * d * 2 + intermediate * 2) floats, then
   twice rows * (widest / 32 + 1) floats (widest: the widest of hidden, heads * d and
   intermediate), then rows * widest floats (levels, or rows in pairs' order), then rows * heads *
   (the largest position + 1) floats (cpu.decode_scratch). */
void decode_layer(const struct decode_layer *l, float *x, int64_t rows, void *k_cache,
                  void *v_cache, int64_t columns, int kv_bf16, const int64_t *slots,
                  const int64_t *positions, const float *cos, const float *sin, float *scratch,
                  int threads) {
    const int64_t H = l->hidden, d = l->d, Q = l->heads * d, KV = l->kv_heads * d;
    const int64_t I = l->intermediate, head_stride = columns * d;
    const int64_t widest = H > Q ? (H > I ? H : I) : (Q > I ? Q : I);
    float *normed = scratch, *q = normed + rows * H, *k = q + rows * Q, *v = k + rows * KV;
    float *attn = v + rows * KV, *out = attn + rows * Q, *gate = out + rows * H;
    const int64_t scales = rows * (widest / 32 + 1); /* a row's, or (int4) a group's */
    float *up = gate + rows * I, *level_scale = up + rows * I;
    int32_t *group_sums = (int32_t *)(level_scale + scales);
    uint8_t *levels = (uint8_t *)(group_sums + scales);
    float *scores = (float *)levels + rows * widest;
    struct rows_in in = {normed, levels, level_scale, group_sums};
    rms_norm(x, H, l->input_norm, normed, rows, H, l->eps, threads);
    take_rows(l, &in, normed, rows, H, threads);
    linear(l, &in, &l->q, q, rows, Q, H, threads);
    linear(l, &in, &l->k, k, rows, KV, H, threads);
    linear(l, &in, &l->v, v, rows, KV, H, threads);
    rms_norm(q, d, l->q_norm, q, rows * l->heads, d, l->eps, threads);
    rms_norm(k, d, l->k_norm, k, rows * l->kv_heads, d, l->eps, threads);
    rotary(q, Q, d, q, rows, l->heads, d, cos, sin, d, threads);
    rotary(k, KV, d, k, rows, l->kv_heads, d, cos, sin, d, threads);
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++)
        longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    attend_rows(l, q, k, v, k_cache, v_cache, kv_bf16, rows, slots, positions, head_stride, longest,
                scores, attn, threads);
    take_rows(l, &in, attn, rows, Q, threads);
    linear(l, &in, &l->o, out, rows, H, Q, threads);
    add_into(x, out, rows * H, threads);
    rms_norm(x, H, l->post_norm, normed, rows, H, l->eps, threads);
    take_rows(l, &in, normed, rows, H, threads);
    linear(l, &in, &l->gate, gate, rows, I, H, threads);
    linear(l, &in, &l->up, up, rows, I, H, threads);
    silu_times(gate, up, rows * I, threads);
    take_rows(l, &in, gate, rows, I, threads);
    linear(l, &in, &l->down, out, rows, H, I, threads);
    add_into(x, out, rows * H, threads);
}
