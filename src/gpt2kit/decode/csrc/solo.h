/* How many threads a native kernel call runs on: the caller's count, or one while the other threads
 * are being kept off the CPU (included by every kernel source here; each library keeps its own state).
 *
 * Why: a kernel call splits its columns statically between the threads of one OpenMP region, and a
 * region ends when its last thread does. On an idle machine the threads start within microseconds of
 * each other; on a loaded one (more runnable threads than cores) a thread that the OS has not
 * scheduled starts its share a time slice late, milliseconds, and the call waits for it: a batch-1
 * decode step of dozens of calls then took several times as long as on one thread (docs/benchmarks.md,
 * "The fallback"). So every call on more than one thread records when its last thread started. A
 * start later than SOLO_LATE_US (idle, a second thread starts within microseconds: docs/benchmarks.md
 * has the delays) sends the next `span` calls to one thread (no other thread to wait for); a late
 * start again right after that doubles `span` (SOLO_SPAN_MIN calls up to SOLO_SPAN_MAX, some dozens of batch-1 steps of GPT-2 124M), and
 * SOLO_CALM calls in a row started on time bring it back to SOLO_SPAN_MIN. Idle, a rare late start
 * costs SOLO_SPAN_MIN calls on one thread; under sustained load one call in `span` is a probe at full width.
 * A call's result does not depend on its thread count (each output is summed by one thread, in the
 * same order), so this changes timing only.
 *
 * GPT2KIT_NATIVE_LATE_US sets the threshold (read once per library; 0: every call on two or more
 * threads counts as late, for tests; a negative value turns the fallback off). solo_stats() gives
 * the counters (calls, calls on one thread, late starts, the start-delay histogram). */
#ifndef GPT2KIT_SOLO_H
#define GPT2KIT_SOLO_H
#include <stdlib.h>
#include <time.h>

#define SOLO_LATE_US 250.0
#define SOLO_SPAN_MIN 16
#define SOLO_SPAN_MAX 4096
#define SOLO_CALM 64
#define SOLO_MAX_THREADS 256 /* wider teams are not watched */

/* the counters: [0] calls, [1] calls sent to one thread, [2] late starts, [3..8] calls on two or more
 * threads by their latest start, in microseconds (the bounds: solo_end's bucket, under 10 to 1000 or more) */
static long solo_counts[9];
static int solo_left, solo_span = SOLO_SPAN_MIN, solo_calm;
static double solo_late_s = -2.0; /* -2: not read yet */

static double solo_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static double solo_threshold(void) {
    double s = solo_late_s; /* concurrent first calls read the same variable and store the same value */
    if (s == -2.0) {
        const char *e = getenv("GPT2KIT_NATIVE_LATE_US");
        s = e && *e ? atof(e) * 1e-6 : SOLO_LATE_US * 1e-6;
        if (s < 0) s = -1.0;
        solo_late_s = s;
    }
    return s;
}

/* The threads this call runs on (races between concurrent callers only move the counters a little). */
static int solo_threads(int threads) {
    __atomic_add_fetch(&solo_counts[0], 1, __ATOMIC_RELAXED);
    if (threads <= 1 || threads > SOLO_MAX_THREADS || solo_threshold() < 0) return threads < 1 ? 1 : threads;
    if (__atomic_load_n(&solo_left, __ATOMIC_RELAXED) > 0) {
        __atomic_sub_fetch(&solo_left, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&solo_counts[1], 1, __ATOMIC_RELAXED);
        return 1;
    }
    return threads;
}

/* One call's bookkeeping, around its OpenMP region:
 *     solo_call sc = {0};
 *     threads = solo_begin(&sc, threads);            the count to run on; the clock starts
 *     #pragma omp parallel num_threads(threads) { SOLO_MARK(&sc); ... }
 *     solo_end(&sc);                                 the latest start recorded, the next calls decided */
typedef struct {
    int threads;
    double t0;
    double starts[SOLO_MAX_THREADS]; /* when thread i started (0: it did not) */
} solo_call;

static int solo_begin(solo_call *c, int threads) {
    c->threads = solo_threads(threads);
    c->t0 = c->threads > 1 ? solo_now() : 0.0;
    return c->threads;
}

/* Inside the region: this thread records its start. */
#define SOLO_MARK(c) \
    do { \
        if ((c)->threads > 1 && (c)->threads <= SOLO_MAX_THREADS) (c)->starts[omp_get_thread_num()] = solo_now(); \
    } while (0)

static void solo_end(const solo_call *c) {
    const int threads = c->threads;
    if (threads <= 1 || threads > SOLO_MAX_THREADS || solo_threshold() < 0) return;
    double late = 0.0;
    for (int i = 1; i < threads; i++)
        if (c->starts[i] - c->t0 > late) late = c->starts[i] - c->t0;
    const double us = late * 1e6;
    const int bucket = us < 10 ? 3 : us < 50 ? 4 : us < 100 ? 5 : us < 250 ? 6 : us < 1000 ? 7 : 8;
    __atomic_add_fetch(&solo_counts[bucket], 1, __ATOMIC_RELAXED);
    if (late >= solo_threshold()) {
        const int span = solo_span;
        __atomic_add_fetch(&solo_counts[2], 1, __ATOMIC_RELAXED);
        solo_left = span;
        solo_span = span * 2 < SOLO_SPAN_MAX ? span * 2 : SOLO_SPAN_MAX;
        solo_calm = 0;
    } else if (++solo_calm >= SOLO_CALM) {
        solo_span = SOLO_SPAN_MIN;
    }
}

#define SOLO_EXPORT(lib) \
    void gpt2kit_##lib##_solo_stats(long *out) { for (int i = 0; i < 9; i++) out[i] = __atomic_load_n(&solo_counts[i], __ATOMIC_RELAXED); }

#endif
