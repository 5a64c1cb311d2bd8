"""Builds the native CPU extension `bertfast._C` from csrc/ (torch C++ extension + pybind11).

Set BERTFAST_NO_EXT=1 to skip it (the torch and triton backends need no native code), BERTFAST_DEBUG_INFO=0 to
compile it without debug info (a wheel's: .ci/wheel_check.sh).
A failed compile fails the install: no half-built module is ever shipped.

The kernels are compiled for the baseline ISA of the target (x86-64, aarch64); their AVX-512 variants are
compiled per function (`__attribute__((target(...)))`, see csrc/cpu/isa.h) and chosen at run time from
the CPU's features, so one build runs on any x86-64 and on aarch64. Only csrc/bindings.cpp includes the
full torch headers (csrc/bindings/ includes only the ATen ones it uses), which keeps a full build to ~1.5 min
on 2 cores (~2 min without ninja).
"""

import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
if sources and os.environ.get("BERTFAST_NO_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # -fno-math-errno and -fno-trapping-math (as torch itself builds) let loops with sqrt and branch-free
    # selects (exp, erf-GELU) vectorize; no -ffast-math: NaN/Inf must propagate.
    compile_args = ["-O3", "-fopenmp", "-std=c++20", "-fno-math-errno", "-fno-trapping-math",
                    "-Wno-unused-function"]
    if os.environ.get("BERTFAST_DEBUG_INFO") == "0":
        # Overrides Python's -g: debug info is 29 of the extension's 31 MB and a quarter of its compile time.
        compile_args.append("-g0")
    ext_modules = [
        CppExtension(
            "bertfast._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=compile_args,
            extra_link_args=["-fopenmp"],
            depends=sorted(glob.glob(os.path.join("csrc", "**", "*.h"), recursive=True)),
        )
    ]
    # ninja compiles the sources in parallel when it is installed; plain setuptools otherwise.
    try:
        import ninja  # noqa: F401

        use_ninja = True
    except ImportError:
        use_ninja = False
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=use_ninja)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
