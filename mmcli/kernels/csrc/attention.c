/* Attention in float32 on the CPU, built by kernels/cpu.py: out = softmax(q k^T / sqrt(d)) v for
   every head, without a mask (the vision tower's blocks) or causal (the decoder's prefill: query i
   of n sees the keys up to i + keys - n, after any cached ones), with `group` query heads sharing
   each key and value head (GQA).

   Each task is a key/value head (or a share of its queries where there are fewer heads than
   threads): its keys packed once, transposed, a panel of NR at a time, and its values copied
   together; then for each of its query heads and each block of QB queries their scores against
   the keys they see, a softmax over each row in place, the probabilities times the values, and
   each row divided by its sum. Both products run on float_tiles.h's tiles (docs/performance.md
   compares torch's CPU flash kernel on these shapes). */
#include <stdlib.h>

#include "float_tiles.h"

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

/* A row's first n scores -> e^(scale (s - max)) in place; returns 1 / their sum. */
static float softmax_row(float *row, int64_t n, float scale) {
    int64_t k = 0;
    vec top = vset(row[0]);
    for (; k + GL <= n; k += GL) top = vmax(top, vload(row + k));
    float largest = vlargest(top);
    for (; k < n; k++) largest = row[k] > largest ? row[k] : largest;
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

/* One task's blocks [first, last) of each of its `group` query heads (head h0 on). */
static void attend_heads(struct heads q, int64_t h0, int64_t group, const float *panels,
                         const float *values, float *out, int64_t out_row, int64_t first,
                         int64_t last, int64_t queries, int64_t keys, int causal, int64_t d,
                         int64_t d_pad, float *scores, int64_t lds, float *inverse) {
    for (int64_t h = h0; h < h0 + group; h++) {
        const struct heads qh = {q.data + h * q.head, q.row, q.head};
        for (int64_t b = first; b < last; b++) {
            const int64_t q0 = b * QB, rows = queries - q0 < QB ? queries - q0 : QB;
            const int64_t seen = causal ? keys - queries + q0 + 1 : keys;
            attend_block(qh, panels, values, out + h * d, out_row, q0, rows, keys, seen, d, d_pad,
                         scores, lds, inverse);
        }
    }
}

/* out (queries x heads x d, a row every out_row floats, a head every d) for q (queries positions,
   `heads` heads), k and v (keys positions, heads / group heads), each given by its data, row
   stride and head stride; causal: query i sees keys up to i + keys - queries. Returns 0, or -1
   where a thread's scratch could not be allocated (out is then incomplete). */
int attention(const float *q, int64_t q_row, int64_t q_head, const float *k, int64_t k_row,
              int64_t k_head, const float *v, int64_t v_row, int64_t v_head, float *out,
              int64_t out_row, int64_t queries, int64_t keys, int64_t heads, int64_t group,
              int causal, int64_t d, int threads) {
    const int64_t lds = (keys + GL - 1) / GL * GL, d_pad = (d + GL - 1) / GL * GL;
    const int64_t blocks = (queries + QB - 1) / QB, kv_heads = heads / group;
    /* a task is a key/value head's share of its query blocks: every thread busy when there are
       fewer of those heads than threads */
    const int64_t shares = kv_heads >= threads ? 1 : (threads + kv_heads - 1) / kv_heads;
    const int64_t per_share = (blocks + shares - 1) / shares;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = aligned_alloc(64, sizeof(float) * QB * lds);
        float *panels = aligned_alloc(64, sizeof(float) * (keys + NR - 1) / NR * NR * d_pad);
        float *values = aligned_alloc(64, sizeof(float) * (d + NR - 1) / NR * NR * keys);
        float inverse[QB];
        failed = !scores || !panels || !values;
/* one task at a time to whichever thread is free, as bf16_linear.c shares out its rows */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < kv_heads * shares; t++) {
            const int64_t g = t / shares, first = (t % shares) * per_share;
            if (failed || first >= blocks) continue;
            const int64_t last = first + per_share < blocks ? first + per_share : blocks;
            struct heads kh = {k + g * k_head, k_row, k_head}, vh = {v + g * v_head, v_row, v_head};
            pack_head(kh, vh, keys, d, d_pad, panels, values);
            const struct heads qs = {q, q_row, q_head};
            attend_heads(qs, g * group, group, panels, values, out, out_row, first, last, queries,
                         keys, causal, d, d_pad, scores, lds, inverse);
        }
        free(scores);
        free(panels);
        free(values);
    }
    return failed ? -1 : 0;
}
