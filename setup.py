"""Builds the native CPU extension `bertfast._C` from csrc/ (torch C++ extension + pybind11).

Set BERTFAST_NO_EXT=1 to skip it (the torch and triton backends need no native code), BERTFAST_DEBUG_INFO=0 to
compile it without debug info (a wheel's: .ci/wheel_check.sh).
A failed compile fails the install: no half-built module is ever shipped.

The kernels are compiled for the baseline ISA of the target (x86-64, aarch64); their AVX-512 variants are
compiled per function (`__attribute__((target(...)))`, see csrc/cpu/common/isa.h) and chosen at run time from
the CPU's features, so one build runs on any x86-64 and on aarch64. Each AMX kernel source (`*_amx.cpp`) is
compiled twice: as itself (the amx tier) and with -DBF_AMX_EMULATED=1 into objects of its own (the amx_emulated
tier: csrc/cpu/common/amx_tiles.h). Only csrc/bindings.cpp includes the full torch headers (csrc/bindings/
includes only the ATen ones it uses), which keeps a full build to ~1.5 min on 2 cores (~2 min without ninja).
"""

import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
amx_sources = [s for s in sources if s.endswith("_amx.cpp")]
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

    class BuildExt(BuildExtension.with_options(use_ninja=use_ninja)):
        """BuildExtension, plus the amx_emulated tier's objects: the AMX kernel sources compiled again, with their
        tile instructions emulated, into a folder of their own (so their objects do not collide with the amx
        tier's), by the same compiler call and flags as the extension's own sources, then linked in."""

        def build_extension(self, ext):
            emulated = self.compiler.compile(
                amx_sources, output_dir=os.path.join(self.build_temp, "amx_emulated"),
                macros=[*ext.define_macros, ("BF_AMX_EMULATED", "1")], include_dirs=ext.include_dirs,
                debug=self.debug, extra_postargs=ext.extra_compile_args or [], depends=ext.depends)
            ext.extra_objects = [*ext.extra_objects, *emulated]
            super().build_extension(ext)

    cmdclass = {"build_ext": BuildExt}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
