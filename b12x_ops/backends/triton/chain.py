"""One C call that launches an eager call's kernels (the host's cost of a call).

Through triton's launcher a launch costs a Python frame, triton's argument parsing (some 10-30
arguments a kernel) and ``cuLaunchKernelEx``. At one to a few tokens the GPU runs a GEMV call's two
or three kernels in 15-30 us, about what the host takes to issue them that way, so eager calls
there are paced by the host; on the blocked path (four kernels) the host's time before the first
kernel is what a call from an idle GPU waits (a call being captured into a CUDA graph takes the same
path, where it makes no difference). A *chain* is the call's launches written down once per handle
and plan as 64-bit words (``build``): each kernel's function handle, block, shared memory, PDL flag
and every kernel parameter, either fixed (the handle's and arena's addresses, the expert offset, the
limit) or one of the call's own values times a factor (x's, the ids', the weights' and out's
addresses, M, the strides, the dtype flags; on the blocked path also its grids and block count,
``SIZES``, which follow the token count but not linearly). A call then passes those values to
``launch``, one C function (built at prepare by triton's own C build, ``module``) that packs the
parameters and calls ``cuLaunchKernelEx`` for each kernel.

The parameters are exactly the ones triton's launcher passes: the compiled kernel's signature in
order, constexprs left out, then its two scratch pointers (null: a chain is only built for kernels
that need no scratch). ``build`` takes the argument lists from the backend's own code for the
launches (``_gemv_launches``, ``_blocked_launches``) with the call's values as ``Var`` placeholders,
so the two paths cannot disagree on an argument; ``pack`` (the same C walk without the driver) is
how the tests check the packed bytes against that code's arguments.

``B12X_OPS_TRITON_CHAIN=0`` turns chains off (every call through triton's launcher).
"""

from __future__ import annotations

import functools
import logging
import os
import struct

ENABLED = os.environ.get("B12X_OPS_TRITON_CHAIN", "1") != "0"
# the call's values, in the order ``launch`` takes them after the chain and the stream
VALUES = ("x", "ids", "w", "out", "m", "sx", "si0", "si1", "sw0", "sw1", "w_kind", "so", "x_fp16", "out_fp16")
# a blocked-path call's sizes, after VALUES: its block count, the four kernels' grids and GEMM1's rows of
# the accumulator a program zeroes (they follow the token count, but not linearly: the backend's
# ``_blocked_sizes`` computes them, once per token count)
SIZES = ("nb", "g_pro", "g1", "g2", "zrows", "g_fin")
MAX_PARAMS = 48  # (per kernel; the C side's buffers)

_SRC = r"""
#include "cuda.h"
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAXV 32
#define MAXP @MAX_PARAMS@

typedef CUresult (*launch_t)(const CUlaunchConfig *, CUfunction, void **, void **);
typedef CUresult (*ctx_t)(CUcontext *);
typedef CUresult (*errstr_t)(CUresult, const char **);
static launch_t p_launch = NULL;
static ctx_t p_ctx = NULL;
static errstr_t p_errstr = NULL;

static int load_driver(void) {
  if (p_launch) return 0;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    PyErr_SetString(PyExc_RuntimeError, "b12x_ops chain: libcuda.so.1 could not be opened");
    return -1;
  }
  p_ctx = (ctx_t)dlsym(h, "cuCtxGetCurrent");
  p_errstr = (errstr_t)dlsym(h, "cuGetErrorString");
  p_launch = (launch_t)dlsym(h, "cuLaunchKernelEx");
  if (!p_ctx || !p_errstr || !p_launch) {
    p_launch = NULL;
    PyErr_SetString(PyExc_RuntimeError, "b12x_ops chain: libcuda.so.1 lacks cuLaunchKernelEx");
    return -1;
  }
  return 0;
}

/* A chain: int64 words. [0] kernels; per kernel: function, threads, shared bytes, pdl, grid x's
   source and value, grid y, grid z, parameters; per parameter: size in bytes (1, 2, 4 or 8),
   source, value. A source below 0: the value itself; else the call's value of that index times the
   value. Returns the next kernel's word, or -1 (with a Python error) where the chain is malformed. */
static Py_ssize_t kernel_at(const int64_t *b, Py_ssize_t nw, Py_ssize_t at, const int64_t *vals, Py_ssize_t nv,
                            uint64_t *grid_x, uint64_t *store, int *sizes, int *np) {
  if (at + 9 > nw) goto bad;
  int64_t gsrc = b[at + 4], gval = b[at + 5];
  if (gsrc >= nv) goto bad;
  *grid_x = (uint64_t)(gsrc < 0 ? gval : vals[gsrc] * gval);
  int64_t n = b[at + 8];
  if (n < 0 || n > MAXP || at + 9 + 3 * n > nw) goto bad;
  for (int64_t i = 0; i < n; i++) {
    const int64_t *p = b + at + 9 + 3 * i;
    if (p[1] >= nv || !(p[0] == 1 || p[0] == 2 || p[0] == 4 || p[0] == 8)) goto bad;
    store[i] = (uint64_t)(p[1] < 0 ? p[2] : vals[p[1]] * p[2]);
    sizes[i] = (int)p[0];
  }
  *np = (int)n;
  return at + 9 + 3 * n;
bad:
  PyErr_SetString(PyExc_ValueError, "b12x_ops chain: malformed chain");
  return -1;
}

/* A call's chain (args[0]) as words and its values (args[first:]) as int64s; -1 with a Python error. */
static int call_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t first, const int64_t **b, Py_ssize_t *nw,
                     int64_t *vals, Py_ssize_t *nv) {
  if (nargs < first) {
    PyErr_SetString(PyExc_TypeError, "b12x_ops chain: launch(chain, stream, *values) or pack(chain, *values)");
    return -1;
  }
  PyObject *blob = args[0];
  if (!PyBytes_Check(blob) || PyBytes_GET_SIZE(blob) % 8 != 0 || PyBytes_GET_SIZE(blob) < 8) {
    PyErr_SetString(PyExc_TypeError, "b12x_ops chain: expected the chain's bytes");
    return -1;
  }
  *b = (const int64_t *)PyBytes_AS_STRING(blob);
  *nw = PyBytes_GET_SIZE(blob) / 8;
  *nv = nargs - first;
  if (*nv > MAXV) {
    PyErr_SetString(PyExc_ValueError, "b12x_ops chain: too many values");
    return -1;
  }
  for (Py_ssize_t i = 0; i < *nv; i++) {
    vals[i] = PyLong_AsLongLong(args[first + i]);
    if (vals[i] == -1 && PyErr_Occurred()) return -1;
  }
  return 0;
}

/* launch(chain, stream, *values) -> bool: the chain's kernels launched on ``stream`` in order;
   False (nothing launched) where this thread has no current CUDA context. */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  const int64_t *b;
  Py_ssize_t nw, nv;
  int64_t vals[MAXV];
  if (call_args(args, nargs, 2, &b, &nw, vals, &nv) < 0) return NULL;
  unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
  if (PyErr_Occurred()) return NULL;
  if (load_driver() < 0) return NULL;
  CUcontext ctx = NULL;
  if (p_ctx(&ctx) != CUDA_SUCCESS || ctx == NULL) Py_RETURN_FALSE;
  Py_ssize_t at = 1;
  CUresult err = CUDA_SUCCESS;
  for (int64_t k = 0; k < b[0] && err == CUDA_SUCCESS; k++) {
    uint64_t store[MAXP], gx;
    void *params[MAXP];
    int sizes[MAXP], np;
    Py_ssize_t next = kernel_at(b, nw, at, vals, nv, &gx, store, sizes, &np);
    if (next < 0) return NULL;
    for (int i = 0; i < np; i++) params[i] = &store[i];  /* (little-endian: a narrow parameter's bytes lead) */
    CUlaunchAttribute attr[1];
    CUlaunchConfig cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.gridDimX = (unsigned)gx;
    cfg.gridDimY = (unsigned)b[at + 6];
    cfg.gridDimZ = (unsigned)b[at + 7];
    cfg.blockDimX = (unsigned)b[at + 1];
    cfg.blockDimY = 1;
    cfg.blockDimZ = 1;
    cfg.sharedMemBytes = (unsigned)b[at + 2];
    cfg.hStream = (CUstream)(uintptr_t)stream;
    cfg.attrs = attr;
    cfg.numAttrs = 0;
    if (b[at + 3]) {
      attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attr[0].value.programmaticStreamSerializationAllowed = 1;
      cfg.numAttrs = 1;
    }
    if (gx > 0 && cfg.gridDimY > 0 && cfg.gridDimZ > 0) {
      CUfunction fn = (CUfunction)(uintptr_t)b[at];
      Py_BEGIN_ALLOW_THREADS;
      err = p_launch(&cfg, fn, params, NULL);
      Py_END_ALLOW_THREADS;
    }
    at = next;
  }
  if (err != CUDA_SUCCESS) {
    const char *s = NULL;
    p_errstr(err, &s);
    PyErr_Format(PyExc_RuntimeError, "b12x_ops chain: cuLaunchKernelEx failed: %s", s ? s : "unknown error");
    return NULL;
  }
  Py_RETURN_TRUE;
}

/* pack(chain, *values) -> [(function, (gx, gy, gz), threads, shared, pdl, params)]: what launch
   would pass the driver, each kernel's parameters as their bytes in order (tests). */
static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  const int64_t *b;
  Py_ssize_t nw, nv;
  int64_t vals[MAXV];
  if (call_args(args, nargs, 1, &b, &nw, vals, &nv) < 0) return NULL;
  PyObject *out = PyList_New(0);
  if (!out) return NULL;
  Py_ssize_t at = 1;
  for (int64_t k = 0; k < b[0]; k++) {
    uint64_t store[MAXP], gx;
    int sizes[MAXP], np;
    Py_ssize_t next = kernel_at(b, nw, at, vals, nv, &gx, store, sizes, &np);
    if (next < 0) {
      Py_DECREF(out);
      return NULL;
    }
    char bytes[MAXP * 8];
    Py_ssize_t len = 0;
    for (int i = 0; i < np; i++) {
      memcpy(bytes + len, &store[i], sizes[i]);
      len += sizes[i];
    }
    PyObject *item = Py_BuildValue("(L(KLL)LLLy#)", (long long)b[at], (unsigned long long)gx, (long long)b[at + 6],
                                   (long long)b[at + 7], (long long)b[at + 1], (long long)b[at + 2],
                                   (long long)b[at + 3], bytes, len);
    if (!item || PyList_Append(out, item) < 0) {
      Py_XDECREF(item);
      Py_DECREF(out);
      return NULL;
    }
    Py_DECREF(item);
    at = next;
  }
  return out;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch(chain, stream, *values) -> bool"},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, "pack(chain, *values) -> list"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "b12x_ops_chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit_b12x_ops_chain(void) { return PyModule_Create(&moddef); }
"""

_log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def module():
    """The C module (``launch``, ``pack``), built once per source and machine by triton's C build
    (gcc and triton's own ``cuda.h``; cached on disk with triton's launchers), or None where it cannot
    be built (then every call goes through triton's launcher; the reason is logged once)."""
    try:
        from triton.backends.nvidia.driver import include_dirs
        from triton.runtime.build import compile_module_from_src

        src = _SRC.replace("@MAX_PARAMS@", str(MAX_PARAMS))
        return compile_module_from_src(src=src, name="b12x_ops_chain", include_dirs=list(include_dirs))
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the launcher path
        _log.warning("b12x_ops: the chain launcher could not be built (%s: %s); eager calls go through "
                     "triton's launcher", type(exc).__name__, exc)
        return None


def status() -> str:
    """How an eager call's kernels reach the driver (``b12x-ops info``)."""
    if not ENABLED:
        return "through triton's launcher, a launch at a time (B12X_OPS_TRITON_CHAIN=0)"
    return ("one C call launches the call's kernels (a chain, built at prepare; later calls of a token count "
            "go straight to it; B12X_OPS_TRITON_CHAIN=0 turns it off)")


class Var:
    """A call's own value (``(VALUES + SIZES)[i]``) times ``k``: what ``build`` puts in an argument list
    where a call passes its own x, ids, strides..."""

    __slots__ = ("i", "k")

    def __init__(self, i: int, k: int = 1):
        self.i, self.k = i, k

    def __mul__(self, n):
        if isinstance(n, int) and not isinstance(n, bool):
            return Var(self.i, self.k * n)
        return NotImplemented

    __rmul__ = __mul__

    def __repr__(self):
        return f"Var({(VALUES + SIZES)[self.i]}{'' if self.k == 1 else f' * {self.k}'})"


def placeholders() -> dict:
    """One ``Var`` for each of ``VALUES`` and ``SIZES``, by name."""
    return {name: Var(i) for i, name in enumerate(VALUES + SIZES)}


_INT_SIZES = {"i1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}


def _word(v, size: int | None = None) -> tuple[int, int]:
    """``(source, value)`` words of an argument: a fixed int, or a ``Var``."""
    if isinstance(v, Var):
        return v.i, v.k
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Unsupported(f"argument {v!r}")
    if size is not None and size < 8:  # (the C side copies a narrow parameter's low bytes)
        v &= (1 << (8 * size)) - 1
    return -1, v if v < (1 << 63) else v - (1 << 64)


class _Unsupported(Exception):
    pass


def kernel_words(ln, grid, args) -> list[int]:
    """One compiled launch's words (``launch``'s layout) for ``ln(grid, *args)``; raises
    ``_Unsupported`` where triton's launcher would do more than pass parameters (scratch buffers,
    clusters, cooperative launch, a parameter type not handled here)."""
    ck = ln.compiled
    md, src = getattr(ck, "metadata", None), getattr(ck, "src", None)
    if md is None or src is None:
        raise _Unsupported("not compiled")
    if (getattr(md, "num_ctas", 1) != 1 or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or getattr(md, "launch_cooperative_grid", False)
            or getattr(md, "tensordesc_meta", None)):
        raise _Unsupported("scratch, clusters or cooperative launch")
    sig = getattr(src, "signature", None)
    names = ln.fn.arg_names
    if not isinstance(sig, dict):
        raise _Unsupported("signature")
    full = tuple(args) + ln._tail
    if len(full) != len(names) or list(sig) != list(names):
        raise _Unsupported("signature")
    params = []
    for name, a in zip(names, full):
        ty = sig[name]
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            raise _Unsupported(f"parameter type {ty!r}")
        if ty.startswith("*"):
            params.append((8, *_word(a)))
        elif ty in _INT_SIZES:
            params.append((_INT_SIZES[ty], *_word(a, _INT_SIZES[ty])))
        elif ty == "fp32" and isinstance(a, float):
            params.append((4, -1, struct.unpack("<I", struct.pack("<f", a))[0]))
        else:
            raise _Unsupported(f"parameter {name}: {ty} = {a!r}")
    params += [(8, -1, 0), (8, -1, 0)]  # (triton's global and profile scratch pointers: none)
    if len(params) > MAX_PARAMS:
        raise _Unsupported("too many parameters")
    gx, gy, gz = grid
    if not (isinstance(gy, int) and isinstance(gz, int)):
        raise _Unsupported("grid")
    fn = getattr(ln, "_function", None)  # (the loaded kernel's handle, ``Launch`` keeps it once compiled)
    if not isinstance(fn, int) or not fn:
        raise _Unsupported("no function handle")
    words = [fn, 32 * int(md.num_warps), int(md.shared), int(bool(getattr(md, "launch_pdl", False))),
             *_word(gx), gy, gz, len(params)]
    for p in params:
        words += p
    return words


def build(launches) -> bytes | None:
    """A chain of ``launches`` (``(ln, grid, args)`` with ``Var`` placeholders), or None where one of
    them cannot be chained (not compiled yet, or more than parameters to pass)."""
    words = [len(launches)]
    try:
        for ln, grid, args in launches:
            words += kernel_words(ln, grid, args)
    except _Unsupported:
        return None
    return struct.pack(f"<{len(words)}q", *words)
