/* int4's weights dequantized to bfloat16 for a bfloat16 GEMM (kernels/matrix.py's int4 tiles),
   one tile of output channels at a time, in one pass: torch's CPU int4 layout in (blocks of 64
   output channels, each input's 64 values in 32 bytes, the low nibbles the block's first 32),
   value = (q - 8) * scale + zero per group of inputs, [inputs][channels] out (the GEMM's B
   operand), rounded to nearest even as torch's conversion rounds. */
#include "float_tiles.h"

/* One input's 64 values of one block into row: its scales and zeros are pairs[2 n], [2 n + 1]. */
static void dequantize_block(const uint8_t *bytes, const uint16_t *pairs, int64_t first,
                             uint16_t *row) {
    for (int j = 0; j < 32; j++) {
        const int64_t lo = first + j, hi = lo + 32;
        const float low = (float)((bytes[j] & 15) - 8), high = (float)((bytes[j] >> 4) - 8);
        row[j] =
            bf16_rounded(low * bf16_to_float(pairs[2 * lo]) + bf16_to_float(pairs[2 * lo + 1]));
        row[j + 32] =
            bf16_rounded(high * bf16_to_float(pairs[2 * hi]) + bf16_to_float(pairs[2 * hi + 1]));
    }
}

/* Output channels [64 first_block, 64 (first_block + blocks)) of a [out_features, in] int4
   weight (scales_zeros [in / group][out_features][2] bfloat16) into dest [in][64 blocks]. */
void int4_dequantize(const uint8_t *packed, const uint16_t *scales_zeros, int64_t in,
                     int64_t out_features, int64_t group, int64_t first_block, int64_t blocks,
                     uint16_t *dest, int threads) {
    const int64_t width = blocks * 64;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < in; k++) {
        const uint16_t *pairs = scales_zeros + (k / group) * out_features * 2;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t block = first_block + b;
            dequantize_block(packed + (block * in + k) * 32, pairs, block * 64,
                             dest + k * width + b * 64);
        }
    }
}
