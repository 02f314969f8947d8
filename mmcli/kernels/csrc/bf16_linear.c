/* y = x @ w.T (+ bias) for float32 x and bfloat16 w, float32 accumulation: the kernels
   kernels/cpu.py builds for bfloat16 weights. A bfloat16 is the high half of a float32, so widening
   is exact.

   bf16_linear, for a few rows (decode): its inputs in pairs' order (bf16_pairs: each 2 GL inputs
   as their GL even ones, then their GL odd ones), so that GL pairs of bfloat16 loaded as 32-bit
   values widen by an AND and a shift into the even and the odd inputs' weights, with no
   conversion across lanes: 1.2-1.35x the widening in place on a 2-core Zen 1 (AVX2) at 1 to 32
   rows. Each group of 3 weight rows (2 from 4 activation rows on, in tiles of 4 rows: the
   accumulators and the widened weights within AVX2's 16 registers) is widened once and used by
   every row of a tile.

   bf16_gemm, for many rows (prefill, the vision tower): the weights are widened a panel at a time
   (GKC inputs of NR output channels, transposed so that each input's NR channels are contiguous)
   into a buffer that stays in L2, and every row passes over it in tiles of GR rows x NR channels
   held in registers (float_tiles.h). Widening costs one pass over the panel for M rows of work;
   converting whole chunks and calling a BLAS costs a write and a read of float32 weights per chunk,
   and the BLAS then packs them again. */
#include "float_tiles.h"

/* pairs (M x K) <- x in pairs' order: each 2 GL inputs as the GL even then the GL odd ones; the
   last K % (2 GL) as they are. */
void bf16_pairs(const float *x, float *pairs, int64_t M, int64_t K) {
    for (int64_t m = 0; m < M; m++) {
        const float *xm = x + m * K;
        float *pm = pairs + m * K;
        int64_t k = 0;
        for (; k + 2 * GL <= K; k += 2 * GL)
            for (int j = 0; j < GL; j++) {
                pm[k + j] = xm[k + 2 * j];
                pm[k + GL + j] = xm[k + 2 * j + 1];
            }
        for (; k < K; k++) pm[k] = xm[k];
    }
}

/* A tile of 4 rows on AVX2 is bound by the FMAs, and on a Zen 1 by what shares their pipes and
   ports: GCC folded each row's inputs into both weight rows' FMAs as memory operands (loaded twice:
   2.5 loads a cycle where the CPU makes 2), and high_bf16's AND takes an FMA pipe where two shifts
   do not. Loaded once into registers, and shifted, such a tile ran 1.2-1.3x faster (M = 8 and 32,
   a 6144x2048 weight: 49-55 to 62-68 G(FL)OP/s, 69 the float32 peak); at fewer rows, bound by
   memory, the AND was faster. The AVX-512 builds are unmeasured and keep both as they were. */
#if defined(__AVX512F__)
#define FMA_BOUND_ROWS 5 /* past a tile's 4 rows: none */
#else
#define FMA_BOUND_ROWS 4
#endif

static inline vec odd_weights(vec pairs, int fma_bound) {
#if !defined(__AVX512F__)
    if (fma_bound)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_srli_epi32(_mm256_castps_si256(pairs), 16), 16));
#endif
    (void)fma_bound;
    return high_bf16(pairs);
}

/* y[m, n0:n0+NB] for MB rows in pairs' order: NB weight rows widened once per 2 GL inputs, used
   by MB rows. The next group is fetched ahead: a new row starts a new page, where the hardware's
   prefetcher stops. Tiles of fewer than FMA_BOUND_ROWS rows, bound by memory, fetch every row of
   it (the step 1.02-1.13x at 1 to 3 rows on a 2-core Zen 3); the FMAs' tiles its first row alone
   (every row cost them 7-9% at 8 and 16 rows). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const uint16_t *w,
                                                       float *y, int64_t N, int MB, int NB) {
    vec acc[4][3];
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) acc[m][n] = vzero();
    int64_t k = 0;
    for (; k + 2 * GL <= K; k += 2 * GL) {
        for (int n = 0; n < (MB < FMA_BOUND_ROWS ? NB : 1); n++)
            _mm_prefetch((const char *)(w + (NB + n) * K + k), _MM_HINT_T0);
        vec even[3], odd[3];
        for (int n = 0; n < NB; n++) {
            const vec weight_pairs = vload((const float *)(w + n * K + k));
            even[n] = low_bf16(weight_pairs);
            odd[n] = odd_weights(weight_pairs, MB >= FMA_BOUND_ROWS);
        }
        for (int m = 0; m < MB; m++) {
            vec x_even = vload(x + m * K + k), x_odd = vload(x + m * K + k + GL);
            if (MB >= FMA_BOUND_ROWS) __asm__("" : "+x"(x_even), "+x"(x_odd)); /* in registers */
            for (int n = 0; n < NB; n++) {
                acc[m][n] = vfma(x_even, even[n], acc[m][n]);
                acc[m][n] = vfma(x_odd, odd[n], acc[m][n]);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) {
            float s = vsum(acc[m][n]);
            for (int64_t r = k; r < K; r++) s += x[m * K + r] * bf16_to_float(w[n * K + r]);
            y[m * N + n] = s;
        }
}

/* every row for the NB weight rows from n, in tiles of MB rows */
#define ROWS(MB, NB)                                                                               \
    for (int64_t m = 0; m < M; m += MB) {                                                          \
        const float *xm = pairs + m * K;                                                           \
        float *ym = y + m * N + n;                                                                 \
        switch (M - m) {                                                                           \
        case 1: tile(xm, K, w + n * K, ym, N, 1, NB); break;                                       \
        case 2: tile(xm, K, w + n * K, ym, N, 2, NB); break;                                       \
        case 3: tile(xm, K, w + n * K, ym, N, 3, NB); break;                                       \
        default: tile(xm, K, w + n * K, ym, N, MB, NB); break;                                     \
        }                                                                                          \
    }

/* y (M x N, float32) = x (M x K, float32, in pairs' order: bf16_pairs) @ w.T (N x K, bfloat16
   bits), both row-major. Every output is summed in the same order whatever its tile. */
void bf16_linear(const float *pairs, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                 int threads) {
    /* groups of weight rows to whichever thread is free: a core slowed by another tenant's work
       takes fewer (equal shares wait for the slowest); each sum is the same whoever makes it.
       One row: groups of 3 weight rows on AVX2 (1.3x one weight row at a time, read in order, on
       a 2-core Zen 1); the AVX-512 build keeps one at a time (a stream a core: 12-19% faster than
       4 rows 4 KiB apart on a 2-core Zen 4, measured before the pairs' order). */
#if defined(__AVX512F__)
    if (M == 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 64)
        for (int64_t n = 0; n < N; n++) { ROWS(4, 1) }
        return;
    }
#endif
    const int64_t group = M < 4 ? 3 : 2;
    if (group == 3) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 8)
        for (int64_t n = 0; n < N / 3 * 3; n += 3) { ROWS(3, 3) }
    } else {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 16)
        for (int64_t n = 0; n < N / 2 * 2; n += 2) { ROWS(4, 2) }
    }
    for (int64_t n = N / group * group; n < N; n++) { ROWS(4, 1) }
}

/* ---- bf16_gemm ---- */

#define GKC 2048 /* inputs per panel: 2048 x 64 float32 channels, 512 KiB, stay in L2 */

/* panel[k][j] = w[j][k0 + k] in float32, for k < kc and j < NR (channels past `channels`:
   zero). */
static void pack_panel(const uint16_t *w, int64_t K, int64_t channels, int64_t k0, int64_t kc,
                       float *panel) {
    /* GL rows of 2 GL inputs at a time: the pairs of bfloat16 transposed as 32-bit values (half
       the shuffles of widening first), then each pair split into its two float32 values */
    const int64_t whole = kc / (2 * GL) * (2 * GL);
    for (int64_t g = 0; g < NR; g += GL) {
        if (g + GL <= channels) {
            for (int64_t k = 0; k < whole; k += 2 * GL) {
                vec r[GL];
                for (int i = 0; i < GL; i++)
                    r[i] = vload((const float *)(w + (g + i) * K + k0 + k));
                transpose(r);
                for (int i = 0; i < GL; i++) {
                    vstore(panel + (k + 2 * i) * NR + g, low_bf16(r[i]));
                    vstore(panel + (k + 2 * i + 1) * NR + g, high_bf16(r[i]));
                }
            }
            continue;
        }
        for (int64_t k = 0; k < whole; k++)
            for (int64_t j = g; j < g + GL; j++)
                panel[k * NR + j] = j < channels ? bf16_to_float(w[j * K + k0 + k]) : 0.0f;
    }
    for (int64_t k = whole; k < kc; k++)
        for (int64_t j = 0; j < NR; j++)
            panel[k * NR + j] = j < channels ? bf16_to_float(w[j * K + k0 + k]) : 0.0f;
}

static _Thread_local float panel_buffer[GKC * NR] __attribute__((aligned(64)));

/* y (M x N, float32) = act(x (M x K, float32) @ w.T (N x K, bfloat16 bits) + bias (N, or NULL)),
   all row-major; act is an enum activation. The threads take the panels of NR channels one at a
   time, as bf16_linear takes its rows. */
void bf16_gemm(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N,
               int64_t K, int act, int threads) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t n0 = p * NR;
        const int channels = N - n0 < NR ? (int)(N - n0) : NR;
        for (int64_t k0 = 0; k0 < K; k0 += GKC) {
            const int64_t kc = K - k0 < GKC ? K - k0 : GKC;
            pack_panel(w + n0 * K, K, channels, k0, kc, panel_buffer);
            struct ends e = {k0 == 0, k0 + kc >= K, act, bias ? bias + n0 : 0};
            panel_rows(x + k0, K, panel_buffer, NR, kc, y + n0, N, M, e, channels);
        }
    }
}
