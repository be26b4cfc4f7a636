# Sourced by tools/engines/<engine>.sh after setting ENGINE. Each engine gets its own virtual
# environment under $KVFS_ENGINES_DIR (default /var/tmp/kvfs-engines: installs take GBs and
# builds need a TMPDIR with room, which /tmp may not have), never the system Python.
# Installs and builds run under `nice -n 19`: they are long and CPU-heavy.
#
# Environment:
#   KVFS_ENGINES_DIR   venvs, models, scratch and results (default /var/tmp/kvfs-engines)
#   KVFS_CMD           how to run kvfs (default `kvfs`, the installed command; for a checkout:
#                      KVFS_CMD="python -m kvfs" PYTHONPATH=/path/to/checkout)
#   KVFS_OPTIONS       -o options of the kvfs mount (default dram_size=2G,nvme_size=16G)
#   PYTHON             the Python that runs the harness (default python3)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ENGINES_DIR=${KVFS_ENGINES_DIR:-/var/tmp/kvfs-engines}
ENGINE_DIR=$ENGINES_DIR/$ENGINE
VENV=$ENGINE_DIR/venv
MODEL_DIR=$ENGINE_DIR/model
RESULTS_DIR=$ENGINES_DIR/results
export TMPDIR=$ENGINES_DIR/tmp
mkdir -p "$ENGINE_DIR" "$RESULTS_DIR" "$TMPDIR"

say() { echo "[$(date +%H:%M:%S)] $ENGINE: $*" >&2; }

pipv() { nice -n 19 "$VENV/bin/pip" --disable-pip-version-check "$@"; }

# ensure_installed SPEC FUNCTION: run FUNCTION (which installs into $VENV) unless the venv
# was last completed for the same SPEC. The log of the install is $ENGINE_DIR/install.log.
ensure_installed() {
    local spec=$1 fn=$2 marker=$ENGINE_DIR/installed
    if [[ -x $VENV/bin/python && -f $marker && $(cat "$marker") == "$spec" ]]; then
        return
    fi
    say "installing $spec into $VENV (log: $ENGINE_DIR/install.log)"
    rm -f "$marker"
    [[ -x $VENV/bin/python ]] || nice -n 19 python3 -m venv "$VENV"
    if ! "$fn" >>"$ENGINE_DIR/install.log" 2>&1; then
        say "install failed; the end of $ENGINE_DIR/install.log:"
        tail -n 30 "$ENGINE_DIR/install.log" >&2
        return 1
    fi
    echo "$spec" >"$marker"
}

# build_model ROUND_SCRIPT [ARGS...]: the tiny random-weights model, once.
build_model() {
    local script=$1
    shift
    if [[ ! -f $MODEL_DIR/.complete ]]; then
        say "building the tiny random-weights model in $MODEL_DIR"
        rm -rf "$MODEL_DIR"
        mkdir -p "$MODEL_DIR"
        nice -n 19 "$VENV/bin/python" "$script" --build-model --model-dir "$MODEL_DIR" "$@"
        touch "$MODEL_DIR/.complete"
    fi
}

# run_harness ROUND_SCRIPT [HARNESS ARGS...]: the rounds on kvfs, tmpfs and ext4; the
# summary goes to $RESULTS_DIR/$ENGINE.json.
run_harness() {
    local script=$1
    shift
    "${PYTHON:-python3}" "$HERE/harness.py" --name "$ENGINE" --python "$VENV/bin/python" \
        --round-script "$script" --model-dir "$MODEL_DIR" --work "$ENGINE_DIR/run" \
        --json-out "$RESULTS_DIR/$ENGINE.json" "$@"
}
