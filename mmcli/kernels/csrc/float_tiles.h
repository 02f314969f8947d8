/* The float32 tiles that bf16_linear.c's GEMM and attention.c share: y (rows x channels) += x (rows
   x k) @ panel (k x channels), for GR rows and NR channels at a time held in registers, the panel
   laid out with each input's channels contiguous (`ldp` floats between inputs). AVX-512 where the
   build has it, else AVX2. */
#ifndef MMCLI_FLOAT_TILES_H
#define MMCLI_FLOAT_TILES_H
#include <immintrin.h>
#include <stdint.h>

/* A bfloat16 is the top half of a float32: widening it is exact. */
static inline float bf16_to_float(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } c = {(uint32_t)h << 16};
    return c.f;
}

#define GR 6 /* rows per tile */

#if defined(__AVX512F__)
#define GV 4  /* vectors per tile */
#define GL 16 /* channels per vector */
#define EACH_VECTOR(X, m) X(m, 0) X(m, 1) X(m, 2) X(m, 3)
typedef __m512 vec;
typedef __mmask16 lanes;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vbroadcast(const float *p) { return _mm512_set1_ps(*p); }
static inline vec vset(float v) { return _mm512_set1_ps(v); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
static inline float vlargest(vec a) { return _mm512_reduce_max_ps(a); }
static inline vec vround(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT); }
static inline vec vscale(vec a, vec n) { return _mm512_scalef_ps(a, n); } /* a * 2^n, n whole */
static inline lanes first_lanes(int count) { return (lanes)((1u << count) - 1); }
static inline vec vload_some(const float *p, lanes l) { return _mm512_maskz_loadu_ps(l, p); }
static inline void vstore_some(float *p, vec v, lanes l) { _mm512_mask_storeu_ps(p, l, v); }
/* each 32-bit lane's two bfloat16 (little-endian: the lower one first) as float32, exactly */
static inline vec low_bf16(vec pairs) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castps_si512(pairs), 16));
}
static inline vec high_bf16(vec pairs) {
    __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(pairs), top));
}
static inline vec widen(const uint16_t *p) { /* 16 bfloat16 -> float32, exactly */
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
/* int4's scale and zero of 16 channels from their bfloat16 pairs (scale the lower half) */
static inline void scale_zero(const uint32_t *pairs, __m512 *scale, __m512 *zero) {
    const __m512i sz = _mm512_loadu_si512(pairs);
    *scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
    *zero = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(~0xFFFF)));
}

/* r[i][j] -> r[j][i] for a 16 x 16 block */
static inline void transpose(vec r[16]) {
    vec t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
        r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
    }
}
#else
#define GV 2
#define GL 8
#define EACH_VECTOR(X, m) X(m, 0) X(m, 1)
typedef __m256 vec;
typedef __m256i lanes;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vbroadcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline vec vset(float v) { return _mm256_set1_ps(v); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline float vsum(vec a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float vlargest(vec a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vec vround(vec a) {
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vec vscale(vec a, vec n) {
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(a, _mm256_castsi256_ps(e));
}
static inline lanes first_lanes(int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec vload_some(const float *p, lanes l) { return _mm256_maskload_ps(p, l); }
static inline void vstore_some(float *p, vec v, lanes l) { _mm256_maskstore_ps(p, l, v); }
static inline vec low_bf16(vec pairs) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(pairs), 16));
}
static inline vec high_bf16(vec pairs) {
    return _mm256_and_ps(pairs, _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline vec widen(const uint16_t *p) { /* 8 bfloat16 -> float32, exactly */
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
/* r[i][j] -> r[j][i] for an 8 x 8 block */
static inline void transpose(vec r[8]) {
    vec t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}
#endif

#define NR (GV * GL) /* channels per panel */
#define EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5)

/* e^a, within 2 ulp: Cephes' expf (a = n ln 2 + r, |r| <= ln 2 / 2, a degree-7 polynomial in r) */
static inline vec vexp(vec a) {
    a = vmax(vmin(a, vset(88.3762626647949f)), vset(-87.3365447505531f));
    vec n = vround(vmul(a, vset(1.44269504088896341f)));
    vec r = vfma(n, vset(-0.693359375f), a);
    r = vfma(n, vset(2.12194440e-4f), r);
    vec p = vset(1.9875691500e-4f);
    p = vfma(p, r, vset(1.3981999507e-3f));
    p = vfma(p, r, vset(8.3334519073e-3f));
    p = vfma(p, r, vset(4.1665795894e-2f));
    p = vfma(p, r, vset(1.6666665459e-1f));
    p = vfma(p, r, vset(5.0000001201e-1f));
    p = vfma(vmul(p, r), r, vadd(r, vset(1.0f)));
    return vscale(p, n);
}

/* GELU, tanh form: 0.5 a (1 + tanh(u)) = a / (1 + e^(-2u)), u = sqrt(2 / pi) (a + 0.044715 a^3) */
static inline vec vgelu_tanh(vec a) {
    vec u =
        vmul(vfma(vmul(a, a), vset(0.044715f * 0.7978845608028654f), vset(0.7978845608028654f)), a);
    return vdiv(a, vadd(vset(1.0f), vexp(vmul(u, vset(-2.0f)))));
}

enum activation { NONE = 0, GELU_TANH = 1 };

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
