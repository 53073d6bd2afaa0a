// nccltree CUDA kernels: the operations of the host library (nccltree_host.c) as
// extern "C" kernels, one per (operation, dtype), e.g. nt_reduce_n_sum_f32.
//
// The file includes no headers, so the same text compiles with nvcc (to the shipped
// fatbin) and with NVRTC at run time (cupy.RawModule(code=...)) when the fatbin is missing.
// float16 is stored as IEEE half bits and accumulated in float32 (PTX cvt instructions,
// which need no cuda_fp16.h).  bfloat16 (the upper half of a float32, in a struct of its
// own so that it does not take float16's path) is accumulated in float32 too and rounded
// to nearest even by integer arithmetic, bit for bit as the host library rounds it (no
// cuda_bf16.h, and no cvt.rn.bf16.f32, which needs compute capability 8.0).  int8/uint8
// are computed in int (wrapping sums and products keep the same low 8 bits) and
// truncated at the store.  Every kernel is a grid-stride loop; reduce/sum_into/scale/
// sgd use 16-byte vector loads and stores when every pointer involved has the same offset
// within 16 bytes: a scalar head of up to 16/sizeof(T) - 1 elements brings them all to a
// 16-byte boundary, the body runs on vectors, a scalar tail ends it.  Pointers with
// different offsets take the scalar path for the whole range.  Each element is computed
// by the same operations in the same order on every path, so the split never changes a
// result.
//
// Floating-point semantics are those of the host library and numpy: no fused multiply-add,
// no flush of subnormals to zero, IEEE division and square root.  Both builds pass them
// explicitly (nvcc: --fmad=false -ftz=false --prec-div=true --prec-sqrt=true; NVRTC the
// same options), so the fatbin and the run-time compiled module are bitwise the same.
//
// Signatures (n counts elements, T is the storage type, S the scalar type:
// float for f16/bf16/f32, double for f64):
//   nt_reduce_n_{sum,prod,max,min}_{f16,bf16,f32,f64,i8,u8,i32,i64}(T *dst, nt_srcs srcs, int k,
//                                                                  long long n)
//   nt_reduce_n_scaled_sum_{f16,bf16,f32,f64}(T *dst, nt_srcs srcs, int k, long long n, S alpha)
//                                    dst = alpha * sum(srcs) (a mean in one pass)
//   nt_sum_into_{dtype}(T *dst, const T *src, long long n)              dst += src
//   nt_scale_{f16,bf16,f32,f64}(T *x, S alpha, long long n)            x *= alpha
//   nt_sgd_update_{f16,bf16,f32,f64}(T *w, T *g, T *v, S lr, S momentum, S weight_decay,
//                                    long long n)
//                                    g += wd*w; v = momentum*v + lr*g; w -= v

// Sources one reduce takes: must equal nccltree.backends.base.MAX_FUSED (and NT_MAX_SOURCES
// of nccltree.h), which _cuda_kernels checks before compiling this source and a test checks
// for the shipped file; the struct below is passed by value, so a mismatch would misread it.
#define NT_MAX_SOURCES 8

// Passed by value: the k source pointers (unused slots are ignored).
struct nt_srcs {
    const void *p[NT_MAX_SOURCES];
};

// ---- storage <-> compute type ----
template <typename T>
struct nt_io {
    typedef T acc;
    static __device__ __forceinline__ acc load(T x) { return x; }
    static __device__ __forceinline__ T store(acc x) { return x; }
};

template <>
struct nt_io<unsigned short> {  // IEEE half bits
    typedef float acc;
    static __device__ __forceinline__ float load(unsigned short h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ unsigned short store(float f) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return h;
    }
};

// bfloat16 bits: widening is a shift; narrowing adds 0x7fff plus the lowest kept bit
// (round to nearest even) and turns a NaN into the quiet NaN of its sign, as ml_dtypes does
struct nt_bf16 {
    unsigned short bits;
};

template <>
struct nt_io<nt_bf16> {
    typedef float acc;
    // bit moves by PTX mov, as the half conversions use cvt: no header needed
    static __device__ __forceinline__ float load(nt_bf16 h) {
        float f;
        asm("mov.b32 %0, %1;" : "=f"(f) : "r"((unsigned)h.bits << 16));
        return f;
    }
    static __device__ __forceinline__ nt_bf16 store(float f) {
        unsigned u;
        asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f));
        const unsigned rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        const unsigned qnan = ((u >> 16) & 0x8000u) | 0x7fc0u;
        nt_bf16 h;
        h.bits = (unsigned short)(((u & 0x7fffffffu) > 0x7f800000u) ? qnan : rounded);
        return h;
    }
};

template <>
struct nt_io<signed char> {
    typedef int acc;
    static __device__ __forceinline__ int load(signed char x) { return x; }
    static __device__ __forceinline__ signed char store(int x) {
        return (signed char)(unsigned char)(unsigned)x;
    }
};

template <>
struct nt_io<unsigned char> {
    typedef int acc;
    static __device__ __forceinline__ int load(unsigned char x) { return x; }
    static __device__ __forceinline__ unsigned char store(int x) { return (unsigned char)(unsigned)x; }
};

// ---- ops; integer sum/prod wrap around (as numpy's) through unsigned arithmetic ----
__device__ __forceinline__ float nt_add(float a, float b) { return a + b; }
__device__ __forceinline__ double nt_add(double a, double b) { return a + b; }
__device__ __forceinline__ int nt_add(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ long long nt_add(long long a, long long b) {
    return (long long)((unsigned long long)a + (unsigned long long)b);
}
__device__ __forceinline__ float nt_mul(float a, float b) { return a * b; }
__device__ __forceinline__ double nt_mul(double a, double b) { return a * b; }
__device__ __forceinline__ int nt_mul(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ long long nt_mul(long long a, long long b) {
    return (long long)((unsigned long long)a * (unsigned long long)b);
}

struct nt_op_sum {
    template <typename A> static __device__ __forceinline__ A f(A a, A b) { return nt_add(a, b); }
};
struct nt_op_prod {
    template <typename A> static __device__ __forceinline__ A f(A a, A b) { return nt_mul(a, b); }
};
// NaN-propagating, as numpy.maximum / numpy.minimum (a != a is false for integers)
struct nt_op_max {
    template <typename A> static __device__ __forceinline__ A f(A a, A b) {
        return (a > b || a != a) ? a : b;
    }
};
struct nt_op_min {
    template <typename A> static __device__ __forceinline__ A f(A a, A b) {
        return (a < b || a != a) ? a : b;
    }
};

template <typename T>
struct alignas(16) nt_vec {
    T v[16 / sizeof(T)];
};

// whether a and b have the same offset within 16 bytes
__device__ __forceinline__ bool nt_same16(const void *a, const void *b) {
    return (((unsigned long long)a ^ (unsigned long long)b) & 15ull) == 0;
}

// Elements before p reaches a 16-byte boundary (at most n), when every other pointer of the
// operation shares p's offset within 16 bytes (same); n, i.e. all scalar, otherwise.
template <typename T>
__device__ __forceinline__ long long nt_head(const void *p, bool same, long long n) {
    const unsigned mis = (unsigned)((unsigned long long)p & 15ull);
    if (!same || mis % sizeof(T) != 0) return n;
    const long long h = ((16u - mis) & 15u) / sizeof(T);
    return h < n ? h : n;
}

__device__ __forceinline__ long long nt_tid() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ long long nt_stride() {
    return (long long)blockDim.x * gridDim.x;
}

// The last step before the store: none, or a multiplication by alpha in the compute type,
// so a scaled sum does the operations of a sum followed by nt_scale (bitwise the same for
// f32/f64; f16 rounds once instead of twice).
struct nt_fin_none {
    template <typename A> static __device__ __forceinline__ A f(A x, A) { return x; }
};
struct nt_fin_scale {
    template <typename A> static __device__ __forceinline__ A f(A x, A alpha) { return x * alpha; }
};

// One element of dst = fin(op(srcs[0..k-1])), in source order.
template <typename T, typename Op, typename Fin>
__device__ __forceinline__ void nt_reduce_one(T *dst, const nt_srcs &s, int k, long long i,
                                              typename nt_io<T>::acc alpha) {
    typedef nt_io<T> io;
    typename io::acc acc = io::load(((const T *)s.p[0])[i]);
#pragma unroll
    for (int j = 1; j < NT_MAX_SOURCES; ++j)
        if (j < k) acc = Op::f(acc, io::load(((const T *)s.p[j])[i]));
    dst[i] = io::store(Fin::f(acc, alpha));
}

// dst = fin(op(srcs[0..k-1])); every thread reads all sources at i before writing dst at
// i, so dst may be one of the sources.
template <typename T, typename Op, typename Fin = nt_fin_none>
__device__ __forceinline__ void nt_reduce(T *dst, const nt_srcs &s, int k, long long n,
                                          typename nt_io<T>::acc alpha = 0) {
    typedef nt_io<T> io;
    typedef typename io::acc A;
    const int V = 16 / sizeof(T);
    bool same = true;
    for (int j = 0; j < NT_MAX_SOURCES; ++j)
        if (j < k) same = same && nt_same16(dst, s.p[j]);
    const long long head = nt_head<T>(dst, same, n);
    const long long nvec = (n - head) / V;
    for (long long i = nt_tid(); i < head; i += nt_stride())
        nt_reduce_one<T, Op, Fin>(dst, s, k, i, alpha);
    nt_vec<T> *vdst = (nt_vec<T> *)(dst + head);
    for (long long i = nt_tid(); i < nvec; i += nt_stride()) {
        nt_vec<T> x = ((const nt_vec<T> *)((const T *)s.p[0] + head))[i];
        A acc[V];
#pragma unroll
        for (int l = 0; l < V; ++l) acc[l] = io::load(x.v[l]);
#pragma unroll
        for (int j = 1; j < NT_MAX_SOURCES; ++j) {
            if (j < k) {
                nt_vec<T> y = ((const nt_vec<T> *)((const T *)s.p[j] + head))[i];
#pragma unroll
                for (int l = 0; l < V; ++l) acc[l] = Op::f(acc[l], io::load(y.v[l]));
            }
        }
#pragma unroll
        for (int l = 0; l < V; ++l) x.v[l] = io::store(Fin::f(acc[l], alpha));
        vdst[i] = x;
    }
    for (long long i = head + nvec * V + nt_tid(); i < n; i += nt_stride())
        nt_reduce_one<T, Op, Fin>(dst, s, k, i, alpha);
}

template <typename T, typename S>
__device__ __forceinline__ void nt_scale(T *x, S alpha, long long n) {
    typedef nt_io<T> io;
    const int V = 16 / sizeof(T);
    const long long head = nt_head<T>(x, true, n);
    const long long nvec = (n - head) / V;
    for (long long i = nt_tid(); i < head; i += nt_stride())
        x[i] = io::store(io::load(x[i]) * alpha);
    nt_vec<T> *vx = (nt_vec<T> *)(x + head);
    for (long long i = nt_tid(); i < nvec; i += nt_stride()) {
        nt_vec<T> a = vx[i];
#pragma unroll
        for (int l = 0; l < V; ++l) a.v[l] = io::store(io::load(a.v[l]) * alpha);
        vx[i] = a;
    }
    for (long long i = head + nvec * V + nt_tid(); i < n; i += nt_stride())
        x[i] = io::store(io::load(x[i]) * alpha);
}

// Caffe's update, in the host library's order of operations.
template <typename A>
__device__ __forceinline__ void nt_sgd_one(A &w, A &g, A &v, A lr, A mom, A wd) {
    g = g + wd * w;
    v = mom * v + lr * g;
    w = w - v;
}

template <typename T, typename S>
__device__ __forceinline__ void nt_sgd_at(T *w, T *g, T *v, S lr, S mom, S wd, long long i) {
    typedef nt_io<T> io;
    S wi = io::load(w[i]), gi = io::load(g[i]), vi = io::load(v[i]);
    nt_sgd_one(wi, gi, vi, lr, mom, wd);
    w[i] = io::store(wi);
    g[i] = io::store(gi);
    v[i] = io::store(vi);
}

template <typename T, typename S>
__device__ __forceinline__ void nt_sgd(T *w, T *g, T *v, S lr, S mom, S wd, long long n) {
    typedef nt_io<T> io;
    const int V = 16 / sizeof(T);
    const long long head = nt_head<T>(w, nt_same16(w, g) && nt_same16(w, v), n);
    const long long nvec = (n - head) / V;
    for (long long i = nt_tid(); i < head; i += nt_stride())
        nt_sgd_at(w, g, v, lr, mom, wd, i);
    nt_vec<T> *vw = (nt_vec<T> *)(w + head), *vg = (nt_vec<T> *)(g + head);
    nt_vec<T> *vv = (nt_vec<T> *)(v + head);
    for (long long i = nt_tid(); i < nvec; i += nt_stride()) {
        nt_vec<T> a = vw[i], b = vg[i], c = vv[i];
#pragma unroll
        for (int l = 0; l < V; ++l) {
            S wi = io::load(a.v[l]), gi = io::load(b.v[l]), vi = io::load(c.v[l]);
            nt_sgd_one(wi, gi, vi, lr, mom, wd);
            a.v[l] = io::store(wi);
            b.v[l] = io::store(gi);
            c.v[l] = io::store(vi);
        }
        vw[i] = a;
        vg[i] = b;
        vv[i] = c;
    }
    for (long long i = head + nvec * V + nt_tid(); i < n; i += nt_stride())
        nt_sgd_at(w, g, v, lr, mom, wd, i);
}

// ---- extern "C" entry points ----
#define NT_REDUCE(OP, NAME, T)                                                          \
    extern "C" __global__ void nt_reduce_n_##OP##_##NAME(T *dst, nt_srcs srcs, int k,   \
                                                         long long n) {                 \
        nt_reduce<T, nt_op_##OP>(dst, srcs, k, n);                                      \
    }

#define NT_ALL_OPS(NAME, T)                                                             \
    NT_REDUCE(sum, NAME, T)                                                             \
    NT_REDUCE(prod, NAME, T)                                                            \
    NT_REDUCE(max, NAME, T)                                                             \
    NT_REDUCE(min, NAME, T)                                                             \
    extern "C" __global__ void nt_sum_into_##NAME(T *dst, const T *src, long long n) {  \
        nt_srcs s;                                                                      \
        s.p[0] = dst;                                                                   \
        s.p[1] = src;                                                                   \
        nt_reduce<T, nt_op_sum>(dst, s, 2, n);                                          \
    }

#define NT_FLOAT_ONLY(NAME, T, S)                                                       \
    extern "C" __global__ void nt_reduce_n_scaled_sum_##NAME(T *dst, nt_srcs srcs, int k, \
                                                             long long n, S alpha) {      \
        nt_reduce<T, nt_op_sum, nt_fin_scale>(dst, srcs, k, n, alpha);                    \
    }                                                                                     \
    extern "C" __global__ void nt_scale_##NAME(T *x, S alpha, long long n) {            \
        nt_scale<T, S>(x, alpha, n);                                                    \
    }                                                                                   \
    extern "C" __global__ void nt_sgd_update_##NAME(T *w, T *g, T *v, S lr, S momentum, \
                                                    S weight_decay, long long n) {      \
        nt_sgd<T, S>(w, g, v, lr, momentum, weight_decay, n);                           \
    }

NT_ALL_OPS(f16, unsigned short)
NT_ALL_OPS(f32, float)
NT_ALL_OPS(f64, double)
NT_ALL_OPS(i32, int)
NT_ALL_OPS(i64, long long)
NT_ALL_OPS(bf16, nt_bf16)
NT_ALL_OPS(i8, signed char)
NT_ALL_OPS(u8, unsigned char)
NT_FLOAT_ONLY(f16, unsigned short, float)
NT_FLOAT_ONLY(f32, float, float)
NT_FLOAT_ONLY(f64, double, double)
NT_FLOAT_ONLY(bf16, nt_bf16, float)
