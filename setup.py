"""Build of the native core: every C file under src/barellm/_native (its tier folders included) is one
extension module.

Each tier's files select their own instruction set with `#pragma GCC target`, so the package is built for
the baseline x86-64 and picks the best tier the CPU has at run time (see cpu.c and tier.h).
"""

import glob
import os

from setuptools import Extension, setup

sources = sorted(glob.glob("src/barellm/_native/**/*.c", recursive=True))
cflags = ["-O3", "-std=gnu11", "-Wall", "-Wextra", "-fvisibility=hidden", "-pthread",
          "-fno-math-errno", "-fno-trapping-math"]
ldflags = ["-pthread"]
if os.environ.get("BARELLM_SANITIZE"):  # an AddressSanitizer build for the kernel tests
    cflags = [f for f in cflags if f != "-O3"] + ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"]
    ldflags += ["-fsanitize=address"]

setup(
    ext_modules=[
        Extension(
            "barellm._native",
            sources=sources,
            include_dirs=["src/barellm/_native"],
            depends=sorted(glob.glob("src/barellm/_native/**/*.h", recursive=True)),
            extra_compile_args=cflags,
            extra_link_args=ldflags,
        )
    ]
)
