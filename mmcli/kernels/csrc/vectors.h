/* Float32 vectors for the C kernels: AVX-512 where the build has it, else AVX2 (GL lanes), the
   operations on them, e^x and GELU's tanh form, and bfloat16 widened exactly. float_tiles.h builds
   its tiles on them; int8_linear.c applies its activation with them. */
#ifndef MMCLI_VECTORS_H
#define MMCLI_VECTORS_H
#include <immintrin.h>
#include <stdint.h>

/* An output of more bytes than this outgrows the cores' L2 before it is read again: a kernel
   stores it past the caches (vstream, to addresses aligned to a vector), which skips the read of
   each line that a store into a line not cached makes first (a prefill's products: 1.2-1.4x). A
   decode step's outputs, read by its next product, stay cached. */
#define STREAM_BYTES (4 << 20)

/* Values below which a pass over them stays on the calling thread: a parallel region costs more
   than a few rows' work (a decode step's 8 rows of 2048 stay on one). */
#define PARALLEL_VALUES (1 << 16)

/* Whether `n` float32 outputs at y, `cols` a row, are stored past the caches: rows of whole,
   aligned vectors */
#define STREAMED(y, n, cols)                                                                       \
    ((n) * 4 > STREAM_BYTES && (uintptr_t)(y) % 64 == 0 && (cols) % 16 == 0)

/* A bfloat16 is the top half of a float32: widening it is exact. */
static inline float bf16_to_float(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } c = {(uint32_t)h << 16};
    return c.f;
}

/* A float32 rounded to the nearest bfloat16, ties to even, as torch converts (a NaN stays one). */
static inline uint16_t bf16_rounded(float f) {
    union {
        float f;
        uint32_t u;
    } v = {f};
    if (f != f) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

/* Bytes fetched into the cache ahead of their use, `lines` cache lines a call of fetch_ahead:
   the next block's weights while a kernel computes on this block's (bf16_dot.c, int4_vnni.c).
   Where a kernel's rows pass over a block more than once, the first pass read it from memory,
   the arithmetic waiting, and the others from the cache while memory idled. */
struct ahead {
    const char *next, *end;
    int64_t lines;
};

static inline void fetch_ahead(struct ahead *a) {
    for (int64_t i = 0; i < a->lines && a->next < a->end; i++, a->next += 64)
        _mm_prefetch(a->next, _MM_HINT_T2);
}

#if defined(__AVX512F__)
#define GL 16 /* channels per vector */
typedef __m512 vec;
typedef __mmask16 lanes;
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }
static inline void vstream(float *p, vec v) { _mm512_stream_ps(p, v); }
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
/* 16 float32 rounded to bfloat16 at p, each as bf16_rounded (ties to even; a NaN stays one) */
static inline void store_bf16(uint16_t *p, vec v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
/* int4's scale and zero of 16 channels from their bfloat16 pairs (scale the lower half) */
static inline void scale_zero(const uint32_t *pairs, __m512 *scale, __m512 *zero) {
    const __m512i sz = _mm512_loadu_si512(pairs);
    *scale = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
    *zero = _mm512_castsi512_ps(_mm512_and_si512(sz, _mm512_set1_epi32(~0xFFFF)));
}

/* lane i: the sum of a[i]'s 16 lanes, for 16 vectors, by the same pairing for every i (bf16_dot.c's
   sums, decode_layer.c's scores) */
static inline __m512 sum16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                         _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
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
#define GL 8
typedef __m256 vec;
typedef __m256i lanes;
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }
static inline void vstream(float *p, vec v) { _mm256_stream_ps(p, v); }
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
/* 8 float32 rounded to bfloat16 at p, each as bf16_rounded (ties to even; a NaN stays one) */
static inline void store_bf16(uint16_t *p, vec v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    r = _mm256_srli_epi32(r, 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    /* values below 2^16: packing without saturation, the two halves' quads put in order */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
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

/* The vector from element i of a float32 tensor or, with bf16, of a bfloat16 one: read widened
   exactly, written rounded as torch rounds float32 */
static inline vec load_as(const void *p, int64_t i, int bf16) {
    return bf16 ? widen((const uint16_t *)p + i) : vload((const float *)p + i);
}
static inline void store_as(void *p, int64_t i, vec v, int bf16) {
    if (bf16)
        store_bf16((uint16_t *)p + i, v);
    else
        vstore((float *)p + i, v);
}

/* Vector i of a residual row x plus its update (as load_as reads it), written to sum; x's own
   where there is no update (NULL), sum unwritten: the add the norms take before them */
static inline vec add_update(const float *x, const void *update, int update_bf16, float *sum,
                             int64_t i) {
    vec v = vload(x + i);
    if (update) {
        v = vadd(v, load_as(update, i, update_bf16));
        vstore(sum + i, v);
    }
    return v;
}

/* e^a, within 2 ulp: Cephes' expf (a = n ln 2 + r, |r| <= ln 2 / 2, a degree-7 polynomial in r);
   e^-87 (a normal float) below -87: a subnormal result (or operand after it) costs the core a
   microcode assist of a hundred cycles or more, and GELU, SiLU and a softmax meet one for every
   value they send below -87 (GELU at 7-10x its cost on a GEMM's outputs of deviation 32). */
static inline vec vexp(vec a) {
    a = vmax(vmin(a, vset(88.3762626647949f)), vset(-87.0f));
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

/* 2^a for a <= 0, within 2.7e-6 of it: a softmax's exponentials, its scale times log2(e) (one
   multiply fewer), whose probabilities are rounded to bfloat16 (steps of 2^-8) and summed in
   float32, where vexp's precision is wasted: a degree-4 polynomial in a's fraction, scaled by
   its whole part; 2^-125 below that, a normal float (vexp's reason; vscale's AVX2 form takes no
   n below -126 either). 7 operations for vexp's 15. */
static inline vec vexp2_softmax(vec a) {
    a = vmax(a, vset(-125.0f));
    const vec n = vround(a), r = vsub(a, n);
    vec p = vfma(vset(9.570102207e-3f), r, vset(5.591786280e-2f));
    p = vfma(p, r, vset(2.402474433e-1f));
    p = vfma(p, r, vset(6.931217909e-1f));
    return vscale(vfma(p, r, vset(9.999992847e-1f)), n);
}

/* GELU, tanh form: 0.5 a (1 + tanh(u)) = a / (1 + e^(-2u)), u = sqrt(2 / pi) (a + 0.044715 a^3) */
static inline vec vgelu_tanh(vec a) {
    vec u =
        vmul(vfma(vmul(a, a), vset(0.044715f * 0.7978845608028654f), vset(0.7978845608028654f)), a);
    return vdiv(a, vadd(vset(1.0f), vexp(vmul(u, vset(-2.0f)))));
}

enum activation { NONE = 0, GELU_TANH = 1 };

#endif
