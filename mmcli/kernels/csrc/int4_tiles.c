/* int4's weights dequantized to bfloat16 for a GEMM (kernels/matrix.py's int4 tiles), one tile of
   output channels at a time, in one pass: torch's CPU int4 layout in (blocks of 64 output channels
   with AVX-512, 32 with AVX2, each input's values of a block in block / 2 bytes, the low nibbles
   the block's first half), value = (q - 8) * scale + zero per group of inputs, [inputs][channels]
   out (the GEMM's B operand), rounded to nearest even as torch's conversion rounds. */
#include "float_tiles.h"

/* One input's `half` x 2 values of one block into row: its scales and zeros are pairs[2 n],
   [2 n + 1]. */
static void dequantize_block(const uint8_t *bytes, const uint16_t *pairs, int64_t first, int half,
                             uint16_t *row) {
    for (int j = 0; j < half; j++) {
        const int64_t lo = first + j, hi = lo + half;
        const float low = (float)((bytes[j] & 15) - 8), high = (float)((bytes[j] >> 4) - 8);
        row[j] =
            bf16_rounded(low * bf16_to_float(pairs[2 * lo]) + bf16_to_float(pairs[2 * lo + 1]));
        row[j + half] =
            bf16_rounded(high * bf16_to_float(pairs[2 * hi]) + bf16_to_float(pairs[2 * hi + 1]));
    }
}

/* Output channels [size first_block, size (first_block + blocks)) of a [out_features, in] int4
   weight packed in blocks of `size` channels (scales_zeros [in / group][out_features][2]
   bfloat16) into dest [in][size blocks]. */
void int4_dequantize(const uint8_t *packed, const uint16_t *scales_zeros, int64_t in,
                     int64_t out_features, int64_t group, int64_t size, int64_t first_block,
                     int64_t blocks, uint16_t *dest, int threads) {
    const int64_t width = blocks * size;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < in; k++) {
        const uint16_t *pairs = scales_zeros + (k / group) * out_features * 2;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t block = first_block + b;
            dequantize_block(packed + (block * in + k) * (size / 2), pairs, block * size,
                             (int)size / 2, dest + k * width + b * size);
        }
    }
}
