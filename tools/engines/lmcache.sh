#!/usr/bin/env bash
# LMCache's local-disk backend (LocalDiskBackend) with its directory on a kvfs mount, kvfs
# remounted under one running LMCache process. Extra arguments go to harness.py.
ENGINE=lmcache
LMCACHE_VERSION=${LMCACHE_VERSION:-0.5.6}
. "$(dirname "$0")/common.sh"

install_lmcache() {
    # lmcache requires cupy-cuda13x, cuda-python, nvtx and a CUDA torch: install it without
    # its dependencies, beside the CPU torch, plus what its storage backends import.
    pipv install torch==2.13.0
    pipv install 'transformers>=5.4' 'numpy<=2.2.6'
    pipv install --no-deps "lmcache==$LMCACHE_VERSION"
    pipv install numba requests cachetools sortedcontainers 'prometheus_client<=0.24.1' \
        py-cpuinfo psutil aiohttp aiofile msgspec pyzmq cryptography
}

ensure_installed "lmcache==$LMCACHE_VERSION" install_lmcache
build_model "$HERE/lmcache_round.py"
run_harness "$HERE/lmcache_round.py" --persistent "$@"
