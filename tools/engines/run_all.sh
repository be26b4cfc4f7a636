#!/usr/bin/env bash
# Every engine end to end on kvfs, tmpfs and a plain ext4 directory, then one table:
# time per round, files written, cache hit, identical tokens. As root. Not in CI (the installs
# take several GB and a llama.cpp build). See tools/engines/README.md.
#
#   tools/engines/run_all.sh                  # vllm llamacpp sglang lmcache
#   tools/engines/run_all.sh llamacpp sglang  # some of them
#   KVFS_CMD="python -m kvfs" PYTHONPATH=$PWD tools/engines/run_all.sh   # this checkout's kvfs
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
RESULTS=${KVFS_ENGINES_DIR:-/var/tmp/kvfs-engines}/results
engines=("$@")
[[ ${#engines[@]} -gt 0 ]] || engines=(vllm llamacpp sglang lmcache)
code=0
done_json=()
for e in "${engines[@]}"; do
    rm -f "$RESULTS/$e.json"
    if ! "$HERE/$e.sh" >/dev/null; then
        code=1
    fi
    if [[ -f $RESULTS/$e.json ]]; then
        done_json+=("$RESULTS/$e.json")
    else
        echo "$e: no result (install or model build failed, see above)" >&2
        code=1
    fi
done
echo
echo "kvfs engines, $(date +%Y-%m-%d), kvfs: ${KVFS_CMD:-kvfs}"
if [[ ${#done_json[@]} -gt 0 ]]; then
    "${PYTHON:-python3}" "$HERE/report.py" "${done_json[@]}" || code=1
fi
exit $code
