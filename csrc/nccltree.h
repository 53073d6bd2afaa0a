/* nccltree native kernels: the C ABI shared by the host (C + OpenMP) library.
 *
 * Every function returns an int status (NT_OK = 0) and takes an explicit thread count,
 * so that N virtual devices on a small machine never oversubscribe it.  Arrays are
 * contiguous; n counts elements (nt_copy: bytes).  float16 is stored as IEEE half and
 * bfloat16 as the upper half of a float32; both are accumulated in float32 and rounded
 * (to nearest even) once, at the store.  int8/uint8 sums and products wrap around.  The Python mirror of these codes lives in nccltree/_native.py.
 *
 * fork(): a child of a process that had already run a multi-threaded kernel runs every
 * kernel on its calling thread (the OpenMP thread pool does not survive fork).
 */
#ifndef NCCLTREE_H
#define NCCLTREE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define NT_API __declspec(dllexport)
#else
#define NT_API __attribute__((visibility("default")))
#endif

/* dtype codes */
enum {
    NT_F16 = 0,
    NT_F32 = 1,
    NT_F64 = 2,
    NT_I32 = 3,
    NT_I64 = 4,
    NT_BF16 = 5,
    NT_I8 = 6,
    NT_U8 = 7,
    NT_NDTYPES = 8
};
/* op codes */
enum { NT_SUM = 0, NT_PROD = 1, NT_MAX = 2, NT_MIN = 3, NT_NOPS = 4 };

/* Sources one reduce takes. Python's one definition is nccltree.backends.base.MAX_FUSED:
   nccltree._native checks nt_max_sources() against it when it loads the library, and a
   test checks the copy in nccltree_kernels.cu (compiled without this header by NVRTC). */
#define NT_MAX_SOURCES 8

/* status codes: one per kind of bad argument, so the caller can say exactly what failed */
enum {
    NT_OK = 0,
    NT_ERR_DTYPE = 1,       /* unknown dtype code */
    NT_ERR_OP = 2,          /* unknown op code (or not sum, for nt_reduce_n_scaled) */
    NT_ERR_NSOURCES = 3,    /* k outside 1..NT_MAX_SOURCES */
    NT_ERR_SIZE = 4,        /* negative element or byte count */
    NT_ERR_NULL = 5,        /* NULL pointer with a non-zero count */
    NT_ERR_THREADS = 6,     /* nthreads < 1 */
    NT_ERR_UNSUPPORTED = 7, /* dtype not supported by this kernel (integer scale/SGD/
                               scaled sum) */
    NT_ERR_OVERLAP = 8,     /* dst partially overlaps a source (identical is allowed) */
    NT_ERR_INTERNAL = 9,    /* a kernel is missing from the dispatch table */
    NT_TIMEOUT = 10,        /* nt_counter_wait: the target was not reached in time */
    NT_ERR_PLATFORM = 11,   /* the wait primitive (or this flag) is not available here */
    NT_ERR_ALIGN = 12,      /* a counter not aligned to 8 bytes */
    NT_ERR_CPU = 13         /* nt_futex_pingpong: cannot pin a thread to that CPU */
};

/* dst += src */
NT_API int nt_sum_into(int dtype, void *dst, const void *src, int64_t n, int nthreads);
/* dst = op(srcs[0], ..., srcs[k-1]) in one pass, left to right; dst may be one of srcs */
NT_API int nt_reduce_n(int op, int dtype, void *dst, const void *const *srcs, int k,
                       int64_t n, int nthreads);
/* dst = alpha * (srcs[0] + ... + srcs[k-1]) in one pass (a mean without a second pass
   over dst); op must be NT_SUM, floating dtypes only.  alpha is rounded to the compute
   type and the sum is multiplied by it before the store, so float32/float64 results are
   bitwise those of nt_reduce_n followed by nt_scale; float16 rounds once instead of twice
   (the sum stays in float32 until after the scale), so it is slightly more accurate. */
/* dsts[0] = the reduction of srcs[0 .. k) (alpha != 1.0: the scaled sum), and dsts[1 .. m)
   copies of it, block by block: every source read once and every destination written
   once (where a reduction and then m - 1 copies of its result read the result m - 1
   times more). A destination may be a source (the same pointer; the block is read before
   it is written) or an earlier destination (the same pointer: nothing more to write), but
   not overlap a source or another destination otherwise. Bitwise the
   reduction's result, in the same summation order. */
NT_API int nt_reduce_many(int op, int dtype, void *const *dsts, int m, const void *const *srcs,
                          int k, int64_t n, double alpha, int nthreads);
NT_API int nt_reduce_n_scaled(int op, int dtype, void *dst, const void *const *srcs, int k,
                              int64_t n, double alpha, int nthreads);
NT_API int nt_sum_n(int dtype, void *dst, const void *const *srcs, int k, int64_t n,
                    int nthreads);
/* x *= alpha (floating dtypes) */
NT_API int nt_scale(int dtype, void *x, double alpha, int64_t n, int nthreads);
/* Caffe's update: g += wd*w; v = momentum*v + lr*g; w -= v (floating dtypes) */
NT_API int nt_sgd_update(int dtype, void *w, void *g, void *v, double lr, double momentum,
                         double weight_decay, int64_t n, int nthreads);
NT_API int nt_copy(void *dst, const void *src, int64_t nbytes, int nthreads);
/* dst = srcs[0][0, nbytes[0]) ++ ... ++ srcs[k-1][0, nbytes[k-1]), back to back; k >= 0,
   no source may overlap the destination */
/* One step of a plan that a caller performs in order (nt_run_steps): a copy, a reduction
   of k sources (alpha != 1.0: scaled, sum only) or a scale, on elements of one dtype.
   Buffers are numbered slots whose base addresses the caller passes per call; offsets
   count elements. A copy whose source is its destination moves nothing. */
typedef struct {
    int32_t kind; /* NT_STEP_COPY, NT_STEP_REDUCE or NT_STEP_SCALE */
    int32_t op;   /* reduce: NT_SUM ... */
    int32_t k;    /* reduce: 1 .. NT_MAX_SOURCES sources */
    int32_t rank; /* whose thread count the step uses */
    int64_t count;
    double alpha;
    int32_t dst;
    int32_t src[NT_MAX_SOURCES];
    int64_t dst_off;
    int64_t src_off[NT_MAX_SOURCES];
    int32_t m; /* reduce_many: destinations, dst and then mdst[0 .. m-1) */
    int32_t mdst[NT_MAX_SOURCES - 1];
    int64_t mdst_off[NT_MAX_SOURCES - 1];
} nt_step;

enum { NT_STEP_COPY = 0, NT_STEP_REDUCE = 1, NT_STEP_SCALE = 2, NT_STEP_REDUCE_MANY = 3 };

/* Perform steps[0 .. nsteps) in order: the inline execution of a plan in one call.
   bases[slot] is each buffer's address, threads[rank] each rank's kernel threads. On an
   error, *failed is the index of the step that failed and its status is returned. */
NT_API int nt_run_steps(int dtype, const nt_step *steps, int nsteps, void *const *bases,
                        const int *threads, int *failed);

NT_API int nt_gather(void *dst, const void *const *srcs, const int64_t *nbytes, int k,
                     int nthreads);
NT_API const char *nt_strerror(int status);
/* NT_MAX_SOURCES, for the caller to check that it agrees */
NT_API int nt_max_sources(void);
/* float16 kernels: enable = 1 uses F16C when the CPU has it (the default), 0 the portable
   conversions, -1 changes nothing; returns 1 when the F16C code is in use. */
NT_API int nt_use_f16c(int enable);
/* bfloat16 kernels: enable = 1 uses the AVX2 build of their loops when the CPU has it (the
   default), 0 the baseline build, -1 changes nothing; returns 1 when AVX2 is in use. The
   two give the same bits. */
NT_API int nt_use_avx2(int enable);

/* ---- the wait primitive: a sequence counter in plain memory ----
 *
 * A counter is two adjacent uint32 words, 8-byte aligned, zero-initialised: word 0 the
 * value (wraps; "reached" means less than 2^31 ahead of the target), word 1 the number
 * of threads blocked on it (so a wake costs no system call when nobody sleeps).  It may
 * live in shared memory between processes: pass NT_COUNTER_SHARED to every call on it
 * (Linux only; without it the futex is process-private, a little faster).
 *
 * Linux uses futex; other POSIX systems one process-wide condition variable (no
 * NT_COUNTER_SHARED there); other platforms return NT_ERR_PLATFORM. */
#define NT_COUNTER_SHARED 1
/* spin_ns < 0 in nt_counter_wait: spin up to this long, only while a core looks free */
#define NT_SPIN_DEFAULT_NS ((int64_t)50000)
/* the bound of each wait in nt_futex_pingpong */
#define NT_PINGPONG_TIMEOUT_NS ((int64_t)10000000000)

/* Wait until counter[0] reaches target: first spin up to spin_ns (< 0: the adaptive
   default above), then sleep on the futex; returns NT_OK, or NT_TIMEOUT after timeout_ns
   (>= 0; 0 only looks).  Signals (EINTR) and spurious wake-ups resume the wait. */
NT_API int nt_counter_wait(uint32_t *counter, uint32_t target, int64_t timeout_ns,
                           int64_t spin_ns, int flags);
/* counter[0] += delta atomically and wake every sleeper; the new value in *new_value
   (may be NULL). */
NT_API int nt_counter_add_wake(uint32_t *counter, uint32_t delta, int flags,
                               uint32_t *new_value);
/* Two new threads pass a counter back and forth `rounds` times (each waiting with spin_ns
   as in nt_counter_wait), pinned to CPUs cpu_a and cpu_b (< 0: not pinned; Linux only):
   nanoseconds per round trip, or minus a status. */
NT_API int64_t nt_futex_pingpong(int64_t rounds, int64_t spin_ns, int cpu_a, int cpu_b);
/* NT_SPIN_DEFAULT_NS, for the caller */
NT_API int64_t nt_spin_default_ns(void);

#ifdef __cplusplus
}
#endif

#endif /* NCCLTREE_H */
