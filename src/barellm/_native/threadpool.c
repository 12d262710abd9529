/* Persistent worker threads, a spin barrier and the allocation counter (see threadpool.h). */
#define _GNU_SOURCE
#include "threadpool.h"

#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* pauses before a waiting thread starts yielding its core, and microseconds before it sleeps (so an
 * oversubscribed machine gets the core back for the thread everyone waits for) */
#define SPIN_BEFORE_YIELD 2048
#define BARRIER_SPIN_US 200

static atomic_llong g_allocs;
static atomic_llong g_barrier_sleeps, g_idle_sleeps; /* slow paths taken, for diagnostics */

void bl_pool_stats(long long *barrier_sleeps, long long *idle_sleeps) {
    *barrier_sleeps = atomic_load(&g_barrier_sleeps);
    *idle_sleeps = atomic_load(&g_idle_sleeps);
}

void *bl_malloc_aligned(size_t bytes) {
    void *p = NULL;
    atomic_fetch_add_explicit(&g_allocs, 1, memory_order_relaxed);
    if (posix_memalign(&p, BL_CACHELINE, bytes ? bytes : BL_CACHELINE)) return NULL;
    return p;
}

void bl_free_aligned(void *ptr) { free(ptr); }

long long bl_alloc_count(void) { return atomic_load(&g_allocs); }

struct worker {
    bl_pool *pool;
    int tid;
};

struct bl_pool {
    int n;
    int pin;
    atomic_int spin_us;
    pthread_t *threads;
    struct worker *workers;
    int cpus[BL_MAX_THREADS];

    bl_task_fn fn;
    void *ctx;
    int n_active;          /* threads taking part in the current task */
    pid_t pid;             /* the process the workers live in (a forked child has none of them) */
    uint64_t wait0;        /* cycles thread 0 spent waiting at barriers (diagnostics, adaptive mode) */
    /* each hot atomic on its own cache line */
    _Alignas(BL_CACHELINE) atomic_uint job;      /* bumped for each task; also the futex word */
    _Alignas(BL_CACHELINE) atomic_uint bar_count;
    _Alignas(BL_CACHELINE) atomic_uint bar_phase;    /* also a futex word */
    atomic_int bar_sleepers;
    _Alignas(BL_CACHELINE) atomic_int sleepers;
    atomic_int stop;
};

static long futex(atomic_uint *addr, int op, unsigned val) {
    return syscall(SYS_futex, (unsigned *)addr, op, val, NULL, NULL, 0);
}

static double now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static void pin_self(bl_pool *p, int tid) {
    if (!p->pin || p->cpus[tid] < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(p->cpus[tid], &set);
    sched_setaffinity(0, sizeof set, &set);
}

/* Waits until the job counter moves past `seen`: spins first, sleeps on the futex after spin_us. */
static unsigned wait_job(bl_pool *p, unsigned seen) {
    unsigned j;
    double t0 = 0;
    for (unsigned it = 1;; it++) {
        j = atomic_load_explicit(&p->job, memory_order_acquire);
        if (j != seen) return j;
        cpu_relax();
        if ((it & 255) == 0) {
            double t = now_us();
            if (t0 == 0) t0 = t;
            else if (t - t0 > atomic_load_explicit(&p->spin_us, memory_order_relaxed)) break;
            if (it > SPIN_BEFORE_YIELD) sched_yield();
        }
    }
    atomic_fetch_add(&p->sleepers, 1);
    atomic_fetch_add_explicit(&g_idle_sleeps, 1, memory_order_relaxed);
    while ((j = atomic_load(&p->job)) == seen) futex(&p->job, FUTEX_WAIT_PRIVATE, seen);
    atomic_fetch_sub(&p->sleepers, 1);
    return j;
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    bl_pool *p = w->pool;
    pin_self(p, w->tid);
    unsigned seen = 0;
    for (;;) {
        seen = wait_job(p, seen);
        if (atomic_load_explicit(&p->stop, memory_order_acquire)) break;
        if (w->tid >= p->n_active) continue; /* not needed for this task */
        p->fn(p->ctx, w->tid, p->n_active);
        bl_pool_barrier(p, w->tid);
    }
    return NULL;
}

bl_pool *bl_pool_create(int n, int pin) {
    if (n < 1 || n > BL_MAX_THREADS) return NULL;
    bl_pool *p = bl_malloc_aligned(sizeof *p);
    if (!p) return NULL;
    memset(p, 0, sizeof *p);
    p->n = n;
    p->n_active = n;
    p->pid = getpid();
    p->pin = pin;
    atomic_store(&p->spin_us, 300);
    for (int i = 0; i < BL_MAX_THREADS; i++) p->cpus[i] = -1;
    if (pin) {
        cpu_set_t set;
        if (sched_getaffinity(0, sizeof set, &set) == 0) {
            int k = 0, total = CPU_COUNT(&set);
            for (int c = 0; c < CPU_SETSIZE && k < n && total > 0; c++)
                if (CPU_ISSET(c, &set)) p->cpus[k++] = c;
            for (int i = k; i < n && k > 0; i++) p->cpus[i] = p->cpus[i % k];
        }
        pin_self(p, 0);
    }
    p->threads = bl_malloc_aligned(sizeof(pthread_t) * n);
    p->workers = bl_malloc_aligned(sizeof(struct worker) * n);
    if (!p->threads || !p->workers) goto fail;
    for (int i = 1; i < n; i++) {
        p->workers[i].pool = p;
        p->workers[i].tid = i;
        if (pthread_create(&p->threads[i], NULL, worker_main, &p->workers[i])) {
            p->n = i; /* stop the ones started */
            bl_pool_destroy(p);
            return NULL;
        }
    }
    return p;
fail:
    bl_free_aligned(p->threads);
    bl_free_aligned(p->workers);
    bl_free_aligned(p);
    return NULL;
}

void bl_pool_destroy(bl_pool *p) {
    if (!p) return;
    if (getpid() != p->pid) { /* a forked child: the workers are not ours to join */
        bl_free_aligned(p->threads);
        bl_free_aligned(p->workers);
        bl_free_aligned(p);
        return;
    }
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->job, 1);
    futex(&p->job, FUTEX_WAKE_PRIVATE, 0x7fffffff);
    for (int i = 1; i < p->n; i++) pthread_join(p->threads[i], NULL);
    bl_free_aligned(p->threads);
    bl_free_aligned(p->workers);
    bl_free_aligned(p);
}

int bl_pool_size(const bl_pool *p) { return p->n; }

void bl_pool_set_spin_us(bl_pool *p, int us) { atomic_store(&p->spin_us, us < 0 ? 0 : us); }

void bl_pool_run(bl_pool *p, bl_task_fn fn, void *ctx) { bl_pool_run_n(p, fn, ctx, p->n); }

void bl_pool_run_n(bl_pool *p, bl_task_fn fn, void *ctx, int n_active) {
    if (n_active < 1 || n_active > p->n) n_active = p->n;
    if (getpid() != p->pid) n_active = 1; /* after fork(): the workers stayed in the parent */
    p->n_active = n_active;
    if (n_active == 1) { /* the workers are left idle */
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_fetch_add(&p->job, 1); /* seq_cst: pairs with the sleepers count in wait_job */
    if (atomic_load(&p->sleepers) > 0) futex(&p->job, FUTEX_WAKE_PRIVATE, 0x7fffffff);
    fn(ctx, 0, n_active);
    bl_pool_barrier(p, 0); /* the workers end each task with the same barrier */
}

uint64_t bl_pool_wait_cycles(const bl_pool *p) { return p->wait0; }

static void barrier_wait(bl_pool *p, unsigned phase);

void bl_pool_barrier(bl_pool *p, int tid) {
    if (p->n_active <= 1) return;
    unsigned phase = atomic_load_explicit(&p->bar_phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&p->bar_count, 1, memory_order_acq_rel) == (unsigned)p->n_active - 1) {
        atomic_store_explicit(&p->bar_count, 0, memory_order_relaxed);
        atomic_store(&p->bar_phase, phase + 1); /* seq_cst: pairs with bar_sleepers below */
        if (atomic_load(&p->bar_sleepers) > 0) futex(&p->bar_phase, FUTEX_WAKE_PRIVATE, 0x7fffffff);
        return;
    }
    if (tid == 0) {
        const uint64_t c0 = bl_cycles();
        barrier_wait(p, phase);
        p->wait0 += bl_cycles() - c0;
    } else {
        barrier_wait(p, phase);
    }
}

static void barrier_wait(bl_pool *p, unsigned phase) {
    double t0 = 0;
    for (unsigned it = 1; atomic_load_explicit(&p->bar_phase, memory_order_acquire) == phase; it++) {
        cpu_relax();
        if ((it & 1023) == 0) {
            double t = now_us();
            if (t0 == 0) {
                t0 = t;
            } else if (t - t0 > BARRIER_SPIN_US) {
                atomic_fetch_add(&p->bar_sleepers, 1);
                atomic_fetch_add_explicit(&g_barrier_sleeps, 1, memory_order_relaxed);
                while (atomic_load(&p->bar_phase) == phase) futex(&p->bar_phase, FUTEX_WAIT_PRIVATE, phase);
                atomic_fetch_sub(&p->bar_sleepers, 1);
                return;
            }
            if (it > SPIN_BEFORE_YIELD) sched_yield();
        }
    }
}
