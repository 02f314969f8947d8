/* One decode step of one sequence through a Qwen3 attention layer with bfloat16 weights and
   float32 arithmetic, built by cpu_kernel.py: the same operations as text.py's DecoderLayer (the
   norms, q/k/v, the q/k norms, the rotary, the cache write, attention over the row's context, o,
   the MLP, both residual adds) in one call. A step's weight reads are bf16_linear's; what this saves
   is the two dozen tensor operations around them, each of which costs more to dispatch than to
   compute for one token (and runs slower still after a weight read has flushed the caches). */
#include <string.h>

#include "float_tiles.h"

void bf16_linear(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                 int threads);
void rms_norm(const float *x, int64_t ld, const float *w, float *out, int64_t rows,
              int64_t width, float eps, int threads);

/* A layer's weights (bfloat16 bits for the matrices, float32 for the norms) and sizes, set once
   by cpu_kernel.DecodeLayer. */
struct decode_layer {
    const float *input_norm, *post_norm, *q_norm, *k_norm;
    const uint16_t *q, *k, *v, *o, *gate, *up, *down;
    int64_t hidden, heads, kv_heads, d, intermediate;
    float eps;
};

/* x[h] (d values a head) rotated by cos/sin (d each, split halves), as rope.apply_rotary:
   x cos, then minus x2 sin on the first half and plus x1 sin on the second. */
static void rotate(float *x, int64_t heads, int64_t d, const float *cos, const float *sin) {
    const int64_t half = d / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *row = x + h * d;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = row[i], x2 = row[i + half];
            row[i] = x1 * cos[i] - x2 * sin[i];
            row[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
        }
    }
}

static float dot(const float *a, const float *b, int64_t d) {
    vec sum = vzero();
    for (int64_t i = 0; i < d; i += GL) {
        lanes some = first_lanes(d - i < GL ? (int)(d - i) : GL);
        sum = vfma(vload_some(a + i, some), vload_some(b + i, some), sum);
    }
    return vsum(sum);
}

/* out[d] = softmax(q k^T / sqrt(d)) v over the first n rows of k and v (a row every d floats);
   `scores` holds n floats. */
static void attend_head(const float *q, const float *k, const float *v, int64_t n, int64_t d,
                        float *scores, float *out) {
    const float scale = 1.0f / __builtin_sqrtf((float)d);
    float largest = -__builtin_inff();
    for (int64_t j = 0; j < n; j++) {
        scores[j] = dot(q, k + j * d, d) * scale;
        largest = scores[j] > largest ? scores[j] : largest;
    }
    float total = 0.0f;
    int64_t j = 0;
    for (; j + GL <= n; j += GL) {
        vec e = vexp(vsub(vload(scores + j), vset(largest)));
        vstore(scores + j, e);
        total += vsum(e);
    }
    if (j < n) {
        lanes tail = first_lanes((int)(n - j));
        vec e = vexp(vsub(vload_some(scores + j, tail), vset(largest)));
        vstore_some(scores + j, e, tail);
        for (; j < n; j++) total += scores[j];
    }
    for (int64_t i = 0; i < d; i++) out[i] = 0.0f;
    for (j = 0; j < n; j++) {
        const vec p = vset(scores[j]);
        for (int64_t i = 0; i < d; i += GL) {
            lanes some = first_lanes(d - i < GL ? (int)(d - i) : GL);
            vstore_some(out + i, vfma(p, vload_some(v + j * d + i, some), vload_some(out + i, some)),
                        some);
        }
    }
    const float inverse = 1.0f / total;
    for (int64_t i = 0; i < d; i++) out[i] *= inverse;
}

/* silu(gate) * up into gate, as F.silu(gate) * up: gate / (1 + e^-gate). */
static void silu_times(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
    for (; i + GL <= n; i += GL) {
        vec g = vload(gate + i);
        vec s = vdiv(g, vadd(vset(1.0f), vexp(vsub(vzero(), g))));
        vstore(gate + i, vmul(s, vload(up + i)));
    }
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + __builtin_expf(-gate[i])) * up[i];
}

static void add_into(float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

/* x (hidden) <- the layer's output for the token at column `pos` of its cache row: k_cache and
   v_cache that row's [kv_heads, columns, d] (a head every head_stride floats), written at pos and
   read over pos + 1 columns. cos/sin: d values. scratch: hidden * 2 + heads * d * 2 + kv_heads * d
   * 2 + intermediate * 2 + heads * (pos + 1) floats. */
void decode_layer(const struct decode_layer *l, float *x, float *k_cache, float *v_cache,
                  int64_t head_stride, int64_t pos, const float *cos, const float *sin,
                  float *scratch, int threads) {
    const int64_t H = l->hidden, d = l->d, Q = l->heads * d, KV = l->kv_heads * d;
    const int64_t group = l->heads / l->kv_heads, n = pos + 1;
    float *normed = scratch, *q = normed + H, *k = q + Q, *v = k + KV, *attn = v + KV;
    float *out = attn + Q, *gate = out + H, *up = gate + l->intermediate;
    float *scores = up + l->intermediate;
    rms_norm(x, H, l->input_norm, normed, 1, H, l->eps, 1);
    bf16_linear(normed, l->q, q, 1, Q, H, threads);
    bf16_linear(normed, l->k, k, 1, KV, H, threads);
    bf16_linear(normed, l->v, v, 1, KV, H, threads);
    rms_norm(q, d, l->q_norm, q, l->heads, d, l->eps, 1);
    rms_norm(k, d, l->k_norm, k, l->kv_heads, d, l->eps, 1);
    rotate(q, l->heads, d, cos, sin);
    rotate(k, l->kv_heads, d, cos, sin);
    for (int64_t g = 0; g < l->kv_heads; g++) {
        memcpy(k_cache + g * head_stride + pos * d, k + g * d, sizeof(float) * d);
        memcpy(v_cache + g * head_stride + pos * d, v + g * d, sizeof(float) * d);
    }
    /* the context's keys and values are the step's largest read after the weights: both
       threads' share of the memory bandwidth */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t h = 0; h < l->heads; h++) {
        const int64_t g = h / group;
        attend_head(q + h * d, k_cache + g * head_stride, v_cache + g * head_stride, n, d,
                    scores + h * n, attn + h * d);
    }
    bf16_linear(attn, l->o, out, 1, H, Q, threads);
    add_into(x, out, H);
    rms_norm(x, H, l->post_norm, normed, 1, H, l->eps, 1);
    bf16_linear(normed, l->gate, gate, 1, l->intermediate, H, threads);
    bf16_linear(normed, l->up, up, 1, l->intermediate, H, threads);
    silu_times(gate, up, l->intermediate);
    bf16_linear(gate, l->down, out, 1, H, l->intermediate, threads);
    add_into(x, out, H);
}
