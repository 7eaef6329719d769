"""Build tokload's compiled modules.

One module list, one Extension per ``tokload/_*.pyx`` with the C headers of
``csrc/tokload`` as dependencies (a header edit rebuilds every module).

Environment switches:
    TOKLOAD_DEBUG=1       -O0 -g, asserts on, Cython bounds and wraparound checks, and
                          the I/O engine's fault injection (tokload._io._set_fault_injection).
    TOKLOAD_SANITIZE=...  with TOKLOAD_DEBUG: -fsanitize=... (e.g. "address,undefined");
                          run Python with LD_PRELOAD="$(gcc -print-file-name=libasan.so)
                          $(gcc -print-file-name=libstdc++.so)" (without libstdc++, ASan
                          aborts at torch's first C++ exception) and ASAN_OPTIONS=detect_leaks=0.
    TOKLOAD_ANNOTATE=1    write Cython's HTML annotation next to each .pyx.
    TOKLOAD_NATIVE=1      -march=native (a local build only: never for a wheel).
"""

import os
import sys
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

MODULES = [
    "_permute",
    "_slots",
    "_pack",
    "_hostmem",
    "_remote",
    "_io",
    "_rows",
    "_tables",
    "_docindex",
    "_megatron",
    "_metaids",
    "_meta",
]

DEBUG = os.environ.get("TOKLOAD_DEBUG") == "1"
SANITIZE = os.environ.get("TOKLOAD_SANITIZE", "")
ANNOTATE = os.environ.get("TOKLOAD_ANNOTATE") == "1"
NATIVE = os.environ.get("TOKLOAD_NATIVE") == "1"

HEADERS = sorted(glob(os.path.join("csrc", "tokload", "*.h")))

compile_args = ["-std=c11", "-Wall", "-Wno-unused-function", "-fno-strict-aliasing", "-pthread"]
link_args: list[str] = ["-pthread"]
macros: list[tuple[str, str | None]] = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if DEBUG:
    compile_args += ["-O0", "-g", "-UNDEBUG"]
    macros.append(("TL_FAULT_INJECTION", "1"))
    if SANITIZE:
        compile_args += [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer"]
        link_args += [f"-fsanitize={SANITIZE}"]
else:
    compile_args += ["-O3"]
    macros.append(("NDEBUG", None))
if NATIVE:
    compile_args.append("-march=native")
if sys.platform == "darwin":
    compile_args.remove("-std=c11")

directives = {
    "language_level": 3,
    "embedsignature": True,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
}

extensions = [
    Extension(
        f"tokload.{name}",
        [os.path.join("tokload", f"{name}.pyx")],
        include_dirs=["csrc", numpy.get_include()],
        depends=[*HEADERS, *glob(os.path.join("tokload", "*.pxd"))],
        define_macros=macros,
        extra_compile_args=compile_args,
        extra_link_args=link_args,
    )
    for name in MODULES
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        annotate=ANNOTATE,
        # Rebuild when a header or .pxd changes; keep builds of debug and
        # release flavours from reusing each other's generated C.
        force=DEBUG,
    ),
)
