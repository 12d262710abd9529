/* How close the K-quant decode tiles stream to a plain read of the same memory.
 *
 *   cc -O3 -std=gnu11 -pthread -ffunction-sections -fdata-sections -Wl,--gc-sections \
 *      -Isrc/barellm/_native bench/tile_stream.c -o /tmp/tile_stream && /tmp/tile_stream [MB] [rounds]
 *
 * Decode is bandwidth-bound only if the tile (avx2/quant_kq.c, one token: NT = 1) keeps the memory as
 * busy as a plain read does. This program builds the tile in (it includes the kernel source: the tiles
 * are static), fills a buffer of MB (default 1024) in 2 MB pages with random Q4_K or Q6_K groups of a
 * 1536-column matrix, and per round times, on 1 and then 2 threads (each its own half, the prefetch kind
 * and distance the executor gives that many threads), the tile over every group and then bench/roofline.c's
 * plain read over the same bytes. It prints each round's GB/s and the tile's share of the read: the
 * tile's own loss, apart from a model's barriers and smaller ops. The values are random bytes: only the
 * speed means anything. Each tile runs twice: over the groups in order (one stream a thread), and as the
 * decode walks them (two_streams: the two halves' groups in step, two streams a thread).
 *
 * Then a stand-in, one stream: the read loop with a chain of K (and, maddubs) pairs on each 32-byte vector
 * (K = 1, 2, 4) and the tiles' prefetching. Each kind's rate with its data in L2 is printed first (best and
 * median of 9 timings; bench/tile_cost.py gives the static bound it can be set against). The
 * stand-in computes 2-3 times faster than the tiles and still came to only 80-87% of the read at one
 * thread, as the one-stream tiles did: one core's single stream that does any work is held back by more
 * than the work (on Zen 3 here), which is why the decode reads two.
 */
#define _GNU_SOURCE
#include "avx2/quant_kq.c"

#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

_Thread_local int bl_shared_stream;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* bench/roofline.c's read: 256-bit loads into 8 independent accumulators */
static float read_stream(const float *p, size_t n) {
    __m256 a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
    for (size_t i = 0; i < n; i += 64)
        for (int k = 0; k < 8; k++) a[k] = _mm256_add_ps(a[k], _mm256_load_ps(p + i + 8 * k));
    for (int k = 1; k < 8; k++) a[0] = _mm256_add_ps(a[0], a[k]);
    return _mm256_cvtss_f32(a[0]);
}

typedef struct {
    const uint8_t *w; /* all groups */
    size_t gb;        /* bytes a group */
    size_t g0, g1;    /* this thread's groups */
    int nu, kind, K, shared; /* kind: 0 the Q4_K tile, 1 the Q6_K tile, 2 the stand-in with K pairs */
    int streams;             /* tiles: 1, the groups in order; 2, as the decode walks them (two_streams) */
    const uint8_t *xq;
    const int32_t *xp;
    float *out;              /* 8 floats a group of the whole buffer */
    float sink;
} job;

#define COLS 1536
#define L2_TIMINGS 9 /* the core is shared too: one timing of the in-L2 rate moved by 30% */

static void tiles(job *j) {
    bl_shared_stream = j->shared;
    const size_t pf = j->shared ? PF_BYTES_SHARED : PF_BYTES, end = j->g1 * j->gb;
    if (j->streams == 2) {
        tile_args A = {NULL, j->nu, j->xq, 0, j->xp, NULL, 8, 8, NULL, (j->gb + (size_t)j->nu - 1) / (size_t)j->nu};
        two_streams(j->kind == 1 ? q6k_1 : q4k_1, j->kind == 1 ? q6k_g2 : q4k_g2, &A, j->w, j->gb, j->out,
                    (int)j->g0 * 8, (int)j->g1 * 8, j->w + end, pf);
        j->sink += j->out[j->g0 * 8];
        return;
    }
    float out[8];
    for (size_t g = j->g0; g < j->g1; g++) {
        const uint8_t *p = j->w + g * j->gb;
        tile_args A = {p, j->nu, j->xq, 0, j->xp, out, 8, 8, (size_t)(p - j->w) + pf + j->gb <= end ? p + pf : NULL,
                       (j->gb + (size_t)j->nu - 1) / (size_t)j->nu};
        if (j->kind == 1) q6k_1(&A);
        else q4k_1(&A);
        j->sink += out[g & 7];
    }
}

/* The stand-in: the thread's bytes read in order, K (and, maddubs) pairs on each 32-byte vector, prefetched
 * as a tile prefetches (the same hint and distance, a line at a time) */
AI void standin_k(job *j, const int K) {
    bl_shared_stream = j->shared;
    const uint8_t *p = j->w + j->g0 * j->gb;
    const size_t n = (j->g1 - j->g0) * j->gb / 128 * 128, pf = j->shared ? PF_BYTES_SHARED : PF_BYTES;
    const __m256i m = _mm256_set1_epi8(15), x = _mm256_set1_epi8(3);
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < n; i += 128) {
        if (i + pf + 128 <= n) {
            if (j->shared) {
                _mm_prefetch((const char *)p + i + pf, _MM_HINT_NTA);
                _mm_prefetch((const char *)p + i + pf + 64, _MM_HINT_NTA);
            } else {
                _mm_prefetch((const char *)p + i + pf, _MM_HINT_T0);
                _mm_prefetch((const char *)p + i + pf + 64, _MM_HINT_T0);
            }
        }
        __m256i y0 = load(p + i), y1 = load(p + i + 32), y2 = load(p + i + 64), y3 = load(p + i + 96);
        for (int k = 0; k < K; k++) {
            y0 = _mm256_maddubs_epi16(_mm256_and_si256(y0, m), x);
            y1 = _mm256_maddubs_epi16(_mm256_and_si256(y1, m), x);
            y2 = _mm256_maddubs_epi16(_mm256_and_si256(y2, m), x);
            y3 = _mm256_maddubs_epi16(_mm256_and_si256(y3, m), x);
        }
        a0 = _mm256_add_epi16(a0, y0), a1 = _mm256_add_epi16(a1, y1);
        a2 = _mm256_add_epi16(a2, y2), a3 = _mm256_add_epi16(a3, y3);
    }
    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3));
    j->sink += (float)_mm256_extract_epi16(s, 0);
}

static void standin(job *j, int K) {
    if (K == 1) standin_k(j, 1);
    else if (K == 2) standin_k(j, 2);
    else standin_k(j, 4);
}

/* one pass of the job's kernel (tiles or stand-in) on the calling thread */
static void kernel(job *j) {
    if (j->kind == 2) standin(j, j->K);
    else tiles(j);
}

static int g_read;
static pthread_barrier_t g_start, g_end;

static void *worker(void *arg) {
    job *j = arg;
    pthread_barrier_wait(&g_start);
    if (g_read) j->sink += read_stream((const float *)(const void *)(j->w + j->g0 * j->gb), (j->g1 - j->g0) * j->gb / 4 / 64 * 64);
    else kernel(j);
    pthread_barrier_wait(&g_end);
    return NULL;
}

/* seconds for one pass of nth threads over the groups, tiles or a plain read */
static double pass(job *jobs, int nth, int read) {
    pthread_t th[2];
    g_read = read;
    pthread_barrier_init(&g_start, NULL, (unsigned)nth + 1);
    pthread_barrier_init(&g_end, NULL, (unsigned)nth + 1);
    for (int i = 0; i < nth; i++) pthread_create(&th[i], NULL, worker, &jobs[i]);
    pthread_barrier_wait(&g_start);
    const double t0 = now();
    pthread_barrier_wait(&g_end);
    const double t = now() - t0;
    for (int i = 0; i < nth; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&g_start);
    pthread_barrier_destroy(&g_end);
    return t;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    const size_t mb = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
    const int rounds = argc > 2 ? atoi(argv[2]) : 5;
    if (mb < 64 || rounds < 1 || rounds > 99) {
        fprintf(stderr, "usage: %s [MB >= 64] [rounds 1..99]\n", argv[0]);
        return 2;
    }
    static uint8_t xq[COLS * 2];
    static int32_t xp[COLS / 32];
    srand(1);
    for (size_t i = 0; i < sizeof xq; i++) xq[i] = (uint8_t)(rand() & 0x3f); /* q, then small d/s/sums */
    static const struct {
        const char *name;
        int kind, K;
        int streams;
    } runs[] = {{"Q4_K tile", 0, 0, 1},      {"Q4_K tile, two streams", 0, 0, 2}, {"Q6_K tile", 1, 0, 1},
                {"Q6_K tile, two streams", 1, 0, 2}, {"stand-in K = 1", 2, 1, 1}, {"stand-in K = 2", 2, 2, 1},
                {"stand-in K = 4", 2, 4, 1}};
    for (size_t ri = 0; ri < sizeof runs / sizeof runs[0]; ri++) {
        const int q6k = runs[ri].kind == 1;
        const int nu = COLS / 256;
        const size_t gb = (size_t)nu * (q6k ? 1680 : 1152), ng = (mb << 20) / gb, bytes = ng * gb;
        uint8_t *w = aligned_alloc(1 << 21, (bytes + (1 << 21) - 1) & ~(size_t)((1 << 21) - 1));
        if (!w) {
            fprintf(stderr, "cannot allocate %zu MB\n", mb);
            return 1;
        }
        madvise(w, bytes, MADV_HUGEPAGE);
        float *out = malloc(ng * 8 * sizeof(float));
        if (!out) {
            fprintf(stderr, "cannot allocate the output\n");
            return 1;
        }
        for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)((i * 2654435761u) >> 13);
        for (int nth = 1; nth <= 2; nth++) {
            job jobs[2];
            for (int i = 0; i < nth; i++)
                jobs[i] = (job){w,  gb, ng * (size_t)i / (size_t)nth, ng * (size_t)(i + 1) / (size_t)nth, nu,
                                runs[ri].kind, runs[ri].K, nth > 1, runs[ri].streams, xq, xp, out, 0};
            double share[99];
            if (nth == 1) { /* its rate with the data in L2: how much faster it computes than memory feeds it */
                job c = jobs[0];
                c.g1 = c.g0 + (256u << 10) / gb;
                kernel(&c);
                double rate[L2_TIMINGS];
                for (int k = 0; k < L2_TIMINGS; k++) {
                    const double t = now();
                    for (int r = 0; r < 400; r++) kernel(&c);
                    rate[k] = 400.0 * (double)(c.g1 - c.g0) * gb / (now() - t) / 1e9;
                }
                qsort(rate, L2_TIMINGS, sizeof rate[0], cmp);
                printf("%s with its data in L2: best %.1f, median %.1f GB/s\n", runs[ri].name, rate[L2_TIMINGS - 1],
                       rate[L2_TIMINGS / 2]);
                jobs[0].sink += c.sink;
            }
            printf("%s, %d thread(s): GB/s, read GB/s, share of the read\n", runs[ri].name, nth);
            for (int r = 0; r < rounds; r++) {
                const double tt = pass(jobs, nth, 0), tr = pass(jobs, nth, 1);
                share[r] = tr / tt;
                printf("  %5.1f  %5.1f  %5.1f%%\n", bytes / tt / 1e9, bytes / tr / 1e9, 100 * share[r]);
            }
            qsort(share, (size_t)rounds, sizeof share[0], cmp);
            printf("  median %.1f%%\n", 100 * share[rounds / 2]);
        }
        free(w);
        free(out);
    }
    return 0;
}
