/* Work over the OpenMP team, shared by quant.c and native.c (and decode.c, which includes both): the OpenMP
 * functions (or one-thread stand-ins where the compiler has no OpenMP) and SPLIT_UNITS, the split of a GEMV's
 * weight rows over the threads.
 *
 * SPLIT_UNITS gives each thread a contiguous range of units (as schedule(static) would: on a quiet machine each
 * thread streams its own rows, which the prefetchers follow) but hands the range out in chunks of about an eighth,
 * claimed with one atomic add each; a thread that finishes its range goes on to claim the chunks left in the
 * others'.  On a busy machine a thread descheduled mid-GEMV (another process, the server's HTTP thread or its
 * client holds its core) would otherwise keep its partner waiting at the region's end for its whole range; here the
 * partner takes the rest.  (The region's end still waits for every thread to arrive: a thread descheduled before
 * the region starts holds it all the same.)  Which thread computes a row never changes its result (every row kernel
 * computes a row whole, in an order fixed by the row), so a stolen chunk gives the same bits.  Cost: one atomic add
 * per chunk, on a cache line of the range's own. */
#ifndef MINILLM_SPLIT_H
#define MINILLM_SPLIT_H

#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#else
#define omp_get_max_threads() 1
#define omp_get_thread_num() 0
#define omp_get_num_threads() 1
#endif

/* One thread's range of units [next, end), alone on its cache line (the owner's claims do not contend with the
 * other ranges' owners). */
typedef struct {
    int64_t next, end;
} __attribute__((aligned(64))) split_range_t;

/* Claim the next chunk of r: 1 and [*a, *b) of units, or 0 when r is used up. */
static inline int split_claim(split_range_t *r, int64_t chunk, int64_t *a, int64_t *b) {
    if (__atomic_load_n(&r->next, __ATOMIC_RELAXED) >= r->end) return 0; /* spare the add on a used-up range */
    const int64_t c = __atomic_fetch_add(&r->next, chunk, __ATOMIC_RELAXED);
    if (c >= r->end) return 0;
    *a = c;
    *b = c + chunk < r->end ? c + chunk : r->end;
    return 1;
}

#define SPLIT_CHUNKS 8 /* chunks per thread's range: the granularity at which a late thread's rows are taken over */

/* SPLIT_UNITS's two halves, for a parallel region that does other work too: SPLIT_DECLARE(N, UNIT) before the
 * region (the ranges of rows [0, N) in units of UNIT rows, in the caller's scope: shared by the team), SPLIT_TAKE(CALL)
 * inside it (each thread runs CALL(n0, n1) on the chunks it claims).  A team smaller than omp_get_max_threads()
 * (nested, limited, or a region's `if` false) still covers every range: each thread visits them all. */
#define SPLIT_DECLARE(N, UNIT)                                                                               \
    const int T_ = omp_get_max_threads();                                                                    \
    const int64_t N_ = (N), UN_ = (UNIT), U_ = (N_ + UN_ - 1) / UN_;                                         \
    const int64_t ch_ = (U_ + (int64_t)SPLIT_CHUNKS * T_ - 1) / ((int64_t)SPLIT_CHUNKS * T_);                \
    split_range_t rg_[T_];                                                                                   \
    for (int i_ = 0; i_ < T_; i_++) rg_[i_].next = U_ * i_ / T_, rg_[i_].end = U_ * (i_ + 1) / T_;
#define SPLIT_TAKE(CALL)                                                                                     \
    {                                                                                                        \
        const int t_ = omp_get_thread_num();                                                                 \
        int64_t a_, b_;                                                                                      \
        for (int k_ = 0; k_ < T_; k_++) /* its own range first, then the others' leftovers */                 \
            while (split_claim(&rg_[(t_ + k_) % T_], ch_, &a_, &b_))                                         \
                CALL(a_ * UN_, b_ * UN_ < N_ ? b_ * UN_ : N_);                                               \
    }
/* Run CALL(n0, n1) over rows [0, N) on the OpenMP team (see above), in units of UNIT rows (a row kernel's tile: no
 * range but the last ends mid-tile); every row exactly once. */
#define SPLIT_UNITS(N, UNIT, CALL)                                                                           \
    do {                                                                                                     \
        SPLIT_DECLARE(N, UNIT)                                                                               \
        _Pragma("omp parallel num_threads(T_)") SPLIT_TAKE(CALL)                                             \
    } while (0)

#endif
