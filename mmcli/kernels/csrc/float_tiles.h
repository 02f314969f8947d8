/* The float32 tiles that bf16_linear.c's GEMM and attention.c share: y (rows x channels) += x (rows
   x k) @ panel (k x channels), for GR rows and NR channels at a time held in registers, the panel
   laid out with each input's channels contiguous (`ldp` floats between inputs). AVX-512 where the
   build has it, else AVX2 (vectors.h). */
#ifndef MMCLI_FLOAT_TILES_H
#define MMCLI_FLOAT_TILES_H
#include "vectors.h"

#define GR 6 /* rows per tile */
#if defined(__AVX512F__)
#define GV 4 /* vectors per tile */
#define EACH_VECTOR(X, m) X(m, 0) X(m, 1) X(m, 2) X(m, 3)
#else
#define GV 2
#define EACH_VECTOR(X, m) X(m, 0) X(m, 1)
#endif
#define NR (GV * GL) /* channels per panel */
#define EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)

/* A tile's ends: its sums start at zero (`first`) or from y, where the earlier panels left them;
   at the `last` panel the bias (when there is one) is added and the activation applied. */
struct ends {
    int first, last, act;
    const float *bias;
};

static inline vec finish(vec sum, vec bias, int act) {
    sum = vadd(sum, bias);
    return act == GELU_TANH ? vgelu_tanh(sum) : sum;
}

/* The hot tile: GR rows x NR channels, each accumulator a variable of its own (GCC keeps an array
   of them in registers only with a copy to the stack at every step). */
static inline void tile_full(const float *x, int64_t ldx, const float *panel, int64_t ldp,
                             int64_t kc, float *y, int64_t ldy, struct ends e) {
#define DECLARE(m, j) vec a##m##j = e.first ? vzero() : vload(y + m * ldy + j * GL);
#define DECLARE_ROW(m) EACH_VECTOR(DECLARE, m)
    EACH_ROW(DECLARE_ROW)
    for (int64_t k = 0; k < kc; k++) {
#define LOAD(m, j) vec b##j = vload(panel + k * ldp + j * GL);
        EACH_VECTOR(LOAD, 0)
#define FMA(m, j) a##m##j = vfma(xb, b##j, a##m##j);
#define FMA_ROW(m)                                                                                 \
    {                                                                                              \
        vec xb = vbroadcast(x + m * ldx + k);                                                      \
        EACH_VECTOR(FMA, m)                                                                        \
    }
        EACH_ROW(FMA_ROW)
    }
    if (!e.last) {
#define STORE(m, j) vstore(y + m * ldy + j * GL, a##m##j);
#define STORE_ROW(m) EACH_VECTOR(STORE, m)
        EACH_ROW(STORE_ROW)
        return;
    }
#define BIAS(m, j) vec c##j = e.bias ? vload(e.bias + j * GL) : vzero();
    EACH_VECTOR(BIAS, 0)
#define FINISH(m, j) vstore(y + m * ldy + j * GL, finish(a##m##j, c##j, e.act));
#define FINISH_ROW(m) EACH_VECTOR(FINISH, m)
    EACH_ROW(FINISH_ROW)
}

/* Any tile: mr rows (a constant where inlined) and the first `channels` of the panel's NR. */
static inline __attribute__((always_inline)) void tile_any(const float *x, int64_t ldx,
                                                           const float *panel, int64_t ldp,
                                                           int64_t kc, float *y, int64_t ldy,
                                                           struct ends e, int mr, int channels) {
    vec acc[GR][GV], bias[GV];
    lanes some[GV];
    for (int j = 0; j < GV; j++) {
        int left = channels - j * GL;
        some[j] = first_lanes(left < 0 ? 0 : left > GL ? GL : left);
        bias[j] = e.bias ? vload_some(e.bias + j * GL, some[j]) : vzero();
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < GV; j++)
            acc[m][j] = e.first ? vzero() : vload_some(y + m * ldy + j * GL, some[j]);
    for (int64_t k = 0; k < kc; k++) {
        vec b[GV];
        for (int j = 0; j < GV; j++) b[j] = vload_some(panel + k * ldp + j * GL, some[j]);
        for (int m = 0; m < mr; m++) {
            vec xb = vbroadcast(x + m * ldx + k);
            for (int j = 0; j < GV; j++) acc[m][j] = vfma(xb, b[j], acc[m][j]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int j = 0; j < GV; j++) {
            vec v = e.last ? finish(acc[m][j], bias[j], e.act) : acc[m][j];
            vstore_some(y + m * ldy + j * GL, v, some[j]);
        }
}

/* The edges: fewer than GR rows, or fewer than NR channels (each row count a constant where
   tile_any is inlined). */
static void tile_edge(const float *x, int64_t ldx, const float *panel, int64_t ldp, int64_t kc,
                      float *y, int64_t ldy, struct ends e, int mr, int channels) {
    switch (mr) {
    case 1: tile_any(x, ldx, panel, ldp, kc, y, ldy, e, 1, channels); break;
    case 2: tile_any(x, ldx, panel, ldp, kc, y, ldy, e, 2, channels); break;
    case 3: tile_any(x, ldx, panel, ldp, kc, y, ldy, e, 3, channels); break;
    case 4: tile_any(x, ldx, panel, ldp, kc, y, ldy, e, 4, channels); break;
    case 5: tile_any(x, ldx, panel, ldp, kc, y, ldy, e, 5, channels); break;
    default: tile_any(x, ldx, panel, ldp, kc, y, ldy, e, GR, channels);
    }
}

/* Every row of y (M rows) for one panel of `channels` (at most NR) over kc inputs. */
static inline void panel_rows(const float *x, int64_t ldx, const float *panel, int64_t ldp,
                              int64_t kc, float *y, int64_t ldy, int64_t M, struct ends e,
                              int channels) {
    for (int64_t m = 0; m < M; m += GR) {
        const int mr = M - m < GR ? (int)(M - m) : GR;
        if (mr == GR && channels == NR)
            tile_full(x + m * ldx, ldx, panel, ldp, kc, y + m * ldy, ldy, e);
        else
            tile_edge(x + m * ldx, ldx, panel, ldp, kc, y + m * ldy, ldy, e, mr, channels);
    }
}
#endif
