/* What the kernels that run on AMX tiles share (quant_matmul_amx.h, prefill_attention_amx.h):
 * Linux's permission for the tiles' state, asked once per library, and the tile
 * configuration's layout. Each library asks for itself: they are separate shared objects. */
#ifndef KVSERVE_AMX_TILES_H
#define KVSERVE_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = 0; /* 0 not asked yet, 1 granted, -1 refused or switched off */

static int amx_granted(void) {
    if (amx_state == 0)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* All eight tiles 16 rows of 64 bytes: 16 x 16 float32 sums, or 16 rows of 32 bfloat16. */
static void configure_tiles(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

#endif
