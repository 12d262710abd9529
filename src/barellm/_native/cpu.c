/* CPU feature detection and the choice of kernel tier: one place asks the CPU and the OS what can run.
 *
 * A tier needs its instructions (CPUID) and the OS's saving of their register state across context switches
 * (XGETBV's XCR0): YMM for avx2, opmask + ZMM for avx512, and for amx the tile state, which Linux also
 * makes a process ask for (arch_prctl ARCH_REQ_XCOMP_PERM; the permission covers every thread of the process,
 * the pool's included). A CPU that lists AMX but where a tile instruction still faults (a hypervisor that
 * hides the state) is found by a probe under a signal handler and falls back to avx512: never a fault later. */
#include <setjmp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "tier.h"

static int g_isa = -1;
static int g_tiers = -1;

static const char *const NAMES[BL_ISA_COUNT] = {"scalar", "avx2", "avx512", "amx"};

#if defined(__x86_64__)
static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}

static sigjmp_buf probe_jmp;
static void probe_fault(int sig) { siglongjmp(probe_jmp, sig); }

/* loads a one-tile configuration, zeroes the tile, releases: what every AMX kernel starts with */
__attribute__((target("amx-tile"), noinline)) static void amx_probe(void) {
    uint8_t cfg[64] __attribute__((aligned(64)));
    memset(cfg, 0, sizeof cfg);
    cfg[0] = 1;                  /* palette 1 */
    cfg[16] = 64;                /* tile 0: 64 bytes a row */
    cfg[48] = 16;                /* 16 rows */
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
    __asm__ volatile("tilezero %%tmm0" ::: "memory");
    __asm__ volatile("tilerelease" ::: "memory");
}

static int amx_usable(void) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 0;
    struct sigaction fault = {0}, old_ill, old_segv;
    fault.sa_handler = probe_fault;
    sigemptyset(&fault.sa_mask);
    sigaction(SIGILL, &fault, &old_ill);
    sigaction(SIGSEGV, &fault, &old_segv);
    int ok = 0;
    if (sigsetjmp(probe_jmp, 1) == 0) {
        amx_probe();
        ok = 1;
    }
    sigaction(SIGILL, &old_ill, NULL);
    sigaction(SIGSEGV, &old_segv, NULL);
    return ok;
}

static unsigned detect_tiers(void) {
    unsigned tiers = 1u << BL_ISA_SCALAR;
    uint32_t a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return tiers;
    const int osxsave = c >> 27 & 1, fma = c >> 12 & 1, f16c = c >> 29 & 1, avx = c >> 28 & 1;
    if (!osxsave || !avx) return tiers;
    const uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return tiers; /* XMM and YMM state */
    if (__get_cpuid_max(0, NULL) < 7) return tiers;
    __cpuid_count(7, 0, a, b, c, d);
    const int avx2 = b >> 5 & 1, f = b >> 16 & 1, dq = b >> 17 & 1, bw = b >> 30 & 1, vl = b >> 31 & 1;
    const int vnni = c >> 11 & 1, amx_tile = d >> 24 & 1, amx_int8 = d >> 25 & 1;
    if (!(avx2 && fma && f16c)) return tiers;
    tiers |= 1u << BL_ISA_AVX2;
    if (!(f && dq && bw && vl && vnni) || (xcr0 & 0xe0) != 0xe0) return tiers; /* opmask, ZMM_Hi256, Hi16_ZMM */
    tiers |= 1u << BL_ISA_AVX512;
    if (amx_tile && amx_int8 && (xcr0 & 0x60000) == 0x60000 && amx_usable()) tiers |= 1u << BL_ISA_AMX;
    return tiers;
}
#else
static unsigned detect_tiers(void) { return 1u << BL_ISA_SCALAR; }
#endif

unsigned bl_cpu_tiers(void) {
    if (g_tiers < 0) g_tiers = (int)detect_tiers();
    return (unsigned)g_tiers;
}

const char *bl_isa_name(enum bl_isa isa) { return isa >= 0 && isa < BL_ISA_COUNT ? NAMES[isa] : "?"; }

int bl_isa_from_name(const char *name) {
    for (int i = 0; i < BL_ISA_COUNT; i++)
        if (strcmp(name, NAMES[i]) == 0) return i;
    return -1;
}

/* the best tier offered at or under cap */
static enum bl_isa best_under(int cap) {
    const unsigned tiers = bl_cpu_tiers();
    for (int i = cap < BL_ISA_COUNT ? cap : BL_ISA_COUNT - 1; i > 0; i--)
        if (tiers >> i & 1) return (enum bl_isa)i;
    return BL_ISA_SCALAR;
}

enum bl_isa bl_isa(void) {
    if (g_isa < 0) {
        /* BARELLM_ISA caps the tier; a name that is not a tier's is refused by the Python side (cpu.py)
         * before the core loads, so here it means no cap */
        const char *want = getenv("BARELLM_ISA");
        const int cap = want ? bl_isa_from_name(want) : -1;
        bl_set_isa(cap >= 0 ? (enum bl_isa)cap : (enum bl_isa)(BL_ISA_COUNT - 1));
    }
    return (enum bl_isa)g_isa;
}

/* the kernels are laid together once per change of tier, not looked up per call */
enum bl_isa bl_set_isa(enum bl_isa isa) {
    g_isa = (int)best_under((int)isa);
    bl_tiers_resolve(g_isa);
    return (enum bl_isa)g_isa;
}
