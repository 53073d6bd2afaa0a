/* nccltree host kernels: C11 + OpenMP.
 *
 * Structure: each public entry point checks its arguments, fills an nt_job and hands a
 * range function to nt_run, which runs it on [0, n) on the calling thread, or splits
 * [0, n) into fixed blocks that an OpenMP team takes on demand.  Range functions are
 * generated per (op, dtype, k) by macros, so the inner loop has no branch on the op, the
 * dtype or the number of sources and the compiler vectorises it with the portable baseline
 * instruction set (-O3, no -march=native).
 *
 * Large copies, and large reductions into a destination that is not one of their sources,
 * write it with non-temporal (streaming) stores where SSE2 exists (all of x86-64): an
 * ordinary store to a line that is not in cache first reads that line from memory
 * (write-allocate), which for a 2-source sum is a third more traffic than the job needs.
 */
/* the futex syscall, clock_gettime and sched_yield are outside strict C11 */
#define _GNU_SOURCE 1
#include "nccltree.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
/* the simd loops need either OpenMP or, without it, -fopenmp-simd (NT_OPENMP_SIMD) */
#if defined(_OPENMP) || defined(NT_OPENMP_SIMD)
#define NT_SIMD _Pragma("omp simd")
#else
#define NT_SIMD
#endif
/* SSE2 is part of the x86-64 baseline, so streaming stores need no -march flag; elsewhere
   every store is an ordinary one */
#if defined(__SSE2__)
#include <emmintrin.h>
#define NT_STREAM 1
#endif
#if defined(_OPENMP) && (defined(__unix__) || defined(__APPLE__))
#include <pthread.h>
#include <stdatomic.h>
#define NT_FORK_GUARD 1
#endif

/* Work per thread below which waking another thread costs more than it saves; also the
   block size of the parallel loop (64 KiB of float32, 256 KiB of a copy). */
#define NT_GRAIN_ELEMS ((int64_t)16384)
#define NT_GRAIN_BYTES ((int64_t)1 << 18)
/* Destination sizes from which reductions and copies stream their stores (measured: see
   "Native kernels" in docs/performance.md).  A streaming store loses only when the
   destination is already in cache, where an ordinary store costs no memory read and the
   result stays cached for whoever reads it next; destinations this large rarely are. A
   copy moves fewer bytes per destination byte, so its working set still fits a core's
   L2 cache at sizes where a reduction's no longer does. */
#define NT_STREAM_MIN_REDUCE_BYTES ((int64_t)1 << 20)
#define NT_STREAM_MIN_COPY_BYTES ((int64_t)2 << 20)
/* Streaming stores go out a whole cache line at a time, computed into an L1-resident
   tile.  A small tile keeps the source loads and the stores interleaved (the tile sizes
   compared: docs/performance.md, "Native kernels"). */
#define NT_LINE_BYTES 64
#define NT_TILE_BYTES 256

typedef struct nt_job nt_job;
typedef void (*nt_range_fn)(const nt_job *job, int64_t lo, int64_t hi);

struct nt_job {
    void *dst;
    const void *srcs[NT_MAX_SOURCES];
    void *aux1, *aux2; /* sgd: gradient and history */
    double a, b, c;    /* scalars (alpha; lr, momentum, weight decay) */
    int stream;        /* write dst with non-temporal stores (only where NT_STREAM) */
    /* gather: k ranges, range j from gsrcs[j] to dst + goff[j] (goff[k] is the total) */
    const void *const *gsrcs;
    const int64_t *goff;
    int gk;
    /* reduce_many: the reduction's own range function, the other destinations (each a
       copy of dst), whether each is streamed, and the element size */
    nt_range_fn inner;
    void *mdst[NT_MAX_SOURCES];
    int mstream[NT_MAX_SOURCES];
    int m;
    int64_t item;
};

#ifdef NT_FORK_GUARD
/* libgomp's thread pool does not survive fork(): a child whose parent had started it hangs
   in its first parallel region.  Such a child (Python's multiprocessing forks by default)
   runs every kernel on its calling thread instead. */
static atomic_int nt_pool_started;
static int nt_serial_only;

static void nt_after_fork_in_child(void) {
    nt_serial_only = atomic_load_explicit(&nt_pool_started, memory_order_relaxed);
}

__attribute__((constructor)) static void nt_register_fork_guard(void) {
    pthread_atfork(NULL, NULL, nt_after_fork_in_child);
}
#endif

/* Streaming stores are weakly ordered: they may still sit in a write-combining buffer
   after the kernel returns.  Only the thread that issued them can order them, so every
   thread that ran a range fences before the barrier that ends the parallel region (and
   the calling thread before returning); after that the caller, or a later kernel on
   another thread, reads the results. */
static inline void nt_fence(const nt_job *job) {
#ifdef NT_STREAM
    if (job->stream) _mm_sfence();
#else
    (void)job;
#endif
}

static void nt_run(nt_range_fn fn, const nt_job *job, int64_t n, int64_t grain, int nthreads) {
    int64_t want = n / grain;
    int nt = (want < (int64_t)nthreads) ? (int)want : nthreads;
#ifdef NT_FORK_GUARD
    if (nt_serial_only) nt = 1;
#endif
    if (nt <= 1) {
        fn(job, 0, n);
        nt_fence(job);
        return;
    }
#ifdef NT_FORK_GUARD
    atomic_store_explicit(&nt_pool_started, 1, memory_order_relaxed);
#endif
#ifdef _OPENMP
    /* blocks handed out on demand: if another process holds one of our cores, the threads
       that do run take over its share instead of the whole call waiting for it */
    const int64_t nblocks = (n + grain - 1) / grain;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t b = 0; b < nblocks; ++b) {
            int64_t lo = b * grain, hi = lo + grain;
            fn(job, lo, hi < n ? hi : n);
        }
        nt_fence(job);
    }
#else
    fn(job, 0, n);
    nt_fence(job);
#endif
}

#ifdef NT_STREAM
/* Elements from d to the next cache-line boundary, or -1 if d is not aligned to its
   element size (then no element starts on a line boundary and nothing can stream). */
static inline int64_t nt_stream_head(const void *d, int64_t itemsize) {
    int64_t mis = (int64_t)((uintptr_t)d & (NT_LINE_BYTES - 1));
    if (mis % itemsize != 0) return -1;
    return ((NT_LINE_BYTES - mis) & (NT_LINE_BYTES - 1)) / itemsize;
}

/* dst[0, nbytes) = src[0, nbytes) with streaming stores; dst line-aligned, nbytes a multiple
   of the line size.  src_aligned: src is 16-byte aligned too (an L1 tile). */
static inline __attribute__((always_inline)) void nt_stream_lines(void *dst, const void *src,
                                                                   int64_t nbytes,
                                                                   const int src_aligned) {
    __m128i *d = (__m128i *)dst;
    const __m128i *s = (const __m128i *)src;
    for (int64_t i = 0; i < nbytes / 16; i += 4) {
        __m128i x0, x1, x2, x3;
        if (src_aligned) {
            x0 = _mm_load_si128(s + i);
            x1 = _mm_load_si128(s + i + 1);
            x2 = _mm_load_si128(s + i + 2);
            x3 = _mm_load_si128(s + i + 3);
        } else {
            x0 = _mm_loadu_si128(s + i);
            x1 = _mm_loadu_si128(s + i + 1);
            x2 = _mm_loadu_si128(s + i + 2);
            x3 = _mm_loadu_si128(s + i + 3);
        }
        _mm_stream_si128(d + i, x0);
        _mm_stream_si128(d + i + 1, x1);
        _mm_stream_si128(d + i + 2, x2);
        _mm_stream_si128(d + i + 3, x3);
    }
}
#endif

/* ---- IEEE half <-> float, branch-free so that loops over halves still vectorise ---- */

static inline float nt_f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t nt_bits_from_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float nt_half_to_float(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t e = o & shifted_exp;
    o += (uint32_t)(127 - 15) << 23;
    uint32_t infnan = o + ((uint32_t)(128 - 16) << 23);
    /* subnormal half: let the FPU renormalise (the result is a normal float) */
    uint32_t sub = nt_bits_from_f32(nt_f32_from_bits(o + (1u << 23)) -
                                    nt_f32_from_bits(113u << 23));
    o = (e == shifted_exp) ? infnan : o;
    o = (e == 0) ? sub : o;
    return nt_f32_from_bits(o | (((uint32_t)h & 0x8000u) << 16));
}

static inline uint16_t nt_float_to_half(float f) {
    uint32_t u = nt_bits_from_f32(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    uint32_t big = (u > 0x7f800000u) ? 0x7e00u : 0x7c00u; /* NaN stays NaN, else inf */
    /* half subnormals: adding 0.5f aligns the 10 mantissa bits at the bottom and the
       FPU rounds to nearest even for us */
    const uint32_t magic = 126u << 23;
    uint32_t sub = nt_bits_from_f32(nt_f32_from_bits(u) + nt_f32_from_bits(magic)) - magic;
    /* normal: rebias the exponent and round to nearest even by hand */
    uint32_t odd = (u >> 13) & 1u;
    uint32_t norm = (u + ((uint32_t)(15 - 127) << 23) + 0xfffu + odd) >> 13;
    uint32_t r = (u >= (143u << 23)) ? big : ((u < (113u << 23)) ? sub : norm);
    return (uint16_t)(r | sign);
}

/* ---- bfloat16 <-> float: bfloat16 is the upper 16 bits of a float32, so widening is a
   shift; narrowing rounds to nearest even by adding 0x7fff plus the lowest kept bit, and
   turns a NaN into the quiet NaN of its sign (as ml_dtypes does), since the addition
   could carry a NaN's payload into its exponent or sign ---- */

static inline float nt_bf16_to_float(uint16_t h) { return nt_f32_from_bits((uint32_t)h << 16); }

static inline uint16_t nt_float_to_bf16(float f) {
    uint32_t u = nt_bits_from_f32(f);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t qnan = ((u >> 16) & 0x8000u) | 0x7fc0u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? qnan : rounded);
}

/* ---- per-dtype load/store and per-(op, dtype) combine ---- */

#define LD_PLAIN(p, i) ((p)[i])
#define ST_PLAIN(p, i, v) ((p)[i] = (v))
#define LD_HALF(p, i) nt_half_to_float((p)[i])
#define ST_HALF(p, i, v) ((p)[i] = nt_float_to_half(v))
#define LD_BF16(p, i) nt_bf16_to_float((p)[i])
#define ST_BF16(p, i, v) ((p)[i] = nt_float_to_bf16(v))

#define C_ADD(a, b) ((a) + (b))
#define C_MUL(a, b) ((a) * (b))
/* NaN-propagating, as numpy.maximum / numpy.minimum: a NaN b wins, else a wins when it is
   greater or unordered (then a is the NaN).  Written as two selects because that form
   if-converts for float16 too. */
#define C_FMAX(a, b) (((b) != (b)) ? (b) : (!((a) <= (b)) ? (a) : (b)))
#define C_FMIN(a, b) (((b) != (b)) ? (b) : (!((a) >= (b)) ? (a) : (b)))
#define C_IMAX(a, b) (((a) > (b)) ? (a) : (b))
#define C_IMIN(a, b) (((a) < (b)) ? (a) : (b))
/* integer sum/prod wrap around as numpy's do; signed overflow is undefined in C */
#define C_ADD32(a, b) ((int32_t)((uint32_t)(a) + (uint32_t)(b)))
#define C_MUL32(a, b) ((int32_t)((uint32_t)(a) * (uint32_t)(b)))
#define C_ADD64(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
#define C_MUL64(a, b) ((int64_t)((uint64_t)(a) * (uint64_t)(b)))
/* 8-bit operands are promoted to int, whose sum and product cannot overflow; the
   conversion back keeps the low 8 bits (for int8_t through uint8_t, defined behaviour) */
#define C_ADD8(a, b) ((int8_t)(uint8_t)((unsigned)(a) + (unsigned)(b)))
#define C_MUL8(a, b) ((int8_t)(uint8_t)((unsigned)(a) * (unsigned)(b)))
#define C_ADDU8(a, b) ((uint8_t)((unsigned)(a) + (unsigned)(b)))
#define C_MULU8(a, b) ((uint8_t)((unsigned)(a) * (unsigned)(b)))

/* The streaming variant of a reduction range: ordinary stores up to the first cache-line
   boundary of d, then whole lines computed by the same element loop into an L1-resident
   tile and streamed out, then ordinary stores for the last partial line.  The arithmetic
   is the element loop's, element for element, so results are bitwise those of the plain
   path; only the store instruction differs. */
#ifdef NT_STREAM
#define NT_IF_STREAM(...) __VA_ARGS__
#define NT_DEFINE_STREAM(NAME, T, A, ATTR)                                                \
    static inline __attribute__((always_inline)) ATTR void NAME##_stream(                 \
        T *d, const T **s, int64_t m, const int K, const A alpha) {                       \
        enum { TILE = NT_TILE_BYTES / sizeof(T), LINE = NT_LINE_BYTES / sizeof(T) };      \
        _Alignas(NT_LINE_BYTES) T tile[TILE];                                             \
        int64_t head = nt_stream_head(d, sizeof(T));                                      \
        if (head < 0 || head > m) head = m;                                               \
        /* one call site of the element loop for every piece keeps the library small     \
           (a constant-length call for whole tiles measured no faster) */                 \
        while (m > 0) {                                                                   \
            int64_t c;                                                                    \
            T *out;                                                                       \
            if (head > 0) { /* up to the first line boundary: ordinary stores */          \
                c = head;                                                                 \
                out = d;                                                                  \
                head = 0;                                                                 \
            } else if (m >= LINE) { /* whole lines, through the tile */                   \
                c = (m >= TILE) ? TILE : m - m % LINE;                                    \
                out = tile;                                                               \
            } else { /* the last partial line: ordinary stores */                         \
                c = m;                                                                    \
                out = d;                                                                  \
            }                                                                             \
            NAME##_span(out, s, c, K, alpha);                                             \
            if (out == tile) nt_stream_lines(d, tile, c * (int64_t)sizeof(T), 1);         \
            d += c;                                                                       \
            for (int j = 0; j < K; ++j) s[j] += c;                                        \
            m -= c;                                                                       \
        }                                                                                 \
    }
#else
#define NT_IF_STREAM(...)
#define NT_DEFINE_STREAM(NAME, T, A, ATTR)
#endif

/* The final step of a reduction before the store: none, or a multiplication by alpha
   (rounded to the compute type A, as nt_scale rounds it), so that a scaled sum performs
   exactly the operations of a sum followed by nt_scale, minus the rounding to T between
   them (which is none for float32/float64). */
#define FIN_NONE(acc, alpha) (acc)
#define FIN_SCALE(acc, alpha) ((acc) * (alpha))

/* The element loop of a reduction over m elements. */
#define NT_DEFINE_SPAN(NAME, T, A, LD, ST, COMB, FIN)                                     \
    static inline __attribute__((always_inline)) void NAME##_span(                        \
        T *d, const T *const *s, int64_t m, const int K, const A alpha) {                 \
        (void)alpha;                                                                      \
        NT_SIMD for (int64_t i = 0; i < m; ++i) {                                         \
            A acc = LD(s[0], i);                                                          \
            for (int j = 1; j < K; ++j) acc = COMB(acc, LD(s[j], i));                     \
            ST(d, i, FIN(acc, alpha));                                                    \
        }                                                                                 \
    }

/* One range function per k around NAME##_span.  K is a literal in each wrapper, so after
   inlining the source loop is unrolled and the element loop is straight-line and
   vectorised.  ATTR: function attributes (a target for the runtime-dispatched variants). */
#define NT_DEFINE_RANGES(NAME, T, A, ATTR)                                                \
    NT_DEFINE_STREAM(NAME, T, A, ATTR)                                                    \
    static inline __attribute__((always_inline)) ATTR void NAME##_body(                   \
        const nt_job *job, int64_t lo, int64_t hi, const int K) {                         \
        T *d = (T *)job->dst + lo;                                                        \
        const T *s[NT_MAX_SOURCES];                                                       \
        const A alpha = (A)job->a;                                                        \
        for (int j = 0; j < K; ++j) s[j] = (const T *)job->srcs[j] + lo;                  \
        NT_IF_STREAM(if (job->stream) { NAME##_stream(d, s, hi - lo, K, alpha); return; }) \
        NAME##_span(d, s, hi - lo, K, alpha);                                             \
    }                                                                                     \
    static ATTR void NAME##_1(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 1); } \
    static ATTR void NAME##_2(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 2); } \
    static ATTR void NAME##_3(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 3); } \
    static ATTR void NAME##_4(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 4); } \
    static ATTR void NAME##_5(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 5); } \
    static ATTR void NAME##_6(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 6); } \
    static ATTR void NAME##_7(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 7); } \
    static ATTR void NAME##_8(const nt_job *j, int64_t lo, int64_t hi) { NAME##_body(j, lo, hi, 8); }

#define NT_DEFINE_REDUCE_FIN(NAME, T, A, LD, ST, COMB, FIN)                               \
    NT_DEFINE_SPAN(NAME, T, A, LD, ST, COMB, FIN)                                         \
    NT_DEFINE_RANGES(NAME, T, A, )

#define NT_DEFINE_REDUCE(NAME, T, A, LD, ST, COMB)                                        \
    NT_DEFINE_REDUCE_FIN(NAME, T, A, LD, ST, COMB, FIN_NONE)

#define NT_ROW(NAME) {NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5, NAME##_6, NAME##_7, NAME##_8}

NT_DEFINE_REDUCE(sum_f16, uint16_t, float, LD_HALF, ST_HALF, C_ADD)
NT_DEFINE_REDUCE(prod_f16, uint16_t, float, LD_HALF, ST_HALF, C_MUL)
NT_DEFINE_REDUCE(max_f16, uint16_t, float, LD_HALF, ST_HALF, C_FMAX)
NT_DEFINE_REDUCE(min_f16, uint16_t, float, LD_HALF, ST_HALF, C_FMIN)
NT_DEFINE_REDUCE(sum_f32, float, float, LD_PLAIN, ST_PLAIN, C_ADD)
NT_DEFINE_REDUCE(prod_f32, float, float, LD_PLAIN, ST_PLAIN, C_MUL)
NT_DEFINE_REDUCE(max_f32, float, float, LD_PLAIN, ST_PLAIN, C_FMAX)
NT_DEFINE_REDUCE(min_f32, float, float, LD_PLAIN, ST_PLAIN, C_FMIN)
NT_DEFINE_REDUCE(sum_f64, double, double, LD_PLAIN, ST_PLAIN, C_ADD)
NT_DEFINE_REDUCE(prod_f64, double, double, LD_PLAIN, ST_PLAIN, C_MUL)
NT_DEFINE_REDUCE(max_f64, double, double, LD_PLAIN, ST_PLAIN, C_FMAX)
NT_DEFINE_REDUCE(min_f64, double, double, LD_PLAIN, ST_PLAIN, C_FMIN)
NT_DEFINE_REDUCE(sum_i32, int32_t, int32_t, LD_PLAIN, ST_PLAIN, C_ADD32)
NT_DEFINE_REDUCE(prod_i32, int32_t, int32_t, LD_PLAIN, ST_PLAIN, C_MUL32)
NT_DEFINE_REDUCE(max_i32, int32_t, int32_t, LD_PLAIN, ST_PLAIN, C_IMAX)
NT_DEFINE_REDUCE(min_i32, int32_t, int32_t, LD_PLAIN, ST_PLAIN, C_IMIN)
NT_DEFINE_REDUCE(sum_i64, int64_t, int64_t, LD_PLAIN, ST_PLAIN, C_ADD64)
NT_DEFINE_REDUCE(prod_i64, int64_t, int64_t, LD_PLAIN, ST_PLAIN, C_MUL64)
NT_DEFINE_REDUCE(max_i64, int64_t, int64_t, LD_PLAIN, ST_PLAIN, C_IMAX)
NT_DEFINE_REDUCE(min_i64, int64_t, int64_t, LD_PLAIN, ST_PLAIN, C_IMIN)
NT_DEFINE_REDUCE(sum_bf16, uint16_t, float, LD_BF16, ST_BF16, C_ADD)
NT_DEFINE_REDUCE(prod_bf16, uint16_t, float, LD_BF16, ST_BF16, C_MUL)
NT_DEFINE_REDUCE(max_bf16, uint16_t, float, LD_BF16, ST_BF16, C_FMAX)
NT_DEFINE_REDUCE(min_bf16, uint16_t, float, LD_BF16, ST_BF16, C_FMIN)
NT_DEFINE_REDUCE(sum_i8, int8_t, int8_t, LD_PLAIN, ST_PLAIN, C_ADD8)
NT_DEFINE_REDUCE(prod_i8, int8_t, int8_t, LD_PLAIN, ST_PLAIN, C_MUL8)
NT_DEFINE_REDUCE(max_i8, int8_t, int8_t, LD_PLAIN, ST_PLAIN, C_IMAX)
NT_DEFINE_REDUCE(min_i8, int8_t, int8_t, LD_PLAIN, ST_PLAIN, C_IMIN)
NT_DEFINE_REDUCE(sum_u8, uint8_t, uint8_t, LD_PLAIN, ST_PLAIN, C_ADDU8)
NT_DEFINE_REDUCE(prod_u8, uint8_t, uint8_t, LD_PLAIN, ST_PLAIN, C_MULU8)
NT_DEFINE_REDUCE(max_u8, uint8_t, uint8_t, LD_PLAIN, ST_PLAIN, C_IMAX)
NT_DEFINE_REDUCE(min_u8, uint8_t, uint8_t, LD_PLAIN, ST_PLAIN, C_IMIN)

/* indexed by the dtype codes of nccltree.h, in their order */
#define NT_OP_ROW(OP)                                                                     \
    {NT_ROW(OP##_f16), NT_ROW(OP##_f32), NT_ROW(OP##_f64), NT_ROW(OP##_i32),              \
     NT_ROW(OP##_i64), NT_ROW(OP##_bf16), NT_ROW(OP##_i8), NT_ROW(OP##_u8)}

static const nt_range_fn nt_reduce_table[NT_NOPS][NT_NDTYPES][NT_MAX_SOURCES] = {
    NT_OP_ROW(sum), NT_OP_ROW(prod), NT_OP_ROW(max), NT_OP_ROW(min),
};

/* alpha * sum(srcs): floating dtypes only (integer mean is refused, as by nt_scale) */
NT_DEFINE_REDUCE_FIN(ssum_f16, uint16_t, float, LD_HALF, ST_HALF, C_ADD, FIN_SCALE)
NT_DEFINE_REDUCE_FIN(ssum_f32, float, float, LD_PLAIN, ST_PLAIN, C_ADD, FIN_SCALE)
NT_DEFINE_REDUCE_FIN(ssum_f64, double, double, LD_PLAIN, ST_PLAIN, C_ADD, FIN_SCALE)
NT_DEFINE_REDUCE_FIN(ssum_bf16, uint16_t, float, LD_BF16, ST_BF16, C_ADD, FIN_SCALE)

static const nt_range_fn nt_scaled_sum_table[NT_NDTYPES][NT_MAX_SOURCES] = {
    NT_ROW(ssum_f16), NT_ROW(ssum_f32), NT_ROW(ssum_f64), {NULL}, {NULL},
    NT_ROW(ssum_bf16), {NULL}, {NULL},
};

/* ---- scale and SGD (floating dtypes; scalars are rounded to the array's compute type,
   as numpy does for a Python float against a float32 array) ---- */

#define NT_DEFINE_SCALE(NAME, T, A, LD, ST)                                               \
    static void NAME(const nt_job *job, int64_t lo, int64_t hi) {                         \
        T *x = (T *)job->dst;                                                             \
        const A alpha = (A)job->a;                                                        \
        NT_SIMD for (int64_t i = lo; i < hi; ++i) ST(x, i, LD(x, i) * alpha); \
    }

#define NT_DEFINE_SGD(NAME, T, A, LD, ST)                                                 \
    static void NAME(const nt_job *job, int64_t lo, int64_t hi) {                         \
        T *w = (T *)job->dst, *g = (T *)job->aux1, *v = (T *)job->aux2;                   \
        const A lr = (A)job->a, mom = (A)job->b, wd = (A)job->c;                          \
        NT_SIMD for (int64_t i = lo; i < hi; ++i) {                           \
            A wi = LD(w, i);                                                              \
            A gi = LD(g, i) + wd * wi;                                                    \
            A vi = mom * LD(v, i) + lr * gi;                                              \
            ST(g, i, gi);                                                                 \
            ST(v, i, vi);                                                                 \
            ST(w, i, wi - vi);                                                            \
        }                                                                                 \
    }

NT_DEFINE_SCALE(scale_f16, uint16_t, float, LD_HALF, ST_HALF)
NT_DEFINE_SCALE(scale_f32, float, float, LD_PLAIN, ST_PLAIN)
NT_DEFINE_SCALE(scale_f64, double, double, LD_PLAIN, ST_PLAIN)
NT_DEFINE_SGD(sgd_f16, uint16_t, float, LD_HALF, ST_HALF)
NT_DEFINE_SGD(sgd_f32, float, float, LD_PLAIN, ST_PLAIN)
NT_DEFINE_SGD(sgd_f64, double, double, LD_PLAIN, ST_PLAIN)
NT_DEFINE_SCALE(scale_bf16, uint16_t, float, LD_BF16, ST_BF16)
NT_DEFINE_SGD(sgd_bf16, uint16_t, float, LD_BF16, ST_BF16)

static const nt_range_fn nt_scale_table[NT_NDTYPES] = {
    scale_f16, scale_f32, scale_f64, NULL, NULL, scale_bf16, NULL, NULL,
};
static const nt_range_fn nt_sgd_table[NT_NDTYPES] = {
    sgd_f16, sgd_f32, sgd_f64, NULL, NULL, sgd_bf16, NULL, NULL,
};

/* ---- float16 through F16C, chosen at run time (x86-64) ----
   The portable conversions above are exact but cost tens of instructions per element, and
   the compiler does not vectorise half-precision conversions at the baseline instruction
   set. CPUs with F16C (Intel since 2012, AMD since 2011) convert 8 halves per instruction;
   these variants use it, 8 elements at a time, with the same arithmetic in float32 and the
   same round-to-nearest-even: results are bitwise those of the portable path (NaNs stay
   NaN; their payload bits may differ). Tails shorter than 8 run the portable functions. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NT_F16C 1
#include <immintrin.h>
#define NT_F16C_TARGET __attribute__((target("avx,f16c")))

static int nt_f16c_state = -1; /* -1 undecided, 0 portable code, 1 F16C */

/* *state, decided on first use from what the CPU has (cpu_has) where still undecided */
static int nt_feature_on(int *state, int (*cpu_has)(void)) {
    int on = __atomic_load_n(state, __ATOMIC_RELAXED);
    if (on < 0) {
        on = cpu_has();
        __atomic_store_n(state, on, __ATOMIC_RELAXED);
    }
    return on;
}

/* enable = 1: on where the CPU has it; 0: off; -1: unchanged; returns whether it is on */
static int nt_feature_use(int *state, int enable, int (*cpu_has)(void)) {
    if (enable >= 0) __atomic_store_n(state, enable ? cpu_has() : 0, __ATOMIC_RELAXED);
    return nt_feature_on(state, cpu_has);
}

static int nt_cpu_has_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}

#define V_LD(p, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + (i))))
#define V_ST(p, i, v) \
    _mm_storeu_si128((__m128i *)((p) + (i)), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT))
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
/* C_FMAX / C_FMIN lane by lane: b where b is NaN, else a where !(a <= b) (!(a >= b)), else b */
#define V_FMAX(a, b)                                                                     \
    _mm256_blendv_ps(_mm256_blendv_ps((b), (a), _mm256_cmp_ps((a), (b), _CMP_NLE_UQ)), (b), \
                     _mm256_cmp_ps((b), (b), _CMP_UNORD_Q))
#define V_FMIN(a, b)                                                                     \
    _mm256_blendv_ps(_mm256_blendv_ps((b), (a), _mm256_cmp_ps((a), (b), _CMP_NGE_UQ)), (b), \
                     _mm256_cmp_ps((b), (b), _CMP_UNORD_Q))
#define VFIN_NONE(acc, va) (acc)
#define VFIN_SCALE(acc, va) _mm256_mul_ps((acc), (va))

/* A reduction over 16-bit floats, 8 elements at a time in float32 lanes: VLD widens 8
   stored values, VST narrows 8 and stores them (F16C here, bfloat16 through AVX2 below),
   TARGET the instruction sets they need; PORTABLE, the baseline variant of the same
   reduction, does the tail. */
#define NT_DEFINE_SPAN_X8(NAME, TARGET, VLD, VST, VCOMB, VFIN, PORTABLE)                  \
    static inline __attribute__((always_inline)) TARGET void NAME##_span(                 \
        uint16_t *d, const uint16_t *const *s, int64_t m, const int K, const float alpha) { \
        const __m256 va = _mm256_set1_ps(alpha);                                          \
        (void)va;                                                                         \
        int64_t i = 0;                                                                    \
        for (; i + 8 <= m; i += 8) {                                                      \
            __m256 acc = VLD(s[0], i);                                                    \
            for (int j = 1; j < K; ++j) acc = VCOMB(acc, VLD(s[j], i));                   \
            VST(d, i, VFIN(acc, va));                                                     \
        }                                                                                 \
        if (i < m) {                                                                      \
            const uint16_t *rest[NT_MAX_SOURCES];                                         \
            for (int j = 0; j < K; ++j) rest[j] = s[j] + i;                               \
            PORTABLE##_span(d + i, rest, m - i, K, alpha);                                \
        }                                                                                 \
    }                                                                                     \
    NT_DEFINE_RANGES(NAME, uint16_t, float, TARGET)

/* scale and the SGD step the same way; PORTABLE is the baseline range function */
#define NT_DEFINE_SCALE_X8(NAME, TARGET, VLD, VST, PORTABLE)                              \
    static TARGET void NAME(const nt_job *job, int64_t lo, int64_t hi) {                  \
        uint16_t *x = (uint16_t *)job->dst;                                               \
        const __m256 va = _mm256_set1_ps((float)job->a);                                  \
        int64_t i = lo;                                                                   \
        for (; i + 8 <= hi; i += 8) VST(x, i, _mm256_mul_ps(VLD(x, i), va));              \
        if (i < hi) PORTABLE(job, i, hi);                                                 \
    }

#define NT_DEFINE_SGD_X8(NAME, TARGET, VLD, VST, PORTABLE)                                \
    static TARGET void NAME(const nt_job *job, int64_t lo, int64_t hi) {                  \
        uint16_t *w = (uint16_t *)job->dst, *g = (uint16_t *)job->aux1;                   \
        uint16_t *v = (uint16_t *)job->aux2;                                              \
        const __m256 vlr = _mm256_set1_ps((float)job->a), vmom = _mm256_set1_ps((float)job->b); \
        const __m256 vwd = _mm256_set1_ps((float)job->c);                                 \
        int64_t i = lo;                                                                   \
        for (; i + 8 <= hi; i += 8) { /* the operations of NT_DEFINE_SGD, in its order */ \
            __m256 wi = VLD(w, i);                                                        \
            __m256 gi = _mm256_add_ps(VLD(g, i), _mm256_mul_ps(vwd, wi));                 \
            __m256 vi = _mm256_add_ps(_mm256_mul_ps(vmom, VLD(v, i)), _mm256_mul_ps(vlr, gi)); \
            VST(g, i, gi);                                                                \
            VST(v, i, vi);                                                                \
            VST(w, i, _mm256_sub_ps(wi, vi));                                             \
        }                                                                                 \
        if (i < hi) PORTABLE(job, i, hi);                                                 \
    }

/* Every 8-wide kernel of one 16-bit float: the reductions, the scaled sum and their
   tables (nt_reduce_X, nt_scaled_sum_X), scale_X and sgd_X, over the baseline kernels
   named ..._BASE for the tails. */
#define NT_DEFINE_X8_KERNELS(X, TARGET, VLD, VST, BASE)                                   \
    NT_DEFINE_SPAN_X8(sum_##X, TARGET, VLD, VST, V_ADD, VFIN_NONE, sum_##BASE)            \
    NT_DEFINE_SPAN_X8(prod_##X, TARGET, VLD, VST, V_MUL, VFIN_NONE, prod_##BASE)          \
    NT_DEFINE_SPAN_X8(max_##X, TARGET, VLD, VST, V_FMAX, VFIN_NONE, max_##BASE)           \
    NT_DEFINE_SPAN_X8(min_##X, TARGET, VLD, VST, V_FMIN, VFIN_NONE, min_##BASE)           \
    NT_DEFINE_SPAN_X8(ssum_##X, TARGET, VLD, VST, V_ADD, VFIN_SCALE, ssum_##BASE)         \
    static const nt_range_fn nt_reduce_##X[NT_NOPS][NT_MAX_SOURCES] = {                   \
        NT_ROW(sum_##X), NT_ROW(prod_##X), NT_ROW(max_##X), NT_ROW(min_##X),              \
    };                                                                                    \
    static const nt_range_fn nt_scaled_sum_##X[NT_MAX_SOURCES] = NT_ROW(ssum_##X);        \
    NT_DEFINE_SCALE_X8(scale_##X, TARGET, VLD, VST, scale_##BASE)                         \
    NT_DEFINE_SGD_X8(sgd_##X, TARGET, VLD, VST, sgd_##BASE)

NT_DEFINE_X8_KERNELS(f16c, NT_F16C_TARGET, V_LD, V_ST, f16)
#endif

/* ---- bfloat16 through AVX2, chosen at run time (x86-64) ----
   The baseline build's bfloat16 loops are integer arithmetic that SSE2 runs 4 elements at
   a time, with shuffles to narrow 32-bit lanes to 16. These variants take 8 at a time with
   AVX2 (a zero-extending load and a shift to widen; the same round-to-nearest-even and
   NaN rule to narrow, then one pack): the same operations in the same order per element,
   so the results are bitwise those of the baseline code (NaNs stay NaN; which operand's
   NaN an instruction passes on may differ). Tails shorter than 8 run the baseline
   functions. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define NT_BF16_AVX2 1
#define NT_AVX2_TARGET __attribute__((target("avx2")))

static int nt_avx2_state = -1; /* -1 undecided, 0 baseline code, 1 AVX2 */

static int nt_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

static inline __attribute__((always_inline)) NT_AVX2_TARGET __m256 nt_bf16x_load(
    const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* nt_float_to_bf16 lane by lane */
static inline __attribute__((always_inline)) NT_AVX2_TARGET void nt_bf16x_store(uint16_t *p,
                                                                               __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i qnan = _mm256_or_si256(_mm256_and_si256(hi, _mm256_set1_epi32(0x8000)),
                                         _mm256_set1_epi32(0x7fc0));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, qnan, nan);
    /* every lane holds a value below 2^16: the unsigned-saturating pack keeps it; the pack
       works within 128-bit halves, so the permute puts the two halves' results together */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

#define B_LD(p, i) nt_bf16x_load((p) + (i))
#define B_ST(p, i, v) nt_bf16x_store((p) + (i), (v))

NT_DEFINE_X8_KERNELS(bf16x, NT_AVX2_TARGET, B_LD, B_ST, bf16)
#endif

/* 1 when the bfloat16 kernels use AVX2 (decided on first use: the CPU has it) */
static int nt_avx2_active(void) {
#ifdef NT_BF16_AVX2
    return nt_feature_on(&nt_avx2_state, nt_cpu_has_avx2);
#else
    return 0;
#endif
}

NT_API int nt_use_avx2(int enable) {
#ifdef NT_BF16_AVX2
    return nt_feature_use(&nt_avx2_state, enable, nt_cpu_has_avx2);
#else
    (void)enable;
    return 0;
#endif
}

/* 1 when the float16 kernels use F16C (decided on first use: the CPU has it) */
static int nt_f16c_active(void) {
#ifdef NT_F16C
    return nt_feature_on(&nt_f16c_state, nt_cpu_has_f16c);
#else
    return 0;
#endif
}

NT_API int nt_max_sources(void) { return NT_MAX_SOURCES; }

NT_API int nt_use_f16c(int enable) {
#ifdef NT_F16C
    return nt_feature_use(&nt_f16c_state, enable, nt_cpu_has_f16c);
#else
    (void)enable;
    return 0;
#endif
}

static nt_range_fn nt_reduce_fn(int op, int dtype, int k) {
#ifdef NT_F16C
    if (dtype == NT_F16 && nt_f16c_active()) return nt_reduce_f16c[op][k - 1];
#endif
#ifdef NT_BF16_AVX2
    if (dtype == NT_BF16 && nt_avx2_active()) return nt_reduce_bf16x[op][k - 1];
#endif
    return nt_reduce_table[op][dtype][k - 1];
}

static nt_range_fn nt_scaled_sum_fn(int dtype, int k) {
#ifdef NT_F16C
    if (dtype == NT_F16 && nt_f16c_active()) return nt_scaled_sum_f16c[k - 1];
#endif
#ifdef NT_BF16_AVX2
    if (dtype == NT_BF16 && nt_avx2_active()) return nt_scaled_sum_bf16x[k - 1];
#endif
    return nt_scaled_sum_table[dtype][k - 1];
}

static nt_range_fn nt_scale_fn(int dtype) {
#ifdef NT_F16C
    if (dtype == NT_F16 && nt_f16c_active()) return scale_f16c;
#endif
#ifdef NT_BF16_AVX2
    if (dtype == NT_BF16 && nt_avx2_active()) return scale_bf16x;
#endif
    return nt_scale_table[dtype];
}

static nt_range_fn nt_sgd_fn(int dtype) {
#ifdef NT_F16C
    if (dtype == NT_F16 && nt_f16c_active()) return sgd_f16c;
#endif
#ifdef NT_BF16_AVX2
    if (dtype == NT_BF16 && nt_avx2_active()) return sgd_bf16x;
#endif
    return nt_sgd_table[dtype];
}

/* Streaming: memcpy up to the first line boundary of dst, whole lines streamed (src at
   any alignment), memcpy for the last partial line. */
static void nt_copy_range(const nt_job *job, int64_t lo, int64_t hi) {
    char *d = (char *)job->dst + lo;
    const char *s = (const char *)job->srcs[0] + lo;
    int64_t m = hi - lo;
#ifdef NT_STREAM
    if (job->stream) {
        int64_t head = (int64_t)((NT_LINE_BYTES - ((uintptr_t)d & (NT_LINE_BYTES - 1))) &
                                 (NT_LINE_BYTES - 1));
        if (head > m) head = m;
        memcpy(d, s, (size_t)head);
        d += head;
        s += head;
        m -= head;
        int64_t lines = m - m % NT_LINE_BYTES;
        nt_stream_lines(d, s, lines, 0);
        d += lines;
        s += lines;
        m -= lines;
    }
#endif
    memcpy(d, s, (size_t)m);
}

/* One gather range [lo, hi) of the destination: find the source range holding lo by
   bisection, then copy piece by piece (each piece as nt_copy_range copies its range, so
   streaming stores go to whole lines and the partial lines at the piece ends are stored
   normally). */
static void nt_gather_range(const nt_job *job, int64_t lo, int64_t hi) {
    const int64_t *off = job->goff;
    int a = 0, b = job->gk; /* off[a] <= lo < off[b] */
    while (b - a > 1) {
        int mid = a + (b - a) / 2;
        if (off[mid] <= lo) a = mid; else b = mid;
    }
    for (int j = a; j < job->gk && off[j] < hi; ++j) {
        int64_t s = off[j] > lo ? off[j] : lo;
        int64_t e = off[j + 1] < hi ? off[j + 1] : hi;
        if (e <= s) continue;
        nt_job piece = *job;
        piece.dst = (char *)job->dst + s;
        piece.srcs[0] = (const char *)job->gsrcs[j] + (s - off[j]);
        nt_copy_range(&piece, 0, e - s);
    }
}

/* ---- argument checks ---- */

static const int64_t nt_itemsize[NT_NDTYPES] = {2, 4, 8, 4, 8, 2, 1, 1};

/* 1 if [a, a+nbytes) and [b, b+nbytes) share a byte */
static int nt_overlaps(const void *a, const void *b, int64_t nbytes) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return nbytes > 0 && x < y + (uintptr_t)nbytes && y < x + (uintptr_t)nbytes;
}

static int nt_check_common(int dtype, int64_t n, int nthreads) {
    if (dtype < 0 || dtype >= NT_NDTYPES) return NT_ERR_DTYPE;
    if (n < 0) return NT_ERR_SIZE;
    if (nthreads < 1) return NT_ERR_THREADS;
    return NT_OK;
}

/* ---- public entry points ---- */

/* the shared body of nt_reduce_n and nt_reduce_n_scaled: fn is the range function for
   this (op, dtype, k), already known to exist; alpha goes to the scaled variants */
static int nt_reduce_run(nt_range_fn fn, int dtype, void *dst, const void *const *srcs, int k,
                         int64_t n, double alpha, int nthreads) {
    if (n == 0) return NT_OK;
    if (dst == NULL || srcs == NULL) return NT_ERR_NULL;
    nt_job job = {0};
    job.dst = dst;
    int64_t nbytes = n * nt_itemsize[dtype];
    int dst_is_source = 0;
    for (int j = 0; j < k; ++j) {
        if (srcs[j] == NULL) return NT_ERR_NULL;
        /* the element loop reads every source at i before writing dst at i, so only an
           identical pointer is safe; a shifted one would read already-written values */
        if (srcs[j] != dst && nt_overlaps(srcs[j], dst, nbytes)) return NT_ERR_OVERLAP;
        dst_is_source |= (srcs[j] == dst);
        job.srcs[j] = srcs[j];
    }
    job.a = alpha;
#ifdef NT_STREAM
    /* in place, each dst line has just been read as a source, so a store costs no extra
       read and streaming would only push the line out of cache */
    job.stream = !dst_is_source && nbytes >= NT_STREAM_MIN_REDUCE_BYTES;
#else
    (void)dst_is_source;
#endif
    nt_run(fn, &job, n, NT_GRAIN_ELEMS, nthreads);
    return NT_OK;
}

NT_API int nt_reduce_n(int op, int dtype, void *dst, const void *const *srcs, int k,
                       int64_t n, int nthreads) {
    if (op < 0 || op >= NT_NOPS) return NT_ERR_OP;
    int st = nt_check_common(dtype, n, nthreads);
    if (st != NT_OK) return st;
    if (k < 1 || k > NT_MAX_SOURCES) return NT_ERR_NSOURCES;
    nt_range_fn fn = nt_reduce_fn(op, dtype, k);
    if (fn == NULL) return NT_ERR_INTERNAL;
    return nt_reduce_run(fn, dtype, dst, srcs, k, n, 0.0, nthreads);
}

NT_API int nt_reduce_n_scaled(int op, int dtype, void *dst, const void *const *srcs, int k,
                              int64_t n, double alpha, int nthreads) {
    if (op < 0 || op >= NT_NOPS) return NT_ERR_OP;
    int st = nt_check_common(dtype, n, nthreads);
    if (st != NT_OK) return st;
    /* a mean is the one use: scaling a product, max or min has none, so they are refused */
    if (op != NT_SUM) return NT_ERR_OP;
    if (nt_scaled_sum_table[dtype][0] == NULL) return NT_ERR_UNSUPPORTED;
    if (k < 1 || k > NT_MAX_SOURCES) return NT_ERR_NSOURCES;
    nt_range_fn fn = nt_scaled_sum_fn(dtype, k);
    if (fn == NULL) return NT_ERR_INTERNAL;
    return nt_reduce_run(fn, dtype, dst, srcs, k, n, alpha, nthreads);
}

/* One block of a reduce_many at a time: the reduction into dst, then the block copied from
   dst (still in cache) into each other destination: the sources are read once and every
   destination written once. */
static void nt_reduce_many_range(const nt_job *job, int64_t lo, int64_t hi) {
    const int64_t item = job->item;
    for (int64_t s = lo; s < hi; s += NT_GRAIN_ELEMS) {
        int64_t e = s + NT_GRAIN_ELEMS < hi ? s + NT_GRAIN_ELEMS : hi;
        job->inner(job, s, e);
        for (int j = 0; j < job->m; ++j) {
            nt_job piece = *job;
            piece.dst = job->mdst[j];
            piece.srcs[0] = job->dst;
            piece.stream = job->mstream[j];
            nt_copy_range(&piece, s * item, e * item);
        }
    }
}

NT_API int nt_reduce_many(int op, int dtype, void *const *dsts, int m, const void *const *srcs,
                          int k, int64_t n, double alpha, int nthreads) {
    if (op < 0 || op >= NT_NOPS) return NT_ERR_OP;
    int st = nt_check_common(dtype, n, nthreads);
    if (st != NT_OK) return st;
    if (k < 1 || k > NT_MAX_SOURCES || m < 1 || m > NT_MAX_SOURCES) return NT_ERR_NSOURCES;
    if (alpha != 1.0 && (op != NT_SUM || nt_scaled_sum_table[dtype][0] == NULL))
        return alpha != 1.0 && op != NT_SUM ? NT_ERR_OP : NT_ERR_UNSUPPORTED;
    nt_range_fn fn = alpha != 1.0 ? nt_scaled_sum_fn(dtype, k) : nt_reduce_fn(op, dtype, k);
    if (fn == NULL) return NT_ERR_INTERNAL;
    if (m == 1) return nt_reduce_run(fn, dtype, dsts[0], srcs, k, n, alpha, nthreads);
    if (n == 0) return NT_OK;
    if (dsts == NULL || srcs == NULL) return NT_ERR_NULL;
    const int64_t nbytes = n * nt_itemsize[dtype];
    nt_job job = {0};
    job.dst = dsts[0];
    if (job.dst == NULL) return NT_ERR_NULL;
    for (int j = 0; j < k; ++j) {
        if (srcs[j] == NULL) return NT_ERR_NULL;
        job.srcs[j] = srcs[j];
    }
    /* each destination is written block by block after the block of every source was
       read: a destination may be a source (the same pointer) but not overlap one, or
       another destination, in any other way */
    for (int i = 0; i < m; ++i) {
        if (dsts[i] == NULL) return NT_ERR_NULL;
        for (int j = 0; j < k; ++j)
            if (srcs[j] != dsts[i] && nt_overlaps(srcs[j], dsts[i], nbytes)) return NT_ERR_OVERLAP;
        for (int j = 0; j < i; ++j)
            if (dsts[j] != dsts[i] && nt_overlaps(dsts[j], dsts[i], nbytes))
                return NT_ERR_OVERLAP;
    }
    job.a = alpha;
    job.inner = fn;
    job.item = nt_itemsize[dtype];
    job.m = 0;
    for (int i = 1; i < m; ++i) {
        /* the same memory as an earlier destination holds the result already (a copy
           whose source is its destination moves nothing) */
        int seen = 0;
        for (int j = 0; j < i; ++j) seen |= (dsts[j] == dsts[i]);
        if (seen) continue;
        int is_source = 0;
        for (int j = 0; j < k; ++j) is_source |= (srcs[j] == dsts[i]);
        job.mdst[job.m] = dsts[i];
#ifdef NT_STREAM
        /* a destination just read as a source is in cache: a plain store costs no read */
        job.mstream[job.m] = !is_source && nbytes >= NT_STREAM_MIN_REDUCE_BYTES;
#else
        (void)is_source;
#endif
        job.m++;
    }
    /* dst itself is read back at once for the copies: never streamed */
    job.stream = 0;
    nt_run(nt_reduce_many_range, &job, n, NT_GRAIN_ELEMS, nthreads);
    return NT_OK;
}

NT_API int nt_sum_n(int dtype, void *dst, const void *const *srcs, int k, int64_t n,
                    int nthreads) {
    return nt_reduce_n(NT_SUM, dtype, dst, srcs, k, n, nthreads);
}

NT_API int nt_sum_into(int dtype, void *dst, const void *src, int64_t n, int nthreads) {
    const void *srcs[2] = {dst, src};
    return nt_reduce_n(NT_SUM, dtype, dst, srcs, 2, n, nthreads);
}

NT_API int nt_scale(int dtype, void *x, double alpha, int64_t n, int nthreads) {
    int st = nt_check_common(dtype, n, nthreads);
    if (st != NT_OK) return st;
    if (nt_scale_table[dtype] == NULL) return NT_ERR_UNSUPPORTED;
    if (n == 0) return NT_OK;
    if (x == NULL) return NT_ERR_NULL;
    nt_job job = {0};
    job.dst = x;
    job.a = alpha;
    nt_run(nt_scale_fn(dtype), &job, n, NT_GRAIN_ELEMS, nthreads);
    return NT_OK;
}

NT_API int nt_sgd_update(int dtype, void *w, void *g, void *v, double lr, double momentum,
                         double weight_decay, int64_t n, int nthreads) {
    int st = nt_check_common(dtype, n, nthreads);
    if (st != NT_OK) return st;
    if (nt_sgd_table[dtype] == NULL) return NT_ERR_UNSUPPORTED;
    if (n == 0) return NT_OK;
    if (w == NULL || g == NULL || v == NULL) return NT_ERR_NULL;
    /* w, g and v are all written: any shared byte would make the result order-dependent */
    int64_t nbytes = n * nt_itemsize[dtype];
    if (nt_overlaps(w, g, nbytes) || nt_overlaps(w, v, nbytes) || nt_overlaps(g, v, nbytes))
        return NT_ERR_OVERLAP;
    nt_job job = {0};
    job.dst = w;
    job.aux1 = g;
    job.aux2 = v;
    job.a = lr;
    job.b = momentum;
    job.c = weight_decay;
    nt_run(nt_sgd_fn(dtype), &job, n, NT_GRAIN_ELEMS, nthreads);
    return NT_OK;
}

NT_API int nt_copy(void *dst, const void *src, int64_t nbytes, int nthreads) {
    if (nbytes < 0) return NT_ERR_SIZE;
    if (nthreads < 1) return NT_ERR_THREADS;
    if (nbytes == 0 || dst == src) return NT_OK;
    if (dst == NULL || src == NULL) return NT_ERR_NULL;
    if (nt_overlaps(dst, src, nbytes)) return NT_ERR_OVERLAP;
    nt_job job = {0};
    job.dst = dst;
    job.srcs[0] = src;
#ifdef NT_STREAM
    job.stream = nbytes >= NT_STREAM_MIN_COPY_BYTES;
#endif
    nt_run(nt_copy_range, &job, nbytes, NT_GRAIN_BYTES, nthreads);
    return NT_OK;
}

NT_API int nt_run_steps(int dtype, const nt_step *steps, int nsteps, void *const *bases,
                        const int *threads, int *failed) {
    if (dtype < 0 || dtype >= NT_NDTYPES) return NT_ERR_DTYPE;
    if (nsteps < 0) return NT_ERR_SIZE;
    if (nsteps > 0 && (steps == NULL || bases == NULL || threads == NULL)) return NT_ERR_NULL;
    const int64_t item = nt_itemsize[dtype];
    for (int i = 0; i < nsteps; ++i) {
        const nt_step *s = &steps[i];
        char *dst = (char *)bases[s->dst] + s->dst_off * item;
        const int nthreads = threads[s->rank];
        int st;
        switch (s->kind) {
        case NT_STEP_COPY:
            st = nt_copy(dst, (const char *)bases[s->src[0]] + s->src_off[0] * item,
                         s->count * item, nthreads);
            break;
        case NT_STEP_REDUCE: {
            if (s->k < 1 || s->k > NT_MAX_SOURCES) {
                st = NT_ERR_NSOURCES;
                break;
            }
            const void *srcs[NT_MAX_SOURCES];
            for (int j = 0; j < s->k; ++j)
                srcs[j] = (const char *)bases[s->src[j]] + s->src_off[j] * item;
            st = s->alpha != 1.0
                     ? nt_reduce_n_scaled(s->op, dtype, dst, srcs, s->k, s->count, s->alpha,
                                          nthreads)
                     : nt_reduce_n(s->op, dtype, dst, srcs, s->k, s->count, nthreads);
            break;
        }
        case NT_STEP_SCALE:
            st = nt_scale(dtype, dst, s->alpha, s->count, nthreads);
            break;
        case NT_STEP_REDUCE_MANY: {
            if (s->k < 1 || s->k > NT_MAX_SOURCES || s->m < 1 || s->m > NT_MAX_SOURCES) {
                st = NT_ERR_NSOURCES;
                break;
            }
            const void *srcs[NT_MAX_SOURCES];
            void *dsts[NT_MAX_SOURCES];
            for (int j = 0; j < s->k; ++j)
                srcs[j] = (const char *)bases[s->src[j]] + s->src_off[j] * item;
            dsts[0] = dst;
            for (int j = 1; j < s->m; ++j)
                dsts[j] = (char *)bases[s->mdst[j - 1]] + s->mdst_off[j - 1] * item;
            st = nt_reduce_many(s->op, dtype, dsts, s->m, srcs, s->k, s->count, s->alpha,
                                nthreads);
            break;
        }
        default:
            st = NT_ERR_UNSUPPORTED;
        }
        if (st != NT_OK) {
            if (failed != NULL) *failed = i;
            return st;
        }
    }
    return NT_OK;
}

NT_API int nt_gather(void *dst, const void *const *srcs, const int64_t *nbytes, int k,
                     int nthreads) {
    if (k < 0) return NT_ERR_SIZE;
    if (nthreads < 1) return NT_ERR_THREADS;
    if (k == 0) return NT_OK;
    if (srcs == NULL || nbytes == NULL) return NT_ERR_NULL;
    int64_t total = 0;
    for (int j = 0; j < k; ++j) {
        if (nbytes[j] < 0) return NT_ERR_SIZE;
        if (nbytes[j] > 0 && srcs[j] == NULL) return NT_ERR_NULL;
        total += nbytes[j];
    }
    if (total == 0) return NT_OK;
    if (dst == NULL) return NT_ERR_NULL;
    /* a source inside the destination could be overwritten before it is read */
    uintptr_t d0 = (uintptr_t)dst, d1 = d0 + (uintptr_t)total;
    for (int j = 0; j < k; ++j) {
        uintptr_t s0 = (uintptr_t)srcs[j];
        if (nbytes[j] > 0 && s0 < d1 && d0 < s0 + (uintptr_t)nbytes[j]) return NT_ERR_OVERLAP;
    }
    /* offsets on the stack for the usual batch sizes, so a call costs no allocation */
    int64_t stack_off[257];
    int64_t *off = k < 257 ? stack_off : (int64_t *)malloc(((size_t)k + 1) * sizeof(int64_t));
    if (off == NULL) return NT_ERR_INTERNAL;
    off[0] = 0;
    for (int j = 0; j < k; ++j) off[j + 1] = off[j] + nbytes[j];
    nt_job job = {0};
    job.dst = dst;
    job.gsrcs = srcs;
    job.goff = off;
    job.gk = k;
#ifdef NT_STREAM
    job.stream = total >= NT_STREAM_MIN_COPY_BYTES;
#endif
    nt_run(nt_gather_range, &job, total, NT_GRAIN_BYTES, nthreads);
    if (off != stack_off) free(off);
    return NT_OK;
}

NT_API const char *nt_strerror(int status) {
    switch (status) {
    case NT_OK: return "success";
    case NT_ERR_DTYPE: return "unknown dtype code";
    case NT_ERR_OP: return "unknown reduction op code, or one this kernel does not take";
    case NT_ERR_NSOURCES: return "number of sources outside 1..8";
    case NT_ERR_SIZE: return "negative element count";
    case NT_ERR_NULL: return "NULL pointer with a non-zero element count";
    case NT_ERR_THREADS: return "thread count below 1";
    case NT_ERR_UNSUPPORTED: return "dtype not supported by this kernel";
    case NT_ERR_OVERLAP: return "arrays overlap in memory (only dst == a source is allowed)";
    case NT_ERR_INTERNAL: return "internal error: kernel missing from the dispatch table";
    case NT_TIMEOUT: return "timed out";
    case NT_ERR_PLATFORM: return "not available on this platform";
    case NT_ERR_ALIGN: return "counter address not aligned to 8 bytes";
    case NT_ERR_CPU: return "cannot pin a thread to that CPU (not one this process may use)";
    default: return "unknown status";
    }
}

/* ---- the wait primitive ------------------------------------------------------------------
 *
 * A counter is two adjacent 32-bit words in plain memory: word[0] the value (a sequence
 * number that wraps), word[1] the number of threads blocked on it.  Nothing else is kept,
 * so the same two words work in a numpy array or in a shared mapping between processes
 * (flag NT_COUNTER_SHARED: futex without FUTEX_PRIVATE_FLAG).
 *
 * No lost wake-up: a waiter increments word[1] and then reads word[0]; a waker adds to
 * word[0] and then reads word[1], both sequentially consistent.  So either the waiter sees
 * the new value, or the waker sees it waiting and wakes the futex; and a waiter that has
 * not yet slept then finds word[0] changed, which FUTEX_WAIT checks atomically.
 *
 * Linux: futex.  Other POSIX systems: one process-wide mutex and condition variable
 * (threads of one process only; NT_COUNTER_SHARED is refused).  Elsewhere: NT_ERR_PLATFORM.
 */
#include <stdatomic.h>
#include <time.h>
#if defined(__linux__)
#define NT_FUTEX 1
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__unix__) || defined(__APPLE__)
#define NT_CONDVAR 1
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>
static pthread_mutex_t nt_cv_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t nt_cv_cond = PTHREAD_COND_INITIALIZER;
#endif

#if defined(NT_FUTEX) || defined(NT_CONDVAR)
#define NT_HAVE_WAIT 1
#if defined(__x86_64__) || defined(__i386__)
#define NT_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define NT_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define NT_CPU_RELAX() ((void)0)
#endif

static int64_t nt_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline int nt_reached(uint32_t value, uint32_t target) {
    /* wrap-safe: value is at or past target when it is less than 2^31 ahead of it */
    return (int32_t)(value - target) >= 0;
}

static inline _Atomic uint32_t *nt_word(uint32_t *counter, int i) {
    return (_Atomic uint32_t *)(counter + i);
}

/* ---- the adaptive spin: spin only while the machine has a core to spare ---- */
static atomic_int nt_spinners;         /* threads of this process spinning now */
static atomic_int nt_ncpu;             /* online CPUs, read once */
static _Atomic int64_t nt_busy_until;  /* until then, a recent sample said "no core free" */
static _Atomic int64_t nt_sampled_at;  /* when /proc/loadavg was last read */
#define NT_SAMPLE_NS ((int64_t)2000000) /* the run-queue sample is trusted 2 ms */

static int nt_cpus(void) {
    int n = atomic_load_explicit(&nt_ncpu, memory_order_relaxed);
    if (n == 0) {
#ifdef NT_FUTEX
        /* the CPUs this process may run on, not every CPU of the machine */
        cpu_set_t set;
        n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
#endif
        if (n <= 0) {
            long c = sysconf(_SC_NPROCESSORS_ONLN);
            n = c > 0 ? (int)c : 1;
        }
        atomic_store_explicit(&nt_ncpu, n, memory_order_relaxed);
    }
    return n;
}

/* Runnable threads on the whole machine now (the 4th field of /proc/loadavg, "R/T"),
   including the caller; -1 where unknown. */
static int nt_runnable(void) {
#ifdef NT_FUTEX
    FILE *f = fopen("/proc/loadavg", "r");
    if (f == NULL) return -1;
    double a, b, c;
    int running = -1, total;
    if (fscanf(f, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) running = -1;
    fclose(f);
    return running;
#else
    return -1;
#endif
}

/* Whether spinning now is likely to help: another spinner or a busy machine would take
   the core the thread we wait for needs.  The run-queue sample costs a few microseconds,
   so it is taken at most every NT_SAMPLE_NS by whichever thread comes first. */
static int nt_spin_allowed(int64_t now) {
    int ncpu = nt_cpus();
    if (ncpu < 2) return 0;
    if (atomic_load_explicit(&nt_spinners, memory_order_relaxed) >= ncpu - 1) return 0;
    int64_t at = atomic_load_explicit(&nt_sampled_at, memory_order_relaxed);
    if (now - at > NT_SAMPLE_NS &&
        atomic_compare_exchange_strong_explicit(&nt_sampled_at, &at, now,
                                                memory_order_relaxed, memory_order_relaxed)) {
        int r = nt_runnable();
        /* the caller and the thread it waits for both run: more than ncpu runnable means
           someone is already queued for a core */
        atomic_store_explicit(&nt_busy_until, r > ncpu ? now + NT_SAMPLE_NS : 0,
                              memory_order_relaxed);
    }
    return now >= atomic_load_explicit(&nt_busy_until, memory_order_relaxed);
}

#ifdef NT_FUTEX
static long nt_futex(_Atomic uint32_t *addr, int op, uint32_t val, const struct timespec *ts,
                     int shared) {
    if (!shared) op |= FUTEX_PRIVATE_FLAG;
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}
#endif
#endif /* NT_FUTEX || NT_CONDVAR */

NT_API int nt_counter_wait(uint32_t *counter, uint32_t target, int64_t timeout_ns,
                           int64_t spin_ns, int flags) {
#ifdef NT_HAVE_WAIT
    if (counter == NULL) return NT_ERR_NULL;
    if (((uintptr_t)counter & 7u) != 0) return NT_ERR_ALIGN;
    if (timeout_ns < 0) return NT_ERR_SIZE;
    int shared = (flags & NT_COUNTER_SHARED) != 0;
#ifdef NT_CONDVAR
    if (shared) return NT_ERR_PLATFORM;
#endif
    _Atomic uint32_t *value = nt_word(counter, 0), *waiters = nt_word(counter, 1);
    if (nt_reached(atomic_load_explicit(value, memory_order_acquire), target)) return NT_OK;
    int64_t start = nt_now_ns();
    int64_t deadline = start + timeout_ns;
    if (spin_ns < 0) spin_ns = nt_spin_allowed(start) ? NT_SPIN_DEFAULT_NS : 0;
    if (spin_ns > timeout_ns) spin_ns = timeout_ns;
    if (spin_ns > 0) {
        atomic_fetch_add_explicit(&nt_spinners, 1, memory_order_relaxed);
        int64_t spin_end = start + spin_ns;
        int done = 0;
        for (unsigned i = 1;; ++i) {
            if (nt_reached(atomic_load_explicit(value, memory_order_acquire), target)) {
                done = 1;
                break;
            }
            NT_CPU_RELAX();
            if ((i & 63u) == 0 && nt_now_ns() >= spin_end) break;
        }
        atomic_fetch_sub_explicit(&nt_spinners, 1, memory_order_relaxed);
        if (done) return NT_OK;
    }
    int status = NT_OK;
    atomic_fetch_add_explicit(waiters, 1, memory_order_seq_cst);
#ifdef NT_FUTEX
    for (;;) {
        uint32_t v = atomic_load_explicit(value, memory_order_seq_cst);
        if (nt_reached(v, target)) break;
        int64_t left = deadline - nt_now_ns();
        if (left <= 0) {
            status = NT_TIMEOUT;
            break;
        }
        struct timespec ts = {(time_t)(left / 1000000000), (long)(left % 1000000000)};
        /* returns at a wake, a timeout, a signal (EINTR) or when *value != v (EAGAIN):
           every case re-reads the value and the clock */
        (void)nt_futex(value, FUTEX_WAIT, v, &ts, shared);
    }
#else
    pthread_mutex_lock(&nt_cv_mutex);
    for (;;) {
        if (nt_reached(atomic_load_explicit(value, memory_order_seq_cst), target)) break;
        int64_t left = deadline - nt_now_ns();
        if (left <= 0) {
            status = NT_TIMEOUT;
            break;
        }
        /* the condition variable's clock is the realtime one */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t at = (int64_t)ts.tv_nsec + left;
        ts.tv_sec += (time_t)(at / 1000000000);
        ts.tv_nsec = (long)(at % 1000000000);
        (void)pthread_cond_timedwait(&nt_cv_cond, &nt_cv_mutex, &ts);
    }
    pthread_mutex_unlock(&nt_cv_mutex);
#endif
    atomic_fetch_sub_explicit(waiters, 1, memory_order_seq_cst);
    return status;
#else
    (void)counter, (void)target, (void)timeout_ns, (void)spin_ns, (void)flags;
    return NT_ERR_PLATFORM;
#endif
}

NT_API int nt_counter_add_wake(uint32_t *counter, uint32_t delta, int flags,
                               uint32_t *new_value) {
#ifdef NT_HAVE_WAIT
    if (counter == NULL) return NT_ERR_NULL;
    if (((uintptr_t)counter & 7u) != 0) return NT_ERR_ALIGN;
    int shared = (flags & NT_COUNTER_SHARED) != 0;
#ifdef NT_CONDVAR
    if (shared) return NT_ERR_PLATFORM;
#endif
    _Atomic uint32_t *value = nt_word(counter, 0), *waiters = nt_word(counter, 1);
    uint32_t v = atomic_fetch_add_explicit(value, delta, memory_order_seq_cst) + delta;
    if (new_value != NULL) *new_value = v;
    /* the syscall only when someone sleeps (spinners see the value by themselves) */
    if (atomic_load_explicit(waiters, memory_order_seq_cst) != 0) {
#ifdef NT_FUTEX
        (void)nt_futex(value, FUTEX_WAKE, INT_MAX, NULL, shared);
#else
        pthread_mutex_lock(&nt_cv_mutex);
        pthread_cond_broadcast(&nt_cv_cond);
        pthread_mutex_unlock(&nt_cv_mutex);
#endif
    }
    return NT_OK;
#else
    (void)counter, (void)delta, (void)flags, (void)new_value;
    return NT_ERR_PLATFORM;
#endif
}

#ifdef NT_HAVE_WAIT
#include <pthread.h>
typedef struct {
    uint32_t *ping, *pong; /* two counters */
    int64_t rounds, spin_ns;
    int cpu; /* pin the answering thread to this CPU (< 0: no pinning) */
    int status;
} nt_pingpong_arg;

/* Pin the calling thread to one CPU; 0 or a status. */
static int nt_pin_self(int cpu) {
    if (cpu < 0) return NT_OK;
#ifdef NT_FUTEX
    if (cpu >= CPU_SETSIZE) return NT_ERR_CPU;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0 ? NT_OK : NT_ERR_CPU;
#else
    return NT_ERR_PLATFORM;
#endif
}

static void *nt_pong(void *p) {
    nt_pingpong_arg *a = (nt_pingpong_arg *)p;
    a->status = nt_pin_self(a->cpu);
    for (int64_t i = 1; i <= a->rounds && a->status == NT_OK; ++i) {
        int s = nt_counter_wait(a->ping, (uint32_t)i, NT_PINGPONG_TIMEOUT_NS, a->spin_ns, 0);
        if (s != NT_OK) a->status = s;
        else nt_counter_add_wake(a->pong, 1, 0, NULL);
    }
    /* on a failure, let the other side see it instead of waiting out its timeout */
    if (a->status != NT_OK) nt_counter_add_wake(a->pong, 0x40000000u, 0, NULL);
    return NULL;
}
#endif

#ifdef NT_HAVE_WAIT
typedef struct {
    nt_pingpong_arg *a; /* the shared counters and the answering side's status */
    int cpu, status;
    int64_t elapsed;
} nt_ping_ctx;

static void *nt_ping(void *p) {
    nt_ping_ctx *c = (nt_ping_ctx *)p;
    nt_pingpong_arg *a = c->a;
    c->status = nt_pin_self(c->cpu);
    int64_t t0 = nt_now_ns();
    for (int64_t i = 1; i <= a->rounds && c->status == NT_OK; ++i) {
        nt_counter_add_wake(a->ping, 1, 0, NULL);
        c->status = nt_counter_wait(a->pong, (uint32_t)i, NT_PINGPONG_TIMEOUT_NS, a->spin_ns, 0);
    }
    c->elapsed = nt_now_ns() - t0;
    if (c->status != NT_OK) nt_counter_add_wake(a->ping, 0x40000000u, 0, NULL);
    return NULL;
}
#endif

NT_API int64_t nt_futex_pingpong(int64_t rounds, int64_t spin_ns, int cpu_a, int cpu_b) {
#ifdef NT_HAVE_WAIT
    if (rounds < 1) return -NT_ERR_SIZE;
    /* 8-byte aligned, each counter on its own cache line */
    _Alignas(64) uint32_t words[32] = {0};
    nt_pingpong_arg a = {words, words + 16, rounds, spin_ns, cpu_b, NT_OK};
    nt_ping_ctx c = {&a, cpu_a, NT_OK, 0};
    /* two new threads, so that pinning them leaves the caller's affinity alone */
    pthread_t tp, tq;
    if (pthread_create(&tq, NULL, nt_pong, &a) != 0) return -NT_ERR_INTERNAL;
    if (pthread_create(&tp, NULL, nt_ping, &c) != 0) {
        nt_counter_add_wake(a.ping, 0x40000000u, 0, NULL);
        pthread_join(tq, NULL);
        return -NT_ERR_INTERNAL;
    }
    pthread_join(tp, NULL);
    pthread_join(tq, NULL);
    int status = c.status != NT_OK ? c.status : a.status;
    if (status != NT_OK) return -status;
    return c.elapsed / rounds;
#else
    (void)rounds, (void)spin_ns, (void)cpu_a, (void)cpu_b;
    return -NT_ERR_PLATFORM;
#endif
}

NT_API int64_t nt_spin_default_ns(void) { return NT_SPIN_DEFAULT_NS; }
