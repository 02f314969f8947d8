/* Attention without a mask, in float32, for the vision tower's blocks on the CPU: out = softmax(q
   k^T / sqrt(d)) v for every head, built by cpu_kernel.py.

   Each task is a head (or a share of its queries where there are fewer heads than threads): its
   keys packed once, transposed, a panel of NR at a time, and its values copied together; then for
   each block of QB queries their scores against every key, a softmax over each row in place, the
   probabilities times the values, and each row divided by its sum. Both products run on
   float_tiles.h's tiles (docs/performance.md compares torch's CPU flash kernel on these shapes). */
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

/* Each of `rows` rows of s (`keys` scores, `lds` apart) -> e^(scale (s - max)) in place; 1 / their
   sum in inverse[row]. */
static void softmax_rows(float *s, int64_t lds, int64_t rows, int64_t keys, float scale,
                         float *inverse) {
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * lds;
        int64_t k = 0;
        vec top = vset(row[0]);
        for (; k + GL <= keys; k += GL) top = vmax(top, vload(row + k));
        float largest = vlargest(top);
        for (; k < keys; k++) largest = row[k] > largest ? row[k] : largest;
        vec total = vzero(), shift = vset(largest), factor = vset(scale);
        for (k = 0; k + GL <= keys; k += GL) {
            vec e = vexp(vmul(vsub(vload(row + k), shift), factor));
            vstore(row + k, e);
            total = vadd(total, e);
        }
        float sum = vsum(total);
        if (k < keys) { /* the last, partial vector */
            lanes tail = first_lanes((int)(keys - k));
            vstore_some(row + k, vexp(vmul(vsub(vload_some(row + k, tail), shift), factor)), tail);
            for (; k < keys; k++) sum += row[k];
        }
        inverse[r] = 1.0f / sum;
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

/* One head's queries q0 .. q0 + rows: scores, softmax, times v, each row scaled by 1 / its sum. */
static void attend_block(struct heads q, const float *panels, const float *values, float *out,
                         int64_t out_row, int64_t q0, int64_t rows, int64_t keys, int64_t d,
                         int64_t d_pad, float *scores, int64_t lds, float *inverse) {
    const struct ends plain = {1, 1, NONE, 0};
    const float *queries = q.data + q0 * q.row;
    for (int64_t key0 = 0; key0 < keys; key0 += NR) {
        const int width = keys - key0 < NR ? (int)(keys - key0) : NR;
        panel_rows(queries, q.row, panels + key0 * d_pad, NR, d, scores + key0, lds, rows, plain,
                   width);
    }
    softmax_rows(scores, lds, rows, keys, 1.0f / __builtin_sqrtf((float)d), inverse);
    float *o = out + q0 * out_row;
    for (int64_t d0 = 0; d0 < d; d0 += NR) {
        const int width = d - d0 < NR ? (int)(d - d0) : NR;
        panel_rows(scores, lds, values + d0 * keys, NR, keys, o + d0, out_row, rows, plain, width);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < d; i++) o[r * out_row + i] *= inverse[r];
}

/* out (queries x heads x d, a row every out_row floats, a head every d) for q (queries positions),
   k and v (keys positions), each given by its data, row stride and head stride. Returns 0, or -1
   where a thread's scratch could not be allocated (out is then incomplete). */
int attention(const float *q, int64_t q_row, int64_t q_head, const float *k, int64_t k_row,
              int64_t k_head, const float *v, int64_t v_row, int64_t v_head, float *out,
              int64_t out_row, int64_t queries, int64_t keys, int64_t heads, int64_t d,
              int threads) {
    const int64_t lds = (keys + GL - 1) / GL * GL, d_pad = (d + GL - 1) / GL * GL;
    const int64_t blocks = (queries + QB - 1) / QB;
    /* a task is a head's share of its query blocks: every thread busy when heads < threads */
    const int64_t shares = heads >= threads ? 1 : (threads + heads - 1) / heads;
    const int64_t per_share = (blocks + shares - 1) / shares;
    int failed = 0;
    #pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = aligned_alloc(64, sizeof(float) * QB * lds);
        float *panels = aligned_alloc(64, sizeof(float) * (keys + NR - 1) / NR * NR * d_pad);
        float *values = aligned_alloc(64, sizeof(float) * (d + NR - 1) / NR * NR * keys);
        float inverse[QB];
        failed = !scores || !panels || !values;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < heads * shares; t++) {
            const int64_t h = t / shares, first = (t % shares) * per_share;
            if (failed || first >= blocks) continue;
            struct heads qh = {q + h * q_head, q_row, q_head}, kh = {k + h * k_head, k_row, k_head};
            struct heads vh = {v + h * v_head, v_row, v_head};
            pack_head(kh, vh, keys, d, d_pad, panels, values);
            for (int64_t b = first; b < blocks && b < first + per_share; b++) {
                const int64_t q0 = b * QB, rows = queries - q0 < QB ? queries - q0 : QB;
                attend_block(qh, panels, values, out + h * d, out_row, q0, rows, keys, d, d_pad,
                             scores, lds, inverse);
            }
        }
        free(scores);
        free(panels);
        free(values);
    }
    return failed ? -1 : 0;
}
