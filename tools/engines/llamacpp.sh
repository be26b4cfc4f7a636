#!/usr/bin/env bash
# llama.cpp through llama-cpp-python: sequence state saved to and restored from files on a
# kvfs mount, as llama-server's slot save/restore (--slot-save-path) does. Extra arguments
# go to harness.py (e.g. --targets kvfs).
ENGINE=llamacpp
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}
. "$(dirname "$0")/common.sh"

install_llamacpp() {
    pipv install --upgrade pip
    # No CPU wheel on PyPI: this builds llama.cpp from source (cmake, ~190 objects; in TMPDIR).
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) pipv install "llama-cpp-python==$LLAMA_CPP_VERSION" gguf
}

ensure_installed "llama-cpp-python==$LLAMA_CPP_VERSION" install_llamacpp
build_model "$HERE/llamacpp_round.py"
run_harness "$HERE/llamacpp_round.py" "$@"
