/* What the kernels on AMX tiles share (gemm_amx.c, gemm_bf16.c's tile GEMM, lora.c's long bf16
 * segments): the CPU check with the kernel's permission for the tile data, and the one tile
 * configuration they all use (eight tiles of 16 rows x 64 bytes). Included where the build has
 * AMX-TILE (loraplex/kernels/native.py hashes every header into each build's cache key). */
#ifndef LORAPLEX_AMX_TILES_H
#define LORAPLEX_AMX_TILES_H

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* 1: the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the tile data
 * (ARCH_REQ_XCOMP_PERM for XTILEDATA; asking again is harmless). Needs _GNU_SOURCE. */
static inline int amx_request(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return 0;  /* AMX-BF16, AMX-TILE */
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* this thread's tiles 0-7 as 16 rows x 64 bytes (palette 1) */
static inline void amx_config(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

#endif /* LORAPLEX_AMX_TILES_H */
