/* The AMX tiles' configuration, which amx.c and attention.c share: Linux grants the tiles once a
   process (amx_request, in amx.c), and each thread loads its own configuration before its first
   tile instruction (every kernel at its start: another may have left other rows). */
#ifndef MMCLI_AMX_TILES_H
#define MMCLI_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

int amx_request(void);

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles tmm0-7 of 64 bytes a row, tmm t `rows[t]` (<= 16) rows. */
static inline void configure_tiles(const int rows[8]) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = (uint8_t)rows[t];
    }
    _tile_loadconfig(&c);
}
#endif
