"""Small native libraries compiled on the user's machine with the system's C++ compiler (torch-free).

Two parts of ``nas`` need code that PyTorch does not ship: oneDNN's sgemm as an AOT package's product
(:mod:`nas.export.sgemm`) and the fused PathNorm of the Multi-Path sublayers (:mod:`nas.model.fused`). Each is a
short C++ source compiled once per machine (1-2 s: no ATen headers) into a cache folder, keyed by a hash
of the source, the flags, the compiler and what the caller adds (torch's version, the CPU's flags), so that an
upgrade or another CPU never loads a stale library.

A build writes into a temporary folder beside its target and moves the library into place with ``os.replace``: a
kill leaves no half-written library under the name, and concurrent processes (Ray's trials) may build the same
library at once. A missing compiler or a failed build is a logged warning naming the command and the compiler's
message, and the caller keeps its portable code path: nothing here raises.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["build_library", "compiler", "cpu_flags"]


def compiler() -> str | None:
    """The C++ compiler (``$CXX``, else ``g++``) as an absolute path; None where there is none or not on Linux."""
    if sys.platform != "linux":
        return None
    return shutil.which(os.environ.get("CXX", "g++"))


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), part of the key of a library built with ``-march=native``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build_library(name: str, source: str, flags: list[str], cache_dir: str | Path, what: str,
                  key: str = "") -> Path | None:
    """Compile ``source`` (C++) into ``cache_dir/lib{name}_{hash}.so`` unless it is there; return its path.

    Args:
        name: the library's stem.
        source: the C++ source.
        flags: the compiler's flags besides ``-shared -fPIC`` (include folders, libraries, ``-O3``...); they are
            part of the key, with the source and the compiler's path.
        cache_dir: the folder the library is kept in (created when missing).
        what: what the caller loses without it, for the warning ("the AOT packages keep MKL's products").
        key: anything else the library depends on (torch's version, the CPU's flags for ``-march=native``); part
            of the key, not passed to the compiler.

    Returns:
        The library's path; None where no compiler is found, ``cache_dir`` cannot be written or the build fails (a
        logged warning with the command and the compiler's last 2,000 characters; nothing is left in ``cache_dir``
        but the folder).
    """
    cxx = compiler()
    if cxx is None:
        log.warning("no C++ compiler for %s (Linux with $CXX or g++ on the PATH); %s", name, what)
        return None
    digest = hashlib.sha256("\n".join([source, cxx, key, *flags]).encode()).hexdigest()[:16]
    lib = Path(cache_dir, f"lib{name}_{digest}.so")
    if lib.exists():
        return lib
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent, prefix=".build.") as work:
            src, out = Path(work, f"{name}.cpp"), Path(work, lib.name)
            src.write_text(source)
            cmd = [cxx, "-shared", "-fPIC", "-std=c++17", str(src), "-o", str(out), *flags]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("could not build %s (%s); %s:\n%s", name, " ".join(cmd), what, done.stderr[-2000:])
                return None
            os.replace(out, lib)  # a kill leaves no half-written library under the name
    except OSError as e:  # a cache folder that cannot be written, a compiler that cannot be run
        log.warning("could not build %s in %s (%s); %s", name, lib.parent, e, what)
        return None
    return lib
