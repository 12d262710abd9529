/* The machine's memory read bandwidth and peak FMA throughput: the two ceilings of an LLM forward pass.
 *
 * Decoding one token reads every weight once, so decode tokens/s <= read bandwidth / weight bytes; prefill
 * can reuse each weight across the prompt's tokens and is bounded by arithmetic instead. This program
 * measures both ceilings with 1..N threads so `barellm bench` figures can be placed under them:
 *
 *   cc -O2 -mavx2 -mfma -pthread bench/roofline.c -o /tmp/roofline && /tmp/roofline [MB] [max_threads] [small]
 *   barellm bench --roofline --bandwidth <GB/s from here>
 *
 * Bandwidth: each thread streams its own share of a buffer far larger than the last-level cache with
 * 256-bit loads, several independent accumulators so loads are not serialized on an add chain; best and
 * median of repeated passes are printed (shared machines are noisy: the best is the ceiling, the median the
 * typical). FMA: independent vfmadd chains in registers, no memory traffic.
 *
 * Streams: the read is also timed as 2 and 3 streams a thread (read_streams), printed after the one-stream
 * best and median.
 *
 * Pages: the buffer asks for 2 MB pages (MADV_HUGEPAGE), as barellm maps its weights, and the first line
 * says how much of it got them. With a third argument `small` it stays in 4 KB pages: each 4 KB of a stream
 * is then a TLB miss, and on a virtual machine (two-level page walks) that read 20-30% slower here, so a
 * limit measured that way is not the machine's.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define REPS 9
#define MAX_THREADS 64

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

typedef struct {
    const float *p;
    size_t n;       /* floats, a multiple of 64 */
    float sink;
    pthread_barrier_t *start;
    int work;       /* 0: read, 1: fma, S >= 2: read as S streams */
    double seconds;
} job;

static float read_stream(const float *p, size_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = 0; i < n; i += 64) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
        a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
        a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
        a4 = _mm256_add_ps(a4, _mm256_load_ps(p + i + 32));
        a5 = _mm256_add_ps(a5, _mm256_load_ps(p + i + 40));
        a6 = _mm256_add_ps(a6, _mm256_load_ps(p + i + 48));
        a7 = _mm256_add_ps(a7, _mm256_load_ps(p + i + 56));
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

/* The same read as S streams: the thread's share cut into S parts, read 256 bytes from each in turn. One
 * core reads faster from a few far-apart places at once than from one (Zen 3 here: 15-25% with 2 or 3),
 * which is how barellm's decode tiles walk their rows. */
static float read_streams(const float *p, size_t n, int S) {
    const size_t part = n / (size_t)S / 64 * 64;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = 0; i < part; i += 64)
        for (int k = 0; k < S; k++) {
            const float *q = p + (size_t)k * part + i;
            a0 = _mm256_add_ps(a0, _mm256_load_ps(q));
            a1 = _mm256_add_ps(a1, _mm256_load_ps(q + 8));
            a2 = _mm256_add_ps(a2, _mm256_load_ps(q + 16));
            a3 = _mm256_add_ps(a3, _mm256_load_ps(q + 24));
            a4 = _mm256_add_ps(a4, _mm256_load_ps(q + 32));
            a5 = _mm256_add_ps(a5, _mm256_load_ps(q + 40));
            a6 = _mm256_add_ps(a6, _mm256_load_ps(q + 48));
            a7 = _mm256_add_ps(a7, _mm256_load_ps(q + 56));
        }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

#define FMA_ITERS 50000000L
/* 10 independent chains in named registers (an array would be kept in memory): enough to cover the FMA
 * latency (4-5 cycles) on 2 FMA ports. */
static float fma_loop(void) {
    __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    __m256 a0 = _mm256_set1_ps(0), a1 = _mm256_set1_ps(1), a2 = _mm256_set1_ps(2), a3 = _mm256_set1_ps(3),
           a4 = _mm256_set1_ps(4), a5 = _mm256_set1_ps(5), a6 = _mm256_set1_ps(6), a7 = _mm256_set1_ps(7),
           a8 = _mm256_set1_ps(8), a9 = _mm256_set1_ps(9);
    for (long i = 0; i < FMA_ITERS; i++) {
        a0 = _mm256_fmadd_ps(a0, m, c); a1 = _mm256_fmadd_ps(a1, m, c);
        a2 = _mm256_fmadd_ps(a2, m, c); a3 = _mm256_fmadd_ps(a3, m, c);
        a4 = _mm256_fmadd_ps(a4, m, c); a5 = _mm256_fmadd_ps(a5, m, c);
        a6 = _mm256_fmadd_ps(a6, m, c); a7 = _mm256_fmadd_ps(a7, m, c);
        a8 = _mm256_fmadd_ps(a8, m, c); a9 = _mm256_fmadd_ps(a9, m, c);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(_mm256_add_ps(a6, a7),
                                                                                _mm256_add_ps(a8, a9))));
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0];
}

static void *worker(void *arg) {
    job *j = arg;
    pthread_barrier_wait(j->start);
    double t0 = now();
    j->sink = j->work == 1 ? fma_loop() : j->work ? read_streams(j->p, j->n, j->work) : read_stream(j->p, j->n);
    j->seconds = now() - t0;
    return NULL;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define HUGE_BYTES ((size_t)2 << 20)

/* MB of [p, p + bytes) mapped in 2 MB pages, from the AnonHugePages line of its mapping in /proc/self/smaps
 * (0 where the kernel does not say). */
static size_t huge_mb(const void *p, size_t bytes) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return 0;
    char line[512];
    int inside = 0;
    size_t kb = 0, total = 0;
    const uintptr_t a = (uintptr_t)p, b = a + bytes;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
            inside = lo < b && hi > a;
        else if (inside && sscanf(line, "AnonHugePages: %zu kB", &kb) == 1)
            total += kb;
    }
    fclose(f);
    return total / 1024;
}

/* One pass over the buffer with nt threads; the slowest thread's time is the pass's. */
static double pass(const float *buf, size_t n, int nt, int work) {
    pthread_t th[MAX_THREADS];
    job jobs[MAX_THREADS];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, (unsigned)nt);
    size_t share = (n / nt) & ~(size_t)63;
    for (int t = 0; t < nt; t++) {
        jobs[t] = (job){buf + t * share, share, 0, &start, work, 0};
        pthread_create(&th[t], NULL, worker, &jobs[t]);
    }
    double worst = 0;
    float sink = 0;
    for (int t = 0; t < nt; t++) {
        pthread_join(th[t], NULL);
        sink += jobs[t].sink;
        if (jobs[t].seconds > worst) worst = jobs[t].seconds;
    }
    pthread_barrier_destroy(&start);
    if (sink == 12345.678f) fprintf(stderr, "%f\n", sink); /* keeps the loads alive */
    return worst;
}

int main(int argc, char **argv) {
    size_t mb = argc > 1 ? strtoul(argv[1], NULL, 10) : 256;
    int max_threads = argc > 2 ? atoi(argv[2]) : 2;
    const int small = argc > 3 && strcmp(argv[3], "small") == 0;
    if (mb < 16 || max_threads < 1 || max_threads > MAX_THREADS || (argc > 3 && !small)) {
        fprintf(stderr, "usage: %s [MB >= 16] [max_threads 1..%d] [small]\n", argv[0], MAX_THREADS);
        return 2;
    }
    size_t n = mb * 1024 * 1024 / sizeof(float);
    float *buf = aligned_alloc(HUGE_BYTES, n * sizeof(float)); /* a multiple of 2 MB: mb is whole */
    if (!buf) {
        fprintf(stderr, "cannot allocate %zu MB\n", mb);
        return 1;
    }
#ifdef MADV_HUGEPAGE
    madvise(buf, n * sizeof(float), small ? MADV_NOHUGEPAGE : MADV_HUGEPAGE); /* before the first touch */
#endif
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023) * 1e-3f; /* touch every page */
    printf("buffer %zu MB, %zu MB of it in 2 MB pages\n", mb, huge_mb(buf, n * sizeof(float)));

    /* the one-stream read is the first two columns (what scripts read); the passes of 1, 2 and 3 streams a
     * thread take turns, so that they see the same moments of a shared machine */
    printf("threads  read GB/s best  median   2 streams best  3 streams best   fp32 FMA GFLOP/s\n");
    for (int nt = 1; nt <= max_threads; nt++) {
        double s[REPS], s2 = 1e30, s3 = 1e30;
        size_t bytes = ((n / nt) & ~(size_t)63) * nt * sizeof(float);
        for (int r = 0; r < REPS; r++) {
            s[r] = pass(buf, n, nt, 0);
            const double t2 = pass(buf, n, nt, 2), t3 = pass(buf, n, nt, 3);
            s2 = t2 < s2 ? t2 : s2;
            s3 = t3 < s3 ? t3 : s3;
        }
        qsort(s, REPS, sizeof s[0], cmp);
        double fma_s = pass(buf, n, nt, 1);
        double flops = (double)nt * FMA_ITERS * 10 * 8 * 2;
        printf("%7d  %14.1f  %6.1f  %15.1f  %14.1f   %16.1f\n", nt, bytes / s[0] / 1e9, bytes / s[REPS / 2] / 1e9,
               bytes / s2 / 1e9, bytes / s3 / 1e9, flops / fma_s / 1e9);
    }
    free(buf);
    return 0;
}
