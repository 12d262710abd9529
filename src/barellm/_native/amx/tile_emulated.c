/* The tile instructions in plain C (amx/tile.h, BL_AMX_EMULATED), as the Intel SDM defines them for palette 1:
 * eight tiles of up to 16 rows of 64 bytes a thread; a load or a zero fills the configured rows and bytes and
 * clears the rest of the tile; a dot product C[m][n] += sum over k < A's bytes / 4 of the four byte products
 * A[m][4k + i] * B[k][4n + i], in int32 with wrap-around, for C's configured rows and dwords. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BL_AMX_EMULATED
#include "amx/tile.h"

typedef struct {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
} emu_state;

static _Thread_local emu_state emu;

static void fail(const char *what, int t) {
    fprintf(stderr, "barellm: emulated tile op: %s (tile %d)\n", what, t);
    abort();
}

static void check(int t) {
    if (!emu.configured) fail("no tile configuration loaded", t);
    if (t < 0 || t > 7) fail("no such tile", t);
    if (emu.rows[t] == 0 || emu.rows[t] > 16 || emu.colsb[t] == 0 || emu.colsb[t] > 64)
        fail("tile not configured for this use", t);
}

void bl_emu_tile_config(const bl_tile_config *c) {
    if (c->palette != 1) fail("palette other than 1", -1);
    memset(&emu, 0, sizeof emu);
    for (int t = 0; t < 8; t++) emu.rows[t] = c->rows[t], emu.colsb[t] = c->colsb[t];
    emu.configured = 1;
}

void bl_emu_tile_release(void) { memset(&emu, 0, sizeof emu); }

void bl_emu_tile_zero(int t) {
    check(t);
    memset(emu.data[t], 0, sizeof emu.data[t]);
}

void bl_emu_tile_load(int t, const void *base, long stride) {
    check(t);
    memset(emu.data[t], 0, sizeof emu.data[t]);
    for (int m = 0; m < emu.rows[t]; m++) memcpy(emu.data[t][m], (const uint8_t *)base + m * stride, emu.colsb[t]);
}

void bl_emu_tile_store(int t, void *base, long stride) {
    check(t);
    for (int m = 0; m < emu.rows[t]; m++) memcpy((uint8_t *)base + m * stride, emu.data[t][m], emu.colsb[t]);
}

/* The operands widened to int32 first, so that the loop over C's dwords vectorizes (the tests run every amx
 * kernel through here); cloned for AVX2, chosen when the core loads. */
__attribute__((target_clones("avx2", "default"))) void bl_emu_tile_dp(int c, int a, int b, int a_signed,
                                                                       int b_signed) {
    check(c), check(a), check(b);
    if (c == a || c == b || a == b) fail("a dot product's tiles must differ", c);
    if (emu.colsb[a] % 4 || emu.colsb[a] / 4 != emu.rows[b]) fail("A's bytes a row are not 4 x B's rows", a);
    if (emu.rows[c] != emu.rows[a]) fail("C's rows are not A's", c);
    if (emu.colsb[c] != emu.colsb[b] || emu.colsb[c] % 4) fail("C's bytes a row are not B's", c);
    const int K = emu.colsb[a] / 4, N = emu.colsb[c] / 4;
    int32_t wb[16][4][16] = {{{0}}}; /* B[k][4n + i] as wb[k][i][n] */
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++)
            for (int i = 0; i < 4; i++) {
                const uint8_t y = emu.data[b][k][4 * n + i];
                wb[k][i][n] = b_signed ? (int8_t)y : y;
            }
    for (int m = 0; m < emu.rows[c]; m++) {
        uint32_t acc[16];
        memcpy(acc, emu.data[c][m], 64);
        for (int k = 0; k < K; k++)
            for (int i = 0; i < 4; i++) {
                const uint8_t x = emu.data[a][m][4 * k + i];
                const int32_t xv = a_signed ? (int8_t)x : x;
                for (int n = 0; n < 16; n++) acc[n] += (uint32_t)(xv * wb[k][i][n]); /* wraps, as the instruction */
            }
        memcpy(emu.data[c][m], acc, (size_t)N * 4);
    }
}
