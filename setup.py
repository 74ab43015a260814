"""Only the optional C extension lives here; everything else is in pyproject.toml.

`farloco.optim._kernels` (optim/_kernels.c) does the int8 / int4 codecs' blockwise quantization in one pass.
It is optional: where no C compiler is found the build goes on without it and the codecs use torch (same bytes,
same values, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "farloco.optim._kernels",
            ["optim/_kernels.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            optional=True,
        )
    ]
)
