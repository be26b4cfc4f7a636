"""Builds the Cython extensions in native/ into the kvfs package.

KVFS_ONLY_EXT=kvfs._index (comma-separated) builds a subset, for working on one module.
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

EXTENSIONS = [
    Extension("kvfs._index", ["native/_index.pyx"], extra_compile_args=["-O3"]),
    Extension("kvfs._shuffle", ["native/_shuffle.pyx"], extra_compile_args=["-O3"]),
]

only = {name for name in os.environ.get("KVFS_ONLY_EXT", "").split(",") if name}
if only:
    EXTENSIONS = [ext for ext in EXTENSIONS if ext.name in only]

setup(ext_modules=cythonize(EXTENSIONS, language_level=3))
