"""Only the optional C extension lives here; everything else is in pyproject.toml.

`farloco.optim._kernels` (optim/_kernels.c) does the int8 / int4 codecs' blockwise quantization, and the outer
strategies' elementwise passes (contributions, outer steps, the eager preview, the streaming merge), in one pass
each.
It is optional: where no C compiler is found the build goes on without it and the codecs use torch (same bytes,
same values, slower)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "farloco.optim._kernels",
            ["optim/_kernels.c"],
            # -ffp-contract=off: no multiply-add is fused, so the bits are those of the torch ops they replace.
            extra_compile_args=[
                "-O3",
                "-std=c11",
                "-ffp-contract=off",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
            ],
            optional=True,
        )
    ]
)
