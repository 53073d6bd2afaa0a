"""CUDA kernels: source checks that run anywhere, results against numpy on a GPU."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from test_native import reference  # the host kernels' reference, same rules

from nccltree import BackendUnavailable
from nccltree import _cuda_kernels as ck

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8]
FLOATS = [np.float16, np.float32, np.float64]


def tree_source() -> str:
    """The CUDA source of this checkout (an installed copy may be older), else the one
    the package ships."""
    path = Path(__file__).resolve().parents[1] / "csrc" / ck.SOURCE
    return path.read_text() if path.is_file() else ck.source_text()


def kernel_names() -> list[str]:
    """Every kernel the Python wrappers may ask for."""
    names = [f"nt_reduce_n_{op}_{s}" for op in ck.OPS for s in ck._SUFFIX.values()]
    names += [f"nt_sum_into_{s}" for s in ck._SUFFIX.values()]
    for s in (ck._SUFFIX[dt] for dt in ck._SCALAR):
        names += [f"nt_scale_{s}", f"nt_sgd_update_{s}", f"nt_reduce_n_scaled_sum_{s}"]
    return names


# ---- anywhere ----


@pytest.mark.subprocess
def test_import_needs_no_cupy() -> None:
    code = "import sys, nccltree._cuda_kernels; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_cupy_kernels_raise_backend_unavailable(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(BackendUnavailable, match="CuPy"):
        ck.reduce_n(np.zeros(4, np.float32), [np.zeros(4, np.float32)])
    with pytest.raises(BackendUnavailable):
        ck.module(0)


def test_source_is_shipped_and_header_free() -> None:
    text = ck.source_text()
    # NVRTC compiles it at run time without system headers
    assert "#include" not in text
    assert 'extern "C"' in text


@pytest.fixture(scope="module")
def ptx_params(tmp_path_factory) -> dict[str, list[int]]:
    """Kernel name -> byte size of each parameter, from the source compiled to PTX."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    d = tmp_path_factory.mktemp("ptx")
    (d / "k.cu").write_text(tree_source())
    subprocess.run(
        [
            "nvcc",
            "--ptx",
            "-arch=compute_75",
            "--fmad=false",
            "-o",
            str(d / "k.ptx"),
            str(d / "k.cu"),
        ],
        check=True,
        timeout=120,
    )
    out = {}
    for name, params in re.findall(r"\.entry\s+(\w+)\s*\((.*?)\)", (d / "k.ptx").read_text(), re.S):
        sizes = []
        for p in params.split(","):
            array = re.search(r"\.b8\s+\w+\[(\d+)\]", p)
            sizes.append(
                int(array.group(1)) if array else int(re.search(r"\.[usbf](\d+)", p).group(1)) // 8
            )
        out[name] = sizes
    return out


@pytest.mark.subprocess
@pytest.mark.slow
def test_source_defines_every_kernel_the_wrappers_use(ptx_params) -> None:
    assert set(kernel_names()) <= set(ptx_params)


class FakeArray:
    """Just enough of cupy.ndarray for the wrappers: a numpy array and its address."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.dtype, self.size, self.itemsize, self.nbytes = a.dtype, a.size, a.itemsize, a.nbytes
        self.flags = a.flags
        self.data = SimpleNamespace(ptr=a.ctypes.data)
        self.device = SimpleNamespace(id=0)


@pytest.fixture
def launch_recorder(monkeypatch):
    """A minimal stand-in for CuPy that records kernel launches instead of running them
    (only the argument marshalling of the wrappers is checked against the PTX)."""
    launches: list[tuple[str, tuple, tuple, tuple]] = []

    class Device:
        def __init__(self, i: int = 0) -> None:
            self.id = i

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class RawModule:
        def __init__(self, **kwargs) -> None:
            self.kwargs = kwargs

        def compile(self) -> None:
            pass

        def get_function(self, name: str):
            return lambda grid, block, args: launches.append((name, grid, block, args))

    fake = SimpleNamespace(
        ndarray=FakeArray, RawModule=RawModule, cuda=SimpleNamespace(Device=Device)
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for cache in ("_modules", "_origin", "_target", "_functions"):
        monkeypatch.setattr(ck, cache, {})
    return launches


def _arg_size(arg) -> int:
    if isinstance(arg, FakeArray):
        return 8  # a device pointer
    assert isinstance(arg, np.generic | np.ndarray), f"untyped kernel argument {arg!r}"
    return arg.dtype.itemsize


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.subprocess
def test_wrapper_arguments_match_the_kernel_signatures(launch_recorder, ptx_params, dtype) -> None:
    n = 1000
    arrays = [FakeArray(np.zeros(n, dtype)) for _ in range(4)]
    dst = arrays[0]
    ck.reduce_n(dst, arrays[1:], "max")
    ck.sum_into(dst, arrays[1])
    if np.dtype(dtype).kind == "f":
        ck.scale(dst, 0.5)
        ck.sgd_update(*arrays[:3], 0.1, 0.9, 1e-4)
        ck.reduce_n(dst, arrays[1:], alpha=0.25)
    else:
        with pytest.raises(TypeError, match="accepted"):
            ck.reduce_n(dst, arrays[1:], alpha=0.25)
    ck.reduce_n(FakeArray(np.zeros(0, dtype)), [FakeArray(np.zeros(0, dtype))])  # no launch
    assert len(launch_recorder) == (5 if np.dtype(dtype).kind == "f" else 2)
    for name, grid, block, args in launch_recorder:
        assert [_arg_size(a) for a in args] == ptx_params[name], name
        # the grid-stride loop covers n with 16-byte vectors
        assert grid[0] * block[0] * (16 // dst.itemsize) >= n
    name, _, _, args = launch_recorder[0]
    assert name == f"nt_reduce_n_max_{ck._SUFFIX[np.dtype(dtype)]}"
    assert list(args[1]["p"][0]) == [a.data.ptr for a in arrays[1:]] + [0] * 5
    assert args[2] == 3 and args[3] == n
    if np.dtype(dtype).kind == "f":
        name, _, _, args = launch_recorder[-1]
        assert name == f"nt_reduce_n_scaled_sum_{ck._SUFFIX[np.dtype(dtype)]}"
        assert args[4] == 0.25 and args[4].dtype == ck._SCALAR[np.dtype(dtype)]


# ---- the kernels' index arithmetic, run as host C++ ----

# Runs the templates of the .cu as host code: every thread of a small grid in turn (the
# grid-stride loops give each element to one thread, so any order is a valid schedule).
# The alignment sanitizer flags a vector access the head peel failed to align; guard
# elements around dst catch writes outside it; exact small-integer data checks that every
# element is computed once, on whichever path. Not a GPU test: the index logic only.
_HOST_HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
struct nt_dim3 { unsigned x; };
static nt_dim3 blockIdx, blockDim, gridDim, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#include "kernels.inc"

static int fails = 0;
static void fail(const char *what, long long n, int off, long long i) {
    if (fails++ < 10) std::printf("FAIL %s n=%lld off=%d i=%lld\n", what, n, off, i);
}
template <typename F> static void launch(unsigned grid, F f) {
    gridDim.x = grid; blockDim.x = 4;
    for (unsigned b = 0; b < grid; ++b)
        for (unsigned t = 0; t < blockDim.x; ++t) { blockIdx.x = b; threadIdx.x = t; f(); }
}
template <typename T> static T *alloc(long long n) {  // 64-byte aligned, like cudaMalloc
    return (T *)std::aligned_alloc(64, ((n * sizeof(T) + 63) / 64) * 64);
}
const int G = 16, PAD = 64;

template <typename T> static void reduce(int k, long long n, int doff, const int *soff, unsigned grid) {
    T *b[8]; nt_srcs s = {};
    for (int j = 0; j < k; ++j) {
        b[j] = alloc<T>(n + PAD);
        for (long long i = 0; i < n + PAD; ++i) b[j][i] = (T)((i * 7 + j * 3) % 31);
        s.p[j] = b[j] + soff[j];
    }
    T *db = alloc<T>(n + 2 * G + PAD), *dst = db + G + doff;
    for (long long i = 0; i < n + 2 * G + PAD; ++i) db[i] = (T)5;
    launch(grid, [&] { nt_reduce<T, nt_op_sum>(dst, s, k, n); });
    for (long long i = -G - doff; i < n + G; ++i) {
        T want = (T)5;
        if (i >= 0 && i < n) {
            want = 0;
            for (int j = 0; j < k; ++j) want = (T)(want + ((const T *)s.p[j])[i]);
        }
        if (dst[i] != want) { fail("reduce", n, doff, i); break; }
    }
    for (int j = 0; j < k; ++j) std::free(b[j]);
    std::free(db);
}

template <typename T> static void scale_sgd(long long n, int off, int goff, unsigned grid) {
    T *xb = alloc<T>(n + 2 * G + PAD), *x = xb + G + off;
    for (long long i = 0; i < n + 2 * G + PAD; ++i) xb[i] = (T)(i % 13);
    launch(grid, [&] { nt_scale<T, T>(x, (T)2, n); });
    for (long long i = -G - off; i < n + G; ++i) {
        T v = (T)((i + G + off) % 13);
        if (x[i] != ((i >= 0 && i < n) ? (T)(v * 2) : v)) { fail("scale", n, off, i); break; }
    }
    T *wb = alloc<T>(n + PAD), *gb = alloc<T>(n + PAD), *vb = alloc<T>(n + PAD);
    for (long long i = 0; i < n + PAD; ++i) { wb[i] = (T)(i % 5); gb[i] = (T)(i % 3); vb[i] = (T)(i % 7); }
    T *w = wb + off, *g = gb + goff, *v = vb + off;
    launch(grid, [&] { nt_sgd<T, T>(w, g, v, (T)1, (T)1, (T)0, n); });  // v += g; w -= v
    for (long long i = 0; i <= n; ++i) {
        T w0 = (T)((i + off) % 5), g0 = (T)((i + goff) % 3), v0 = (T)((i + off) % 7);
        bool in = i < n;
        T vv = in ? (T)(v0 + g0) : v0, ww = in ? (T)(w0 - vv) : w0;
        if (w[i] != ww || v[i] != vv || g[i] != g0) { fail("sgd", n, off, i); break; }
    }
    std::free(xb); std::free(wb); std::free(gb); std::free(vb);
}

int main() {
    const int zero[8] = {0}, one[8] = {1, 1, 1, 1, 1, 1, 1, 1}, three[8] = {3, 3, 3, 3, 3, 3, 3, 3};
    const int mixed[8] = {1, 0, 2, 3, 1, 0, 2, 3};
    for (long long n : {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 1001})
        for (unsigned grid : {1u, 3u}) {
            for (int k : {1, 2, 3, 8}) {
                for (int d : {0, 1}) {
                    const int *so = d == 0 ? zero : one;
                    reduce<unsigned short>(k, n, d, so, grid);
                    reduce<float>(k, n, d, so, grid);
                    reduce<double>(k, n, d, so, grid);
                    reduce<long long>(k, n, d, so, grid);
                }
                reduce<unsigned short>(k, n, 3, three, grid);
                reduce<float>(k, n, 3, three, grid);
                reduce<float>(k, n, 0, mixed, grid);
                reduce<double>(k, n, 0, mixed, grid);
            }
            for (int off : {0, 1, 3}) {
                scale_sgd<float>(n, off, off, grid);
                scale_sgd<double>(n, off, off, grid);
            }
            scale_sgd<float>(n, 1, 0, grid);  // g misaligned differently: scalar path
        }
    std::printf("fails=%d\n", fails);
    return fails != 0;
}
"""


@pytest.mark.subprocess
def test_kernel_index_arithmetic_on_the_host(tmp_path) -> None:
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    src = tree_source()
    # the float16 conversions are PTX assembly and the entry points need __global__
    # semantics: keep the templates the kernels instantiate, for the other dtypes
    half = src.index("template <>\nstruct nt_io<unsigned short>")
    src = src[:half] + src[src.index("// ---- ops;") :]
    src = src[: src.index('// ---- extern "C" entry points ----')]
    (tmp_path / "kernels.inc").write_text(src)
    (tmp_path / "harness.cpp").write_text(_HOST_HARNESS)
    exe = tmp_path / "harness"
    base = [cxx, "-std=c++17", "-O1", "-o", str(exe), str(tmp_path / "harness.cpp")]
    checked = ["-fsanitize=alignment,address,undefined", "-fno-sanitize-recover=all"]
    built = subprocess.run(base + checked, capture_output=True, text=True, timeout=120)
    if built.returncode != 0:  # no sanitizer runtime here: results and guards still count
        subprocess.run(base, check=True, capture_output=True, text=True, timeout=120)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "fails=0" in run.stdout, run.stdout + run.stderr


# ---- wiring on the fake CuPy ----
# These run the module loader and wrappers unmodified on tests/fakecupy: they check what
# NVRTC and CuPy are asked to do (options, architecture, cache files, pointers), never
# results on a GPU, and do not count as GPU verification.


def test_nvrtc_target_chooses_a_cubin_or_ptx_for_a_newer_gpu() -> None:
    archs = (75, 80, 86, 89, 90, 100, 120)
    assert ck.nvrtc_target(90, archs) == ("sm_90", "cubin")
    assert ck.nvrtc_target(130, archs) == ("compute_120", "ptx")  # the driver compiles it
    assert ck.nvrtc_target(87, archs) == ("compute_86", "ptx")
    with pytest.raises(BackendUnavailable, match="compute capability 70"):
        ck.nvrtc_target(70, archs)


@pytest.fixture
def nvrtc_calls(fake_cupy, monkeypatch) -> list[list[str]]:
    """The options of every NVRTC compilation, with the run-time compiled path forced."""
    import cupy

    calls: list[list[str]] = []
    real = cupy.cuda.nvrtc.compileProgram

    def spy(prog, options):
        calls.append(list(options))
        return real(prog, options)

    monkeypatch.setattr(cupy.cuda.nvrtc, "compileProgram", spy)
    monkeypatch.setattr(ck, "_use_fatbin", False)
    return calls


def _cache_files() -> list[Path]:
    d = ck.cache_dir()
    return sorted(d.iterdir()) if d.is_dir() else []


def _forget_modules(monkeypatch) -> None:
    """What a new process knows: no loaded modules (the cache directory stays)."""
    for cache in ("_modules", "_origin", "_target", "_functions"):
        monkeypatch.setattr(ck, cache, {})


def test_source_fallback_calls_nvrtc_itself_keeping_subnormals(fake_cupy, nvrtc_calls) -> None:
    import cupy as cp

    tiny = np.float32(2.0**-140)  # a float32 subnormal
    x = cp.asarray(np.full(1000, tiny, np.float32))
    ck.scale(x, 2.0)
    assert ck.origin(0) == "source" and ck.target(0) == "sm_90"
    (opts,) = nvrtc_calls
    assert set(ck.NVRTC_OPTIONS) <= set(opts)
    assert "--ftz=false" in opts and "--fmad=false" in opts
    assert "--gpu-architecture=sm_90" in opts
    assert not any("ftz=true" in o or "fast_math" in o for o in opts)
    launch = fake_cupy.launches[-1]
    assert launch.origin == "path" and not launch.ftz  # a cubin loaded by path
    assert [p.suffix for p in _cache_files()] == [".cubin"]  # and no temporary file left
    assert not fake_cupy.programs  # the NVRTC program was destroyed
    np.testing.assert_array_equal(x.get(), np.full(1000, tiny * 2, np.float32))


def test_compiled_modules_are_cached_by_source_options_and_nvrtc(
    fake_cupy, nvrtc_calls, monkeypatch
) -> None:
    import cupy as cp

    ck.module(0)
    ck.module(1)  # another GPU of the same architecture: the same file
    assert len(nvrtc_calls) == 1
    _forget_modules(monkeypatch)
    ck.module(0)
    assert len(nvrtc_calls) == 1 and ck.origin(0) == "source"
    # another NVRTC version compiles again, into another file
    monkeypatch.setattr(cp.cuda.nvrtc, "getVersion", lambda: (13, 1))
    _forget_modules(monkeypatch)
    ck.module(0)
    assert len(nvrtc_calls) == 2 and len(_cache_files()) == 2
    # so does another source
    text = ck.source_text()
    monkeypatch.setattr(ck, "source_text", lambda: text + "\n// changed\n")
    _forget_modules(monkeypatch)
    ck.module(0)
    assert len(nvrtc_calls) == 3 and len(_cache_files()) == 3


def test_a_damaged_cache_file_is_compiled_again(fake_cupy, nvrtc_calls, monkeypatch) -> None:
    ck.module(0)
    (path,) = _cache_files()
    good = path.read_bytes()
    path.write_bytes(b"not a cubin")
    _forget_modules(monkeypatch)
    ck.module(0)
    assert len(nvrtc_calls) == 2 and path.read_bytes() == good


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 1, "compute_capability": "130"}], indirect=True)
def test_a_gpu_newer_than_nvrtc_gets_ptx_and_a_warning(fake_cupy, nvrtc_calls) -> None:
    import cupy as cp

    newest = max(cp.cuda.nvrtc.getSupportedArchs())
    with pytest.warns(RuntimeWarning, match=f"compute_{newest}"):
        ck.module(0)
    assert ck.target(0) == f"compute_{newest}"
    assert f"--gpu-architecture=compute_{newest}" in nvrtc_calls[0]
    assert "--ftz=false" in nvrtc_calls[0]
    assert [p.suffix for p in _cache_files()] == [".ptx"]
    x = cp.asarray(np.ones(8, np.float32))
    ck.scale(x, 3.0)
    assert not fake_cupy.launches[-1].ftz
    np.testing.assert_array_equal(x.get(), np.full(8, 3, np.float32))


@pytest.mark.parametrize("fake_cupy", [{"n_gpus": 1, "compute_capability": "70"}], indirect=True)
def test_a_gpu_older_than_nvrtc_without_a_fatbin_is_unavailable(fake_cupy, nvrtc_calls) -> None:
    with pytest.raises(BackendUnavailable, match="compute capability 70"):
        ck.module(0)
    assert not nvrtc_calls and ck.origin(0) is None


def test_compile_errors_carry_the_nvrtc_log(fake_cupy, nvrtc_calls, monkeypatch) -> None:
    text = ck.source_text()
    monkeypatch.setattr(ck, "source_text", lambda: "#include <cuda_fp16.h>\n" + text)
    with pytest.raises(BackendUnavailable, match="cuda_fp16.h"):
        ck.module(0)
    assert not fake_cupy.programs and not _cache_files()


def test_misaligned_views_launch_with_their_own_pointers(fake_cupy) -> None:
    # the kernel peels its head from the pointers themselves: the launch passes each
    # view's address (12 bytes past a 16-byte boundary, the same for all) and its count
    import cupy as cp

    n = 1001
    host = [np.arange(n + 8, dtype=np.float32) * (j + 1) for j in range(3)]
    bases = [cp.asarray(h) for h in host]
    views = [b[3 : 3 + n] for b in bases]
    ck.reduce_n(views[0], views, "sum")
    launch = fake_cupy.launches[-1]
    assert launch.name == "nt_reduce_n_sum_f32"
    assert launch.args[0] == bases[0].data.ptr + 12
    assert tuple(launch.args[1][:3]) == tuple(b.data.ptr + 12 for b in bases)
    assert launch.args[2] == 3 and launch.args[3] == n
    assert launch.grid[0] * launch.block[0] * 4 >= n
    np.testing.assert_array_equal(views[0].get(), reference("sum", [h[3 : 3 + n] for h in host]))


# ---- on a GPU ----


def sources(dtype: type, op: str, k: int, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, n, dtype=dtype) for _ in range(k)]
    if op == "prod":
        return [rng.uniform(0.5, 2.0, n).astype(dtype) for _ in range(k)]
    return [rng.standard_normal(n).astype(dtype) for _ in range(k)]


def assert_bitwise(got: np.ndarray, want: np.ndarray, what: object = "") -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype, what)
    if got.dtype.kind == "f":
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=str(what))
        bits = np.dtype(f"u{got.dtype.itemsize}")
        got, want = got[~np.isnan(got)].view(bits), want[~np.isnan(want)].view(bits)
    np.testing.assert_array_equal(got, want, err_msg=str(what))


@pytest.fixture
def cp():
    import cupy

    return cupy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ck.OPS)
def test_reduce_n_matches_numpy(cp, op: str, dtype: type) -> None:
    for k in range(1, ck.MAX_SOURCES + 1):
        for n in (0, 1, 7, 8, 1023, 4099, 300_001):
            host = sources(dtype, op, k, n, seed=k)
            dst = cp.empty(n, dtype)
            ck.reduce_n(dst, [cp.asarray(h) for h in host], op)
            assert_bitwise(cp.asnumpy(dst), reference(op, host))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_aliasing_misalignment_and_sum_into(cp, dtype: type) -> None:
    n = 4099
    host = sources(dtype, "sum", 4, n + 1)
    dev = [cp.asarray(h) for h in host]
    # dst is a source
    ck.reduce_n(dev[2], dev, "sum")
    assert_bitwise(cp.asnumpy(dev[2]), reference("sum", host))
    # one-element offsets defeat 16-byte alignment: the scalar path
    dev = [cp.asarray(h) for h in host]
    views = [d[1:] for d in dev[:3]]
    ck.reduce_n(views[0], views, "sum")
    assert_bitwise(cp.asnumpy(views[0]), reference("sum", [h[1:] for h in host[:3]]))
    a, b = cp.asarray(host[0]), cp.asarray(host[1])
    ck.sum_into(a, b, cp.cuda.Stream())  # an explicit stream
    cp.cuda.Device().synchronize()
    assert_bitwise(cp.asnumpy(a), reference("sum", host[:2]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_scale_and_sgd(cp, dtype: type) -> None:
    wide = np.float32 if dtype == np.float16 else dtype
    for n in (1, 1023, 300_001):
        w, g, v = sources(dtype, "sum", 3, n)
        x = cp.asarray(w)
        ck.scale(x, 1 / 3)
        assert_bitwise(cp.asnumpy(x), (w.astype(wide) * wide(1 / 3)).astype(dtype))
        dw, dg, dv = cp.asarray(w), cp.asarray(g), cp.asarray(v)
        ck.sgd_update(dw, dg, dv, 0.05, 0.9, 5e-4)
        wf, gf, vf = (a.astype(wide) for a in (w, g, v))
        gf = gf + wide(5e-4) * wf
        vf = wide(0.9) * vf + wide(0.05) * gf
        wf = wf - vf
        for got, want in ((dw, wf), (dg, gf), (dv, vf)):
            assert_bitwise(cp.asnumpy(got), want.astype(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_scaled_sum(cp, dtype: type) -> None:
    wide = np.float32 if dtype == np.float16 else dtype
    for k in (1, 2, 5, 8):
        for n in (1, 1023, 300_001):
            host = sources(dtype, "sum", k, n, seed=k)
            dst = cp.empty(n, dtype)
            ck.reduce_n(dst, [cp.asarray(h) for h in host], alpha=1 / 3)
            # the sum in the compute type, times alpha rounded to it, one final rounding
            acc = host[0].astype(wide)
            for h in host[1:]:
                acc = acc + h.astype(wide)
            assert_bitwise(cp.asnumpy(dst), (acc * wide(1 / 3)).astype(dtype))


@pytest.mark.gpu
def test_copy_and_bad_arguments(cp) -> None:
    src = cp.arange(1001, dtype=cp.float32)
    dst = cp.zeros_like(src)
    ck.copy(dst, src)
    np.testing.assert_array_equal(cp.asnumpy(dst), np.arange(1001, dtype=np.float32))
    with pytest.raises(TypeError, match="cupy.ndarray"):
        ck.reduce_n(dst, [np.zeros(1001, np.float32)])
    with pytest.raises(TypeError, match="accepted"):
        ck.scale(cp.zeros(4, cp.int32), 2.0)
    with pytest.raises(ValueError, match="1 to 8"):
        ck.reduce_n(dst, [src] * 9)
    with pytest.raises(ValueError, match="elements"):
        ck.sum_into(dst, src[:10])
    with pytest.raises(ValueError, match="one of"):
        ck.reduce_n(dst, [src], "mean")


# ---- on a GPU, both module origins, bitwise against the host kernels ----


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """A fresh cache directory for the run-time compiled module, for this module's tests:
    the first source test really calls NVRTC, later ones load the cached file."""
    d = tmp_path_factory.mktemp("kernel-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ck.CACHE_ENV, str(d))
        yield d


@pytest.fixture(params=["default", "source"])
def kernel_origin(request, monkeypatch, kernel_cache, cp) -> str:
    """Run a test on the module :func:`module` loads by default (the fatbin where it is
    installed) and on the source compiled at run time; the loaded modules live in fresh
    caches that are restored afterwards, so neither choice leaks into other tests."""
    for cache in ("_modules", "_origin", "_target", "_functions"):
        monkeypatch.setattr(ck, cache, {})
    monkeypatch.setattr(ck, "_use_fatbin", request.param == "default")
    dev = cp.cuda.Device().id
    ck.module(dev)
    installed = ck.lib_file(ck.FATBIN) is not None
    want = "fatbin" if request.param == "default" and installed else "source"
    # an installed fatbin that does not load on this GPU is a build problem: say so
    assert ck.origin(dev) == want, (ck.origin(dev), want)
    if want == "source":
        assert list(kernel_cache.iterdir()), "the compiled module is cached by path"
    return want


# exponent ranges that reach well into each dtype's subnormals (and some normals)
_TINY = {np.float16: (-26, -10), np.float32: (-151, -118), np.float64: (-1076, -1015)}


def mixed_sources(dtype: type, op: str, k: int, n: int, seed: int) -> list[np.ndarray]:
    """k arrays: for floats a mix of ordinary values and subnormal ones (whose sums,
    products, maxima and scalings are subnormal too); integers over their full range."""
    host = sources(dtype, op, k, n, seed)
    if np.dtype(dtype).kind != "f":
        return host
    rng = np.random.default_rng([seed, 7])
    lo, hi = _TINY[dtype]
    out = []
    for h in host:
        tiny = np.ldexp(rng.uniform(-2, 2, n), rng.integers(lo, hi, n)).astype(dtype)
        out.append(np.where(rng.random(n) < 0.5, tiny, h).astype(dtype))
    return out


GUARD = 16  # elements of guard on each side of a destination (>= 16 bytes for every dtype)


def guarded_dst(cp, n: int, off: int, dtype: type, fill: np.ndarray | None = None):
    """(buffer, view): a destination of n elements (holding ``fill`` if given) at element
    offset ``off`` from a 16-byte boundary, inside a buffer whose other elements hold a
    sentinel."""
    host = np.full(n + 2 * GUARD + 8, 77, dtype)
    if fill is not None:
        host[GUARD + off : GUARD + off + n] = fill
    base = cp.asarray(host)
    return base, base[GUARD + off : GUARD + off + n]


def assert_guards(cp, base, n: int, off: int) -> None:
    b = cp.asnumpy(base)
    keep = np.ones(b.size, bool)
    keep[GUARD + off : GUARD + off + n] = False
    assert np.all(b[keep] == 77), "a kernel wrote outside its destination"


# (dst offset, source offsets) in elements: aligned; one shared misalignment (a scalar
# head, then vectors); another; sources misaligned differently from dst (scalar path)
OFFSETS = [
    (0, (0, 0, 0, 0, 0, 0, 0, 0)),
    (1, (1,) * 8),
    (3, (3,) * 8),
    (0, (1, 0, 2, 3, 1, 0, 2, 3)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reductions_bitwise_against_the_host_kernels(cp, kernel_origin, dtype) -> None:
    from nccltree import _native as nat

    for op in ck.OPS:
        for k in (1, 2, 3, 8):
            for n in (1, 5, 17, 4099, 65_537):
                host = mixed_sources(dtype, op, k, n + 8, seed=k * 1000 + n)
                dev = [cp.asarray(h) for h in host]
                for doff, soffs in OFFSETS:
                    views = [h[o : o + n] for h, o in zip(host, soffs)]
                    want = nat.reduce_n(np.empty(n, dtype), views, op)
                    base, dst = guarded_dst(cp, n, doff, dtype)
                    ck.reduce_n(dst, [d[o : o + n] for d, o in zip(dev, soffs)], op)
                    what = (kernel_origin, op, k, n, doff, soffs)
                    assert_bitwise(cp.asnumpy(dst), want, what)
                    assert_guards(cp, base, n, doff)
                # dst is one of the sources, all sharing a misalignment
                views = [d[1 : 1 + n] for d in dev]
                ck.reduce_n(views[-1], views, op)
                want = nat.reduce_n(np.empty(n, dtype), [h[1 : 1 + n] for h in host], op)
                assert_bitwise(cp.asnumpy(views[-1]), want)
        if op == "sum":
            for doff, soffs in OFFSETS:
                host = mixed_sources(dtype, op, 2, 4099 + 8, seed=doff)
                a, b = (h[o : o + 4099] for h, o in zip(host, soffs))
                base, dst = guarded_dst(cp, 4099, doff, dtype, a)
                ck.sum_into(dst, cp.asarray(host[1])[soffs[1] : soffs[1] + 4099])
                assert_bitwise(cp.asnumpy(dst), nat.sum_into(a.copy(), b))
                assert_guards(cp, base, 4099, doff)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
def test_float_kernels_bitwise_against_the_host_kernels(cp, kernel_origin, dtype) -> None:
    from nccltree import _native as nat

    for n in (1, 7, 4099, 65_537):
        for doff, soffs in OFFSETS:
            w, g, v = (
                h[o : o + n] for h, o in zip(mixed_sources(dtype, "sum", 3, n + 8, n), soffs)
            )
            # scale
            base, x = guarded_dst(cp, n, doff, dtype, w)
            ck.scale(x, 1 / 3)
            assert_bitwise(cp.asnumpy(x), nat.scale(w.copy(), 1 / 3))
            assert_guards(cp, base, n, doff)
            # scaled sum (a mean in one pass), sources misaligned like the offsets say
            srcs = mixed_sources(dtype, "sum", 5, n + 8, n + 1)
            views = [h[o : o + n] for h, o in zip(srcs, soffs)]
            base, dst = guarded_dst(cp, n, doff, dtype)
            ck.reduce_n(dst, [cp.asarray(h)[o : o + n] for h, o in zip(srcs, soffs)], alpha=0.2)
            want = nat.reduce_n(np.empty(n, dtype), views, "sum", alpha=0.2)
            assert_bitwise(cp.asnumpy(dst), want)
            assert_guards(cp, base, n, doff)
            # sgd: w at doff, g and v at their own offsets
            bw, dw = guarded_dst(cp, n, doff, dtype, w)
            bg, dg = guarded_dst(cp, n, soffs[1], dtype, g)
            bv, dv = guarded_dst(cp, n, soffs[2], dtype, v)
            ck.sgd_update(dw, dg, dv, 0.05, 0.9, 5e-4)
            hw, hg, hv = w.copy(), g.copy(), v.copy()
            nat.sgd_update(hw, hg, hv, 0.05, 0.9, 5e-4)
            for got, want in ((dw, hw), (dg, hg), (dv, hv)):
                assert_bitwise(cp.asnumpy(got), want)
            for b, o in ((bw, doff), (bg, soffs[1]), (bv, soffs[2])):
                assert_guards(cp, b, n, o)


@pytest.mark.gpu
def test_float32_subnormals_are_kept(cp, kernel_origin) -> None:
    # results that flush-to-zero arithmetic would turn into zeros: a subnormal sum, the
    # maximum of a subnormal and zero, a subnormal scaled, a subnormal SGD step
    t = np.float32(2.0**-126)  # the smallest normal float32
    a = np.array([1.5 * t, 2.0**-149, 3 * 2.0**-140, 2.0**-130] * 64, np.float32)
    b = np.array([-1.25 * t, 0.0, 2.0**-140, 0.0] * 64, np.float32)
    want = a + b
    assert np.all(want != 0) and np.all(np.abs(want) < t)  # the check has teeth
    dst = cp.empty_like(cp.asarray(a))
    ck.reduce_n(dst, [cp.asarray(a), cp.asarray(b)], "sum")
    assert_bitwise(cp.asnumpy(dst), want)
    # the subnormal first: a flushing comparison would find it not above 0 and pick 0
    ck.reduce_n(dst, [cp.asarray(np.abs(a)), cp.zeros(a.size, cp.float32)], "max")
    assert_bitwise(cp.asnumpy(dst), np.abs(a))
    x = cp.asarray(a)
    ck.scale(x, 2.0)
    assert_bitwise(cp.asnumpy(x), a * np.float32(2.0))
    w, g, v = cp.asarray(a), cp.asarray(b), cp.zeros(a.size, cp.float32)
    ck.sgd_update(w, g, v, 1.0, 0.0, 0.0)  # v = g, w = w - g
    assert_bitwise(cp.asnumpy(w), a - b)
    assert_bitwise(cp.asnumpy(v), b)


@pytest.mark.gpu
def test_runtime_compiled_module_targets_this_gpu(cp, kernel_origin) -> None:
    dev = cp.cuda.Device().id
    if kernel_origin != "source":
        assert ck.target(dev) is None
        return
    cc = int(cp.cuda.Device(dev).compute_capability)
    archs = cp.cuda.nvrtc.getSupportedArchs()
    want = f"sm_{cc}" if cc in archs else f"compute_{max(a for a in archs if a < cc)}"
    assert ck.target(dev) == want
