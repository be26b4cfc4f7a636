# cython: language_level=3
"""xxh3-64 of a buffer without the GIL, for the chunk checksums (kvfs/store/chunkstore.py).

The same function as `xxhash.xxh3_64_intdigest` (XXH3, 64 bits, seed 0: its output is fixed
since xxHash 0.8.0), but python-xxhash hashes with the GIL held, so two worker threads hashing
chunks take turns and the trio thread waits behind them. Here inputs of 64 KiB and more are
hashed with the GIL released. The code is xxHash's own, from Debian's libxxhash-dev header,
inlined and built for AVX2 (the library is built for SSE2, at half the speed); `fast()` tells
whether this CPU can run it, and callers fall back to python-xxhash when it cannot.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer

cdef extern from *:
    """
    #pragma GCC push_options
    #pragma GCC target("avx2")
    #define XXH_INLINE_ALL
    #define XXH_VECTOR XXH_AVX2
    #include <xxhash.h>
    #pragma GCC pop_options

    static int kvfs_digest_fast(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2");
    }
    """
    unsigned long long XXH3_64bits(const void *data, size_t length) nogil
    int kvfs_digest_fast()

# Below this size the hash takes less time than giving the GIL away and taking it back.
DEF NOGIL_BYTES = 65536

_FAST = kvfs_digest_fast() != 0


def fast() -> bool:
    """Can this CPU run `xxh3` (AVX2)?"""
    return _FAST


def xxh3(data) -> int:
    """xxh3-64 of *data* (any contiguous buffer). Only where `fast()`."""
    cdef Py_buffer view
    cdef unsigned long long h
    if not _FAST:
        raise RuntimeError("kvfs._digest.xxh3 needs AVX2")
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if view.len < NOGIL_BYTES:
            h = XXH3_64bits(view.buf, <size_t>view.len)
        else:
            with nogil:
                h = XXH3_64bits(view.buf, <size_t>view.len)
    finally:
        PyBuffer_Release(&view)
    return h
