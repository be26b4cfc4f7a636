"""Builds the Cython extensions in native/ into the kvfs package.

KVFS_ONLY_EXT=kvfs._index (comma-separated) builds a subset, for working on one module.
"""

import glob
import os
import subprocess

from Cython.Build import cythonize
from setuptools import Extension, setup


def pkg_config(flag: str, package: str = "fuse3", default: str = "") -> list[str]:
    try:
        out = subprocess.run(["pkg-config", flag, package], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = default
    return out.split()


SHIM_C = sorted(glob.glob("native/shim/*.c"))
SHIM_H = sorted(glob.glob("native/shim/*.h"))

EXTENSIONS = [
    Extension("kvfs._index", ["native/_index.pyx"], extra_compile_args=["-O3"]),
    Extension("kvfs._shuffle", ["native/_shuffle.pyx"], extra_compile_args=["-O3"]),
    # Huffman coder of byte planes for codecs 5-7 (kvfs/store/codec.py); headers in native/.
    Extension("kvfs._huff", ["native/_huff.pyx"], extra_compile_args=["-O3"],
              depends=["native/kvhuff.h", "native/kvshuffle.h"]),
    # xxh3 without the GIL (Debian's libxxhash-dev header, inlined).
    Extension("kvfs._digest", ["native/_digest.pyx"], extra_compile_args=["-O3"]),
    # What pyfuse3 lacks, added underneath it (see the module docstring): its C is in
    # native/shim/, one file per concern; only the libfuse functions it replaces are exported.
    Extension("kvfs._fuseshim", ["native/_fuseshim.pyx", *SHIM_C],
              include_dirs=["native/shim"], depends=SHIM_H,
              extra_compile_args=pkg_config("--cflags", default="-I/usr/include/fuse3")
              + ["-fvisibility=hidden"],
              extra_link_args=pkg_config("--libs", default="-lfuse3") + ["-ldl"]),
]

only = {name for name in os.environ.get("KVFS_ONLY_EXT", "").split(",") if name}
if only:
    EXTENSIONS = [ext for ext in EXTENSIONS if ext.name in only]

setup(ext_modules=cythonize(EXTENSIONS, language_level=3))
