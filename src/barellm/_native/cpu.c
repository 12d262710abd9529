/* CPU feature detection and the choice of kernel tier: one place asks the CPU and the OS what can run.
 *
 * A tier needs its instructions (CPUID) and the OS's saving of their register state across context switches
 * (XGETBV's XCR0): YMM for avx2, opmask + ZMM for avx512, and for amx the tile state, which Linux also
 * makes a process ask for (arch_prctl ARCH_REQ_XCOMP_PERM; the permission covers every thread of the process,
 * the pool's included). A CPU that lists AMX but where a tile instruction still faults (a hypervisor that
 * hides the state) is found by a probe under a signal handler and falls back to avx512: never a fault later. */
#include <setjmp.h>
#include <stdio.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "tier.h"
#include "amx/amx.h"

static int g_isa = -1;
static int g_tiers = -1;
static int g_amx_emulated; /* the amx kernels run on the tile emulation (tests only) */

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

/* ---- the decode tiles' prefetch rules ----
 *
 * Defaults (tuned on Zen 3, kept wherever nothing better was measured): into L1 (T0), 4 KB ahead for the
 * Q4_0/Q4_1/Q8_0 tiles (avx2/quant.c says why), 8 KB for the K-quant tiles, 16 KB and past the outer
 * caches (NTA) when threads stream together (kernels.h, avx2/quant_kq.c).
 *
 * Zen 4 (AMD family 19h with AVX-512): the K-quant tiles prefetch into L2 (T1) 8 KB ahead, alone and
 * shared. Its L1 is 32 KB, and T0 prefetches several KB ahead of two streams crowd it. One thread streaming
 * Qwen2.5-Coder-1.5B's Q4_K matrices from memory went from 19-21 GB/s (T0, 8 KB) to 24-27 GB/s (T1, 4-8 KB),
 * and the avx2 tiles from 15-16 to 19-21 GB/s (bench/kernels.py cold rows, 2 rounds). Further ahead did worse
 * with either hint (16-32 KB: 16-19 GB/s). The model's decode (barellm bench -p 0 -n 64, 2 rounds) went from
 * 23.9-24.5 to 27.0-29.1 tokens/s at 1 thread, and from 31.7-34.8 (NTA 16 KB) to 44.9-47.5 at 2 in 3 of 4
 * rounds (the fourth 30.6: two threads' figures swing on this shared machine). The Q4_0/Q4_1/Q8_0 tiles keep
 * the defaults: SmolLM2's decode was 195-197 tokens/s at 1 thread with T0 4 KB, 169 with T1 4 KB, 196-200 with
 * T1 8 KB, and its 2-thread figures were within their noise.
 *
 * Zen 4, the MXFP4 tiles: into L2 (T1) 24 KB ahead, alone and shared. gpt-oss-20b's experts (2880 x 2880,
 * 17 bytes per 32 values) streamed from memory at T = 1 by one thread at 13.7 GB/s with the blocks' T0 4 KB,
 * 17.2-17.5 with T1 4-8 KB, 21.0 with T1 16 KB, 21.9 with T1 24 KB, 20.2-20.6 with T1 32-64 KB, 16.9 with NTA
 * 16 KB (bench/kernels.py --model gptoss -T 1 --cold-mb 64, avx512 i8x2 cold rows). Its 8-layer cut decoded
 * 26-28 tokens/s with the blocks' rule and 37.6-38.6 with this one at 2 threads (the moe op from 14.8 to 10.0
 * ms a token). The same rule for every Q4_0/Q4_1/Q8_0 tile made SmolLM2's 2-thread decode slower (303-311 to
 * 257-264 tokens/s): from memory, one thread read its short-row matrices (groups of 8 rows of 2.9-4.9 KB)
 * slower with it (q 576 x 576 Q4_1 18 -> 16 GB/s, k/v 192 x 576 16 -> 10, gate/up 1536 x 576 20 -> 16) and
 * its long-row one faster (down 576 x 1536, 7.7 KB groups: 13.5 -> 18), bench/kernels.py cold rows. So it
 * also takes the blocks' tiles over groups of 6 KB or more (BL_PF_BLOCKS_LONG: gpt-oss's Q8_0 attention and
 * output, 24-35 KB groups; SmolLM2's down): per-op cycles of gpt-oss-20b's 8-layer cut at 2 threads, the two
 * rules alternated in one process (10 rounds of 4 tokens, medians; k and v on the short rule in that run):
 * output 19.1 -> 18.3 ms a token, qkv 3.9 -> 3.8, the token 41.9 -> 40.9 ms; SmolLM2 (30 rounds of 20) down
 * 0.64 -> 0.63 ms, the token 3.33 -> 3.30.
 *
 * Intel: threads streaming together prefetch into L1 (T0) 16 KB ahead, never NTA. On a Xeon with AVX-512
 * and AMX (2 MB L2 a core), an NTA line skips L2 and the L2 streamer does not follow it, so two threads'
 * NTA prefetches starved each other: Qwen2.5-Coder-1.5B decoded 8.8-9.4 tokens/s at 2 threads against
 * 13.2 at 1. With T0 at 2 threads: 8 KB 15-24 (a wide spread), 16 KB 20-22.4, T1 16 KB 19-21, T1 4-8 KB
 * 13-21 (barellm bench -p 0 -n 64, 2-4 rounds). Alone, T0 8 KB stays: T0 4 or 16 KB and T1 8 KB were within
 * its noise (11.4-13.1 tokens/s). */
bl_prefetch_rule bl_prefetch_rules[BL_PF_FAMILIES][2] = {
    [BL_PF_BLOCKS] = {{BL_PF_L1, 4096}, {BL_PF_L1, 4096}},
    [BL_PF_KQUANTS] = {{BL_PF_L1, 8192}, {BL_PF_NTA, 16384}},
    [BL_PF_MXFP4] = {{BL_PF_L1, 4096}, {BL_PF_L1, 4096}},
    [BL_PF_BLOCKS_LONG] = {{BL_PF_L1, 4096}, {BL_PF_L1, 4096}}, /* the blocks' rule but where a CPU's differs */
};
static const char *prefetch_why = "defaults";
static char prefetch_text[224];

static const char *const HINTS[] = {"none", "l1", "l2", "nta"};

#if defined(__x86_64__)
static int vendor_is(const char *want) {
    uint32_t a, b, c, d;
    char vendor[13] = {0};
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    memcpy(vendor, &b, 4), memcpy(vendor + 4, &d, 4), memcpy(vendor + 8, &c, 4);
    return strcmp(vendor, want) == 0;
}

static int is_zen4(void) {
    uint32_t a, b, c, d;
    if (!vendor_is("AuthenticAMD") || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned family = (a >> 8 & 15) + (a >> 20 & 255);
    return family == 0x19 && (bl_cpu_tiers() >> BL_ISA_AVX512 & 1); /* Zen 3 is 19h without AVX-512 */
}

static int is_intel(void) { return vendor_is("GenuineIntel"); }
#else
static int is_zen4(void) { return 0; }
static int is_intel(void) { return 0; }
#endif

/* "HINT:BYTES" (hint none, l1, l2 or nta) into *r; 0 if it parses */
static int parse_rule(const char *s, size_t n, bl_prefetch_rule *r) {
    for (int h = 0; h < 4; h++) {
        const size_t k = strlen(HINTS[h]);
        if (n == k && h == BL_PF_NONE && strncmp(s, HINTS[h], k) == 0) return r->hint = h, r->bytes = 0, 0;
        if (n > k + 1 && strncmp(s, HINTS[h], k) == 0 && s[k] == ':') {
            char *end;
            const long v = strtol(s + k + 1, &end, 10);
            if (end != s + n || v < 64 || v > (1 << 20)) return -1;
            return r->hint = h, r->bytes = (int)v, 0;
        }
    }
    return -1;
}

/* BARELLM_PREFETCH="ALONE[,SHARED]" (each HINT:BYTES or none) sets both families' rules; 0 if it parses */
static int prefetch_from_env(const char *v) {
    bl_prefetch_rule alone, shared;
    const char *comma = strchr(v, ',');
    if (parse_rule(v, comma ? (size_t)(comma - v) : strlen(v), &alone) < 0) return -1;
    shared = alone;
    if (comma && parse_rule(comma + 1, strlen(comma + 1), &shared) < 0) return -1;
    for (int f = 0; f < BL_PF_FAMILIES; f++) bl_prefetch_rules[f][0] = alone, bl_prefetch_rules[f][1] = shared;
    return 0;
}

static void choose_prefetch(void) {
    const char *v = getenv("BARELLM_PREFETCH"); /* set but empty: unset */
    if (v && *v && prefetch_from_env(v) == 0) {
        prefetch_why = "BARELLM_PREFETCH";
    } else if (is_zen4()) {
        const bl_prefetch_rule l2 = {BL_PF_L2, 8192}, l2_far = {BL_PF_L2, 24576};
        bl_prefetch_rules[BL_PF_KQUANTS][0] = bl_prefetch_rules[BL_PF_KQUANTS][1] = l2;
        bl_prefetch_rules[BL_PF_MXFP4][0] = bl_prefetch_rules[BL_PF_MXFP4][1] = l2_far;
        bl_prefetch_rules[BL_PF_BLOCKS_LONG][0] = bl_prefetch_rules[BL_PF_BLOCKS_LONG][1] = l2_far;
        prefetch_why = "zen4";
    } else if (is_intel()) {
        const bl_prefetch_rule l1 = {BL_PF_L1, 16384};
        bl_prefetch_rules[BL_PF_KQUANTS][1] = l1;
        prefetch_why = "intel";
    }
}

const char *bl_prefetch_describe(void) {
    const bl_prefetch_rule(*r)[2] = bl_prefetch_rules;
    snprintf(prefetch_text, sizeof prefetch_text,
             "kquants %s:%d %s:%d, blocks %s:%d %s:%d, long blocks %s:%d %s:%d, mxfp4 %s:%d %s:%d (%s)",
             HINTS[r[1][0].hint], r[1][0].bytes, HINTS[r[1][1].hint], r[1][1].bytes, HINTS[r[0][0].hint],
             r[0][0].bytes, HINTS[r[0][1].hint], r[0][1].bytes, HINTS[r[3][0].hint],
             r[3][0].bytes, HINTS[r[3][1].hint], r[3][1].bytes, HINTS[r[2][0].hint], r[2][0].bytes,
             HINTS[r[2][1].hint], r[2][1].bytes, prefetch_why);
    return prefetch_text;
}

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
        choose_prefetch();
        const char *want = getenv("BARELLM_ISA");
        const int cap = want ? bl_isa_from_name(want) : -1;
        bl_set_isa(cap >= 0 ? (enum bl_isa)cap : (enum bl_isa)(BL_ISA_COUNT - 1));
        const char *min_tokens = getenv("BARELLM_AMX_MIN_TOKENS");
        if (min_tokens && atoi(min_tokens) > 0) bl_amx_min_tokens = atoi(min_tokens);
    }
    return (enum bl_isa)g_isa;
}

/* the kernels are laid together once per change of tier, not looked up per call */
enum bl_isa bl_set_isa(enum bl_isa isa) {
    g_isa = (int)best_under((int)isa);
    g_amx_emulated = 0;
    bl_tiers_resolve(g_isa);
    return (enum bl_isa)g_isa;
}

int bl_set_amx_emulated(void) {
#if defined(__x86_64__)
    if (g_isa < 0) bl_isa();
    g_isa = (int)best_under(BL_ISA_AVX512);
    g_amx_emulated = 1;
    bl_tiers_resolve_amx_emulated(g_isa);
    return 1;
#else
    return 0;
#endif
}

int bl_amx_emulated(void) { return g_amx_emulated; }
