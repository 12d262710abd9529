/* Persistent worker threads for the executor.
 *
 * A pool of n threads (the caller is thread 0, n - 1 workers) runs one task at a time: bl_pool_run()
 * wakes the workers, every thread calls fn(ctx, tid, n), and it returns once all have finished. Inside a
 * task, threads meet at bl_pool_barrier(). Nothing on that path takes a lock or allocates: workers spin
 * on atomics (pause, then sched_yield, so two threads on two busy cores do not starve each other) and
 * only go to sleep on a futex when no task has come for a while.
 */
#ifndef BARELLM_THREADPOOL_H
#define BARELLM_THREADPOOL_H

#include "barellm.h"

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

typedef struct bl_pool bl_pool;
typedef void (*bl_task_fn)(void *ctx, int tid, int nth);

#define BL_MAX_THREADS 256

/* n_threads >= 1; pin: bind thread i to the i-th CPU of the process's affinity mask. NULL on failure. */
BL_API bl_pool *bl_pool_create(int n_threads, int pin);
BL_API void bl_pool_destroy(bl_pool *p);
BL_API int bl_pool_size(const bl_pool *p);
/* Runs fn on every thread of the pool; the calling thread is tid 0. Not reentrant: one caller at a time. */
BL_API void bl_pool_run(bl_pool *p, bl_task_fn fn, void *ctx);
/* The same with only threads 0 .. n_active - 1 taking part (the others stay idle). */
BL_API void bl_pool_run_n(bl_pool *p, bl_task_fn fn, void *ctx, int n_active);
/* The time stamp counter: the pool's and the executor's profiles count in its cycles (0 off x86-64). */
static inline uint64_t bl_cycles(void) {
#if defined(__x86_64__)
    return __rdtsc();
#else
    return 0;
#endif
}
/* Cycles (TSC) thread 0 has spent waiting at barriers so far. */
BL_API uint64_t bl_pool_wait_cycles(const bl_pool *p);
/* All threads of the running task wait here until every one has arrived; memory written before the
 * barrier by any thread is visible to all after it. */
BL_API void bl_pool_barrier(bl_pool *p, int tid);
/* How long (microseconds) idle workers keep spinning before they sleep. */
BL_API void bl_pool_set_spin_us(bl_pool *p, int us);

/* Times waiting threads went to sleep: at a barrier (a partner was late by > 50 us: the machine is
 * oversubscribed) and between tasks (idle longer than the spin time). */
BL_API void bl_pool_stats(long long *barrier_sleeps, long long *idle_sleeps);

/* Native allocation accounting: every heap allocation of the core goes through these, so a test can
 * check that the token loop allocates nothing. */
BL_API void *bl_malloc_aligned(size_t bytes);
BL_API void bl_free_aligned(void *ptr);
BL_API long long bl_alloc_count(void);

/* [lo, hi) of n units for thread tid of nth, lo and hi multiples of align (except hi == n); when the
 * groups do not divide evenly, the lower threads get the extra ones (thread 0, the caller, is running
 * already, while a worker may still be waking up). */
static inline void bl_split(int n, int align, int tid, int nth, int *lo, int *hi) {
    int groups = (n + align - 1) / align;
    int g0 = (int)(((long long)groups * tid + nth - 1) / nth);
    int g1 = (int)(((long long)groups * (tid + 1) + nth - 1) / nth);
    *lo = g0 * align < n ? g0 * align : n;
    *hi = g1 * align < n ? g1 * align : n;
}

#endif
