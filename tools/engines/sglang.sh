#!/usr/bin/env bash
# SGLang's HiCache file storage backend (HiCacheFile) with its directory on a kvfs mount.
# Extra arguments go to harness.py (e.g. --targets kvfs).
ENGINE=sglang
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
. "$(dirname "$0")/common.sh"

install_sglang() {
    # sglang pins a CUDA torch 2.14.1 and dozens of GPU kernels: install it without its
    # dependencies, beside the CPU torch, plus what its storage and hash modules import.
    pipv install torch==2.13.0
    pipv install transformers==5.19.0 numpy ninja
    pipv install --no-deps "sglang==$SGLANG_VERSION"
    pipv install orjson psutil pybase64 requests triton pillow starlette msgspec pyzmq \
        ipython aiohttp
}

ensure_installed "sglang==$SGLANG_VERSION" install_sglang
build_model "$HERE/sglang_round.py"
run_harness "$HERE/sglang_round.py" "$@"
