/* A decode step (one token of each of a few sequences) through a Qwen3 attention layer with
   bfloat16 or int8 weights and float32 arithmetic, built by kernels/cpu.py: the same operations as
   the decoder's DecoderLayer (the norms, q/k/v, the q/k norms, the rotary, the cache write,
   attention over each row's own context, o, the MLP, both residual adds) in one call. A step's
   weight reads are bf16_linear's, amx.c's or int8_linear's; what this saves is the two dozen
   tensor operations around them, each of which costs more to dispatch than to compute for a few
   tokens (and runs slower still after a weight read has flushed the caches), and the batched
   step's copy of every row's context. */
#include <string.h>

#include "float_tiles.h"

void bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
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
                        int32_t *sums);
int int4_vnni_products(const int8_t *xq, const float *x_scales, const int32_t *x_sums,
                       const uint8_t *packed, const uint16_t *scales_zeros, float *y, int64_t M,
                       int64_t N, int64_t K, int threads);

/* A linear's weights (out x in): bfloat16 bits as loaded; int8 in int8_linear.c's layout with
   each output channel's sum of values, scale and bias; or int4 in torch's CPU layout (values) with
   its scales and zeros (scales_zeros); the fields a form has not are NULL. */
struct decode_matrix {
    const void *values;
    const int32_t *sums;
    const float *scale, *bias;
    const uint16_t *scales_zeros;
};

/* A layer's weights (the norms float32) and sizes, set once by cpu.DecodeLayer. */
struct decode_layer {
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    struct decode_matrix q, k, v, o, gate, up, down;
    int64_t hidden, heads, kv_heads, d, intermediate;
    float eps;
    int32_t bf16_products; /* bfloat16 products (the run's precision has them): AMX, BF16 */
    int32_t int8;          /* int8 weights: each product's rows quantized a row at a time */
    int64_t vnni_rows;     /* int8_linear's: the AMX build's tiles above this many rows */
    int32_t int4;          /* int4 weights: int4_vnni_products (set where the build has it) */
};

/* A product's input rows: float32, and their levels made once for the products that share them
   (q, k and v; gate and up): for int8 weights a row's levels and scale (quantize_rows), for int4
   each group's levels, scale and sum (int4_quantize_rows). */
struct rows_in {
    const float *x;
    uint8_t *levels;
    float *scale;
    int32_t *group_sums;
};

static void take_rows(const struct decode_layer *l, struct rows_in *in, const float *x, int64_t M,
                      int64_t K) {
    in->x = x;
    if (l->int8) quantize_rows(x, M, K, in->levels, K, in->scale, 1);
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
    if (l->int4) int4_quantize_rows(x, M, K, (int8_t *)in->levels, in->scale, in->group_sums);
#endif
}

/* The step's products: int8 on int8_linear; int4 on int4_vnni_products; bfloat16 where the
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
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
    if (l->int4 && !int4_vnni_products((const int8_t *)in->levels, in->scale, in->group_sums,
                                       w->values, w->scales_zeros, y, M, N, K, threads))
        return;
#endif
#ifdef __AMX_BF16__
    if (l->bf16_products && !amx_bf16_linear(in->x, w->values, y, M, N, K, 0, threads)) return;
#endif
#ifdef __AVX512BF16__
    if (l->bf16_products && !bf16_dot_linear(in->x, w->values, y, M, N, K, 0, threads)) return;
#endif
    bf16_linear(in->x, w->values, y, M, N, K, threads);
}

static float dot(const float *a, const float *b, int64_t d) {
    vec sum = vzero();
    for (int64_t i = 0; i < d; i += GL) {
        lanes some = first_lanes(d - i < GL ? (int)(d - i) : GL);
        sum = vfma(vload_some(a + i, some), vload_some(b + i, some), sum);
    }
    return vsum(sum);
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

/* out[d] = softmax(q k^T / sqrt(d)) v over the first n rows of k and v (a row every d floats);
   `scores` holds n floats. Any d. */
static void attend_head(const float *q, const float *k, const float *v, int64_t n, int64_t d,
                        float *scores, float *out) {
    const float scale = 1.0f / __builtin_sqrtf((float)d);
    for (int64_t j = 0; j < n; j++) scores[j] = dot(q, k + j * d, d) * scale;
    const float inverse = 1.0f / exp_scores(scores, n);
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const vec p = vset(scores[j]);
        for (int64_t i = 0; i < d; i += GL) {
            lanes some = first_lanes(d - i < GL ? (int)(d - i) : GL);
            const vec sum = vfma(p, vload_some(v + j * d + i, some), vload_some(out + i, some));
            vstore_some(out + i, sum, some);
        }
    }
    for (int64_t i = 0; i < d; i++) out[i] *= inverse;
}

#if defined(__AVX512F__)
/* attend_head for G query heads (d apart in q, out and n apart in scores) of d = NV vectors
   against the one key/value head they share, G * NV <= 16: each key and value is read once for
   the G heads, the queries and the outputs stay in registers, and the scores of 16 keys are
   summed across their lanes by one tree (sum16). The loads were the bound: a dot product that
   loads its query for every key, and an output read and written back for every value, ran at
   2.5x the FMAs' time on a Zen 4. */
static inline __attribute__((always_inline)) void attend_heads(const float *q, const float *k,
                                                               const float *v, int64_t n,
                                                               float *scores, float *out,
                                                               const int NV, const int G) {
    const int64_t d = NV * GL;
    const float scale = 1.0f / __builtin_sqrtf((float)d);
    vec qv[16], acc[16];
    for (int i = 0; i < G * NV; i++) qv[i] = vload(q + i * GL);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        vec a[2][16];
        for (int t = 0; t < 16; t++)
            for (int h = 0; h < G; h++) {
                vec sum = vzero();
                for (int c = 0; c < NV; c++)
                    sum = vfma(qv[h * NV + c], vload(k + (j + t) * d + c * GL), sum);
                a[h][t] = sum;
            }
        for (int h = 0; h < G; h++) vstore(scores + h * n + j, vmul(sum16(a[h]), vset(scale)));
    }
    for (; j < n; j++)
        for (int h = 0; h < G; h++) scores[h * n + j] = dot(q + h * d, k + j * d, d) * scale;
    float inverse[2];
    for (int h = 0; h < G; h++) inverse[h] = 1.0f / exp_scores(scores + h * n, n);
    for (int i = 0; i < G * NV; i++) acc[i] = vzero();
    for (j = 0; j < n; j++)
        for (int h = 0; h < G; h++) {
            const vec p = vset(scores[h * n + j]);
            for (int c = 0; c < NV; c++)
                acc[h * NV + c] = vfma(p, vload(v + j * d + c * GL), acc[h * NV + c]);
        }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < NV; c++)
            vstore(out + h * d + c * GL, vmul(acc[h * NV + c], vset(inverse[h])));
}
#endif

/* the `group` query heads of one key/value head: two at a time where their sizes allow */
static void attend_kv_head(const float *q, int64_t group, const float *k, const float *v, int64_t n,
                           int64_t d, float *scores, float *out) {
    int64_t h = 0;
#if defined(__AVX512F__)
#define HEADS(NV, G) attend_heads(q + h * d, k, v, n, scores + h * n, out + h * d, NV, G)
#define PAIRED(NV)                                                                                 \
    case NV:                                                                                       \
        for (; h + 2 <= group; h += 2) HEADS(NV, 2);                                               \
        for (; h < group; h++) HEADS(NV, 1);                                                       \
        break;
    switch (d % GL ? 0 : d / GL) {
        PAIRED(2)
        PAIRED(4)
        PAIRED(8)
    case 16:
        for (; h < group; h++) HEADS(16, 1);
        break;
    }
#undef PAIRED
#undef HEADS
#endif
    for (; h < group; h++) attend_head(q + h * d, k, v, n, d, scores + h * n, out + h * d);
}

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* Every row's attention: its query heads against its cache row's first positions[r] + 1
   columns (a head every head_stride floats, a column every d), a task a row and key/value
   head, each task's scores at its own place in `scores` (longest floats a head). */
static void attend_rows(const struct decode_layer *l, const float *q, const float *k_cache,
                        const float *v_cache, int64_t rows, const int64_t *slots,
                        const int64_t *positions, int64_t head_stride, int64_t longest,
                        float *scores, float *attn, int threads) {
    const int64_t d = l->d, group = l->heads / l->kv_heads, Q = l->heads * d;
    const int64_t slot_stride = l->kv_heads * head_stride;
/* the context's keys and values are the step's largest read after the weights: both
   threads' share of the memory bandwidth; each output is its task's alone, whichever thread
   makes it */
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int64_t task = 0; task < rows * l->kv_heads; task++) {
        const int64_t r = task / l->kv_heads, g = task % l->kv_heads;
        const int64_t at = slots[r] * slot_stride + g * head_stride, first = g * group;
        attend_kv_head(q + r * Q + first * d, group, k_cache + at, v_cache + at, positions[r] + 1,
                       d, scores + (r * l->heads + first) * longest, attn + r * Q + first * d);
    }
}

/* x (rows x hidden) <- the layer's output for each row's token: row r's key and value written
   at column positions[r] of cache row slots[r] (k_cache and v_cache: [cache rows, kv_heads,
   columns, d], contiguous) and attended over positions[r] + 1 columns. cos/sin: d values a row.
   scratch: rows * (hidden * 2 + heads * d * 2 + kv_heads * d * 2 + intermediate * 2) floats, then
   twice rows * (widest / 32 + 1) floats (widest: the widest of hidden, heads * d and
   intermediate), then rows * widest bytes rounded up to floats, then rows * heads * (the largest
   position + 1) floats (cpu.decode_scratch). */
void decode_layer(const struct decode_layer *l, float *x, int64_t rows, float *k_cache,
                  float *v_cache, int64_t columns, const int64_t *slots, const int64_t *positions,
                  const float *cos, const float *sin, float *scratch, int threads) {
    const int64_t H = l->hidden, d = l->d, Q = l->heads * d, KV = l->kv_heads * d;
    const int64_t I = l->intermediate, head_stride = columns * d;
    const int64_t slot_stride = l->kv_heads * head_stride;
    const int64_t widest = H > Q ? (H > I ? H : I) : (Q > I ? Q : I);
    float *normed = scratch, *q = normed + rows * H, *k = q + rows * Q, *v = k + rows * KV;
    float *attn = v + rows * KV, *out = attn + rows * Q, *gate = out + rows * H;
    const int64_t scales = rows * (widest / 32 + 1); /* a row's, or (int4) a group's */
    float *up = gate + rows * I, *level_scale = up + rows * I;
    int32_t *group_sums = (int32_t *)(level_scale + scales);
    uint8_t *levels = (uint8_t *)(group_sums + scales);
    float *scores = (float *)levels + (rows * widest + 3) / 4;
    struct rows_in in = {normed, levels, level_scale, group_sums};
    rms_norm(x, H, l->input_norm, normed, rows, H, l->eps, 1);
    take_rows(l, &in, normed, rows, H);
    linear(l, &in, &l->q, q, rows, Q, H, threads);
    linear(l, &in, &l->k, k, rows, KV, H, threads);
    linear(l, &in, &l->v, v, rows, KV, H, threads);
    rms_norm(q, d, l->q_norm, q, rows * l->heads, d, l->eps, 1);
    rms_norm(k, d, l->k_norm, k, rows * l->kv_heads, d, l->eps, 1);
    rotary(q, Q, d, q, rows, l->heads, d, cos, sin, d, threads);
    rotary(k, KV, d, k, rows, l->kv_heads, d, cos, sin, d, threads);
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        float *k_row = k_cache + slots[r] * slot_stride, *v_row = v_cache + slots[r] * slot_stride;
        for (int64_t g = 0; g < l->kv_heads; g++) {
            const int64_t at = g * head_stride + positions[r] * d;
            memcpy(k_row + at, k + r * KV + g * d, sizeof(float) * d);
            memcpy(v_row + at, v + r * KV + g * d, sizeof(float) * d);
        }
        longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    }
    attend_rows(l, q, k_cache, v_cache, rows, slots, positions, head_stride, longest, scores, attn,
                threads);
    take_rows(l, &in, attn, rows, Q);
    linear(l, &in, &l->o, out, rows, H, Q, threads);
    add_into(x, out, rows * H);
    rms_norm(x, H, l->post_norm, normed, rows, H, l->eps, 1);
    take_rows(l, &in, normed, rows, H);
    linear(l, &in, &l->gate, gate, rows, I, H, threads);
    linear(l, &in, &l->up, up, rows, I, H, threads);
    silu_times(gate, up, rows * I, threads);
    take_rows(l, &in, gate, rows, I);
    linear(l, &in, &l->down, out, rows, H, I, threads);
    add_into(x, out, rows * H);
}
