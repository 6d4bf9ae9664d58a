"""The one compiled part of commd: the compressed path's loops (commd/compression/_native.c).

``optional``: where no C compiler is found, commd installs without it and kernels.py runs
the same steps in numpy (slower; ``commd status`` and the daemon's log say which is used).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "commd.compression._native",
    ["commd/compression/_native.c"],
    depends=[f"commd/compression/_native_{part}.h"
             for part in ("common", "avx512", "typed", "wire")],
    # no fused multiply-add: the same rounding as numpy's separate multiply and add
    extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off"],
    optional=True,
)])
