/* The tile-op layer the amx kernels are written against: configure, load, store, zero, and the int8 dot
 * products, in two implementations chosen when a kernel file includes this header:
 *
 *   hardware (default)     the AMX instructions (AMX-TILE + AMX-INT8), for the amx tier on a CPU that has them;
 *   BL_AMX_EMULATED        plain C with the instructions' documented semantics (Intel SDM, TILELOADD,
 *                          TILESTORED, TILEZERO, TDPB[SU,SS]D), so the same kernel source runs and is tested on
 *                          any x86 CPU ("amx-emulated", never chosen at run time).
 *
 * A kernel names its tiles by number (0..7, constants: the instructions encode them) and describes their
 * shapes with a bl_tile_config; rows and bytes a row as the instructions take them. The emulation checks the
 * shapes every dot product needs (A's bytes a row = 4 x B's rows, C's rows = A's, C's bytes a row = B's) and
 * aborts on a mismatch, which the hardware would not report, so a shape bug fails every test run through it. */
#ifndef BARELLM_AMX_TILE_H
#define BARELLM_AMX_TILE_H

#include <stdint.h>

/* Palette 1's layout of the 64-byte configuration LDTILECFG reads. */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes a row, tiles 0..7 (8..15 reserved, zero) */
    uint8_t rows[16];   /* rows, tiles 0..7 */
} bl_tile_config;
_Static_assert(sizeof(bl_tile_config) == 64, "LDTILECFG reads 64 bytes");

static inline void bl_tile_shape(bl_tile_config *c, int tile, int rows, int colsb) {
    c->palette = 1;
    c->rows[tile] = (uint8_t)rows;
    c->colsb[tile] = (uint16_t)colsb;
}

#ifdef BL_AMX_EMULATED

/* emulation state: the calling thread's eight tiles and its configuration (amx/tile_emulated.c) */
void bl_emu_tile_config(const bl_tile_config *c);
void bl_emu_tile_release(void);
void bl_emu_tile_zero(int t);
void bl_emu_tile_load(int t, const void *base, long stride);
void bl_emu_tile_store(int t, void *base, long stride);
void bl_emu_tile_dp(int c, int a, int b, int a_signed, int b_signed);

#define BL_TILE_CONFIG(cfg) bl_emu_tile_config(cfg)
#define BL_TILE_RELEASE() bl_emu_tile_release()
#define BL_TILE_ZERO(t) bl_emu_tile_zero(t)
#define BL_TILE_LOAD(t, base, stride) bl_emu_tile_load(t, base, (long)(stride))
#define BL_TILE_STORE(t, base, stride) bl_emu_tile_store(t, base, (long)(stride))
#define BL_TILE_DPBSSD(c, a, b) bl_emu_tile_dp(c, a, b, 1, 1) /* C += A (signed) . B (signed) */
#define BL_TILE_DPBSUD(c, a, b) bl_emu_tile_dp(c, a, b, 1, 0) /* C += A (signed) . B (unsigned) */

#else

/* The instructions written out rather than through <immintrin.h>'s macros: GCC 12's tell the compiler that
 * LDTILECFG reads 8 bytes of its configuration and TILELOADD no memory at all, so it may drop the stores
 * that fill a configuration or move a plain store past the tile load that reads it. Every op that touches
 * memory here says so ("memory"). Tile numbers go through one more macro level so that names expand to
 * their numbers before they are pasted into the instruction. */
#define BL_TILE_STR_(x) #x
#define BL_TILE_STR(x) BL_TILE_STR_(x)
#define BL_TILE_CONFIG(cfg) __asm__ volatile("ldtilecfg %0" ::"m"(*(const bl_tile_config *)(cfg)) : "memory")
#define BL_TILE_RELEASE() __asm__ volatile("tilerelease" ::: "memory")
#define BL_TILE_ZERO(t) __asm__ volatile("tilezero %%tmm" BL_TILE_STR(t) ::)
#define BL_TILE_LOAD(t, base, stride)                                                                    \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" BL_TILE_STR(t)::"r"((const void *)(base)),              \
                     "r"((long)(stride))                                                                 \
                     : "memory")
#define BL_TILE_STORE(t, base, stride)                                                                   \
    __asm__ volatile("tilestored %%tmm" BL_TILE_STR(t) ", (%0,%1,1)" ::"r"((void *)(base)),                \
                     "r"((long)(stride))                                                                 \
                     : "memory")
#define BL_TILE_DP_(op, c, a, b)                                                                         \
    __asm__ volatile(op " %%tmm" BL_TILE_STR(b) ", %%tmm" BL_TILE_STR(a) ", %%tmm" BL_TILE_STR(c) ::)
#define BL_TILE_DPBSSD(c, a, b) BL_TILE_DP_("tdpbssd", c, a, b) /* C += A (signed) . B (signed) */
#define BL_TILE_DPBSUD(c, a, b) BL_TILE_DP_("tdpbsud", c, a, b) /* C += A (signed) . B (unsigned) */

#endif

#endif
