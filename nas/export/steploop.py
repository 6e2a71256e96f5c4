"""The compiled decoder's steps run back to back in C while nothing happens that the search must see (issue 41).

Why: at batch 1, beam 4 the Python around each package call (:func:`nas.model.decode.search`'s loop, the stepper,
wrapping the 16 outputs as Python tensors and freeing the previous step's) took about 30 of a step's 400 us on a
2-core Intel Xeon (one thread; ``benchmarks/bench_aot_step.py``'s ``rest``), much of it in caches that the step's
products had evicted. Most steps need none of it: no EOS ranks among a sentence's first ``k`` candidates, no
sentence reaches its length limit, and the next step's inputs are outputs of this one (the grown token history, the
rows the ``k`` best candidates continue, their scores, the key/value state).

How: :class:`StepLoop` loads the few-rows step package's model library itself (the ``.so`` inside the ``.pt2``,
copied once into the package cache) through AOTInductor's C ABI (``AOTInductorModelContainerCreateWithDevice``,
``AOTInductorModelContainerRun``), and :meth:`StepLoop.run` calls it up to ``budget`` times in a C loop (compiled
once per machine against ``aoti_torch/c/shim.h``: no ATen headers, about a second), feeding those outputs back
as inputs, and returns at the first step whose ``eos_any`` output is set, or after ``budget`` steps, with that
step's outputs and its token input. The search chooses ``budget`` so that the length limits, the banned tokens and
EOS's forcing (``min_len``) stay the same over those steps (:func:`nas.model.decode.search`), so the tokens are
those of one package call a step. Tensors cross between Python and C as AOTInductor's own ``AtenTensorHandle``
(``torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors`` and ``alloc_tensors_by_stealing_from_void_ptrs``).

Measured on that Xeon (``benchmarks/bench_aot_step.py``, 4 pairs of processes against the Python loop): the Python
left per step fell from 39-42 to 17-20 us, and a step took about 0.95x the time at beam 4 (fixed and free length)
and 0.94x greedy, the same tokens; the products paid back part of it in cache misses.

Without a C++ compiler, or where the library or the package's model fails to load, :func:`load` returns None (a
logged warning) and the stepper calls the package through ``aoti_load_package`` once a step, as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from torch._C import _aoti

from nas.export.sgemm import torch_flags
from nas.native import build_library

log = logging.getLogger(__name__)

__all__ = ["StepLoop", "load", "model_library"]

SOURCE = r"""
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <alloca.h>
#include <dlfcn.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// the few functions of CPython's C API used (the library is loaded with ctypes.PyDLL: called with the GIL held)
typedef struct _object PyObject;
extern "C" {
PyObject *PyList_New(ptrdiff_t);
int PyList_SetItem(PyObject *, ptrdiff_t, PyObject *);
PyObject *PyList_GetItem(PyObject *, ptrdiff_t);
ptrdiff_t PyList_Size(PyObject *);
void *PyCapsule_GetPointer(PyObject *, const char *);
PyObject *PyCapsule_New(void *, const char *, void (*)(PyObject *));
PyObject *Py_BuildValue(const char *, ...);
}

typedef int32_t (*create_fn)(void **, size_t, const char *, const char *);
typedef int32_t (*run_fn)(void *, AtenTensorHandle *, size_t, AtenTensorHandle *, size_t, void *, void *);
typedef int32_t (*delete_fn)(void *);
typedef int32_t (*count_fn)(void *, size_t *);

struct Loop {
  void *lib, *container;
  run_fn run;
  delete_fn del;
  size_t n_in, n_out;
};

extern "C" {
// The model library at path, loaded (RTLD_LOCAL) and one model container made of it; NULL where that fails.
void *nas_loop_open(const char *path, size_t *n_in, size_t *n_out) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) return nullptr;
  create_fn create = (create_fn)dlsym(lib, "AOTInductorModelContainerCreateWithDevice");
  run_fn run = (run_fn)dlsym(lib, "AOTInductorModelContainerRun");
  delete_fn del = (delete_fn)dlsym(lib, "AOTInductorModelContainerDelete");
  count_fn inputs = (count_fn)dlsym(lib, "AOTInductorModelContainerGetNumInputs");
  count_fn outputs = (count_fn)dlsym(lib, "AOTInductorModelContainerGetNumOutputs");
  void *container = nullptr;
  if (!create || !run || !del || !inputs || !outputs || create(&container, 1, "cpu", nullptr) ||
      inputs(container, n_in) || outputs(container, n_out)) {
    if (container && del) del(container);
    dlclose(lib);
    return nullptr;
  }
  Loop *loop = new Loop{lib, container, run, del, *n_in, *n_out};
  return loop;
}

void nas_loop_close(void *p) {
  Loop *loop = (Loop *)p;
  loop->del(loop->container);
  dlclose(loop->lib);
  delete loop;
}

// Up to budget steps from the inputs in_caps (a list of n_in capsules of AtenTensorHandle, stolen). feed: n_feed
// pairs (input index, output index): after a step, output feed[2i+1] becomes input feed[2i]. stop: the index of
// the bool output that ends the loop when set. Returns (error, steps, last, outputs): error 0 or the failing call's
// (then nothing else), the steps run, a capsule of the last step's input feed[0] and a list of capsules of its
// outputs (the caller steals both).
PyObject *nas_loop_run(void *p, PyObject *in_caps, const int64_t *feed, int64_t n_feed, int64_t stop,
                       int64_t budget) {
  Loop *loop = (Loop *)p;
  const size_t n_in = loop->n_in, n_out = loop->n_out;
  AtenTensorHandle *in = (AtenTensorHandle *)alloca(n_in * sizeof(AtenTensorHandle));
  AtenTensorHandle *call = (AtenTensorHandle *)alloca(n_in * sizeof(AtenTensorHandle));
  AtenTensorHandle *out = (AtenTensorHandle *)alloca(n_out * sizeof(AtenTensorHandle));
  if ((size_t)PyList_Size(in_caps) != n_in) return Py_BuildValue("(iiOO)", -1, 0, in_caps, in_caps);
  for (size_t i = 0; i < n_in; ++i) in[i] = (AtenTensorHandle)PyCapsule_GetPointer(PyList_GetItem(in_caps, i), nullptr);
  int32_t err = 0;
  int64_t steps = 0;
  for (;;) {
    for (size_t i = 0; i < n_in; ++i) {
      if ((err = aoti_torch_new_tensor_handle(in[i], &call[i]))) {
        for (size_t j = 0; j < i; ++j) aoti_torch_delete_tensor_object(call[j]);
        break;
      }
    }
    if (!err) err = loop->run(loop->container, call, n_in, out, n_out, nullptr, nullptr);  // call[] stolen
    if (err) {
      for (size_t i = 0; i < n_in; ++i) aoti_torch_delete_tensor_object(in[i]);
      return Py_BuildValue("(iiOO)", err, 0, in_caps, in_caps);
    }
    steps += 1;
    void *flag = nullptr;
    aoti_torch_get_data_ptr(out[stop], &flag);
    if (steps >= budget || *(const bool *)flag) break;
    for (int64_t f = 0; f < n_feed; ++f) {  // the outputs fed back replace those inputs
      aoti_torch_delete_tensor_object(in[feed[2 * f]]);
      in[feed[2 * f]] = out[feed[2 * f + 1]];
      out[feed[2 * f + 1]] = nullptr;
    }
    for (size_t i = 0; i < n_out; ++i)
      if (out[i]) aoti_torch_delete_tensor_object(out[i]);
  }
  for (size_t i = 0; i < n_in; ++i)
    if ((int64_t)i != feed[0]) aoti_torch_delete_tensor_object(in[i]);
  PyObject *outputs = PyList_New(n_out);
  for (size_t i = 0; i < n_out; ++i) PyList_SetItem(outputs, i, PyCapsule_New(out[i], nullptr, nullptr));
  return Py_BuildValue("(iLNN)", 0, (long long)steps, PyCapsule_New(in[feed[0]], nullptr, nullptr), outputs);
}
}
"""

_LIB: dict[str, ctypes.CDLL | None] = {}


def _library(cache_dir: Path) -> ctypes.CDLL | None:
    """The loop's library (built once per machine and torch version), or None where it cannot be built or loaded."""
    key = str(cache_dir)
    if key not in _LIB:
        what = "the compiled decoder calls its package once a step from Python"
        path = build_library("nas_steploop", SOURCE, torch_flags(["-ldl"]), cache_dir, what, key=torch.__version__)
        lib = None
        if path is not None:
            try:
                lib = ctypes.PyDLL(str(path), mode=os.RTLD_LOCAL | os.RTLD_NOW)  # calls hold the GIL
            except OSError as e:
                log.warning("could not load %s (%s); %s", path, e, what)
        if lib is not None:
            lib.nas_loop_open.restype = ctypes.c_void_p
            lib.nas_loop_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t),
                                          ctypes.POINTER(ctypes.c_size_t)]
            lib.nas_loop_close.argtypes = [ctypes.c_void_p]
            lib.nas_loop_run.restype = ctypes.py_object
            lib.nas_loop_run.argtypes = [ctypes.c_void_p, ctypes.py_object, ctypes.POINTER(ctypes.c_int64),
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        _LIB[key] = lib
    return _LIB[key]


def model_library(package: Path) -> Path:
    """The model library (``*.so``) of the AOT package ``package`` (a ``.pt2``), copied once beside it as
    ``<package stem>.so`` (written to a temporary name, then moved into place).

    Raises:
        ValueError: the package holds no model library, or more than one.
    """
    target = package.with_suffix(".so")
    if target.exists():
        return target
    with zipfile.ZipFile(package) as z:
        names = [n for n in z.namelist() if n.endswith(".so") and "/aotinductor/" in n]
        if len(names) != 1:
            raise ValueError(f"{package}: expected one model library (*.so) in the package, found {names}")
        fd, tmp = tempfile.mkstemp(dir=package.parent, prefix=target.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f, z.open(names[0]) as src:
                shutil.copyfileobj(src, f)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return target


class StepLoop:
    """An AOT step package's model, called from C up to ``budget`` times a call (module docstring).

    Args:
        lib: the loop's library (:func:`load`). library: the package's model library (:func:`model_library`).
        feed: (input index, output index) pairs: after a step that does not stop the loop, the output becomes the
            input. The first pair's input is also returned (the last step's). stop: the index of the ``[]`` bool
            output that ends the loop.

    Raises:
        RuntimeError: the model library cannot be loaded (``nas_loop_open``).
    """

    def __init__(self, lib: ctypes.CDLL, library: Path, feed: list[tuple[int, int]], stop: int) -> None:
        n_in, n_out = ctypes.c_size_t(), ctypes.c_size_t()
        self._lib = lib
        self._loop = lib.nas_loop_open(str(library).encode(), ctypes.byref(n_in), ctypes.byref(n_out))
        if not self._loop:
            raise RuntimeError(f"could not load the AOT model library {library}")
        self.n_in, self.n_out = n_in.value, n_out.value
        flat = [i for pair in feed for i in pair]
        self._feed = (ctypes.c_int64 * len(flat))(*flat)
        self._n_feed, self._stop = len(feed), stop

    def run(self, inputs: list[torch.Tensor], budget: int) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
        """Run the package up to ``budget`` (>= 1) times from ``inputs`` (module docstring): returns the steps
        run, the last step's input ``feed[0][0]`` and its outputs.

        Raises:
            ValueError: not as many inputs as the package takes.
            RuntimeError: a package call failed (AOTInductor's error code; its message is on stderr).
        """
        if len(inputs) != self.n_in:
            raise ValueError(f"{len(inputs)} inputs: the package takes {self.n_in}")
        err, steps, last, outputs = self._lib.nas_loop_run(
            self._loop, _aoti.unsafe_alloc_void_ptrs_from_tensors(inputs), self._feed, self._n_feed, self._stop,
            budget)
        if err:
            raise RuntimeError(f"the AOT step package failed (error {err}; AOTInductor's message above)")
        return (steps, _aoti.alloc_tensor_by_stealing_from_void_ptr(last),
                _aoti.alloc_tensors_by_stealing_from_void_ptrs(outputs))

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One package call: ``boxed_run``'s signature."""
        return self.run(inputs, 1)[2]

    def __del__(self) -> None:
        if getattr(self, "_loop", None):
            self._lib.nas_loop_close(self._loop)
            self._loop = None


def load(cache_dir: str | Path) -> ctypes.CDLL | None:
    """The loop's library, built into ``cache_dir`` on first use; None where there is no compiler or it fails (a
    logged warning: the stepper then calls its package from Python once a step)."""
    return _library(Path(cache_dir))
