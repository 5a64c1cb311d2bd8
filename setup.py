"""Builds the native CPU extension `bertfast._C` from csrc/ (torch C++ extension + pybind11).

Set BERTFAST_NO_EXT=1 to skip it (the torch and triton backends need no native code).
A failed compile fails the install: no half-built module is ever shipped.
"""

import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
if sources and os.environ.get("BERTFAST_NO_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [
        CppExtension(
            "bertfast._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=["-O3", "-fopenmp", "-std=c++17"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=False)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
