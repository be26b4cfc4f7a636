#!/usr/bin/env bash
# Sets kvfs up on a fresh Debian 12 machine (run as root), then optionally:
#   tools/install.sh demo [MOUNTPOINT]   mount kvfs with its embedded defaults and show it working
#   tools/install.sh test                run the test suite
#   tools/install.sh                     only install
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# FUSE 3 and its headers (pyfuse3 builds against them), a C compiler for the Cython code,
# xxHash's header (checksums without the GIL: native/_digest.pyx).
pkgs="fuse3 libfuse3-dev pkg-config gcc libxxhash-dev"
# The test and demo paths also install the pod tier's Mooncake client (the `pod` extra),
# whose libraries link libibverbs even when they only speak TCP.
case "${1:-}" in demo|test) pkgs="$pkgs libibverbs1" ;; esac
if ! dpkg -s $pkgs >/dev/null 2>&1 || ! command -v "$PYTHON" >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $pkgs python3 python3-dev python3-pip >/dev/null
fi
# Debian's own python refuses pip installs without this; a pyenv/venv python ignores it.
export PIP_BREAK_SYSTEM_PACKAGES=1
case "${1:-}" in demo|test) extras="test,pod" ;; *) extras="test" ;; esac
"$PYTHON" -m pip install -q --disable-pip-version-check -e ".[$extras]"

# mount(8) looks for helpers in /sbin: `mount -t fuse.kvfs` and fstab lines need these.
bindir=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
for name in mount.kvfs mount.fuse.kvfs; do ln -sf "$bindir/mount.kvfs" "/sbin/$name"; done
for name in kvfs kvfsctl fsck.kvfs; do
    [ "$bindir/$name" -ef "/usr/local/bin/$name" ] || ln -sf "$bindir/$name" "/usr/local/bin/$name"
done

case "${1:-}" in
    demo) exec "$PYTHON" tools/demo.py "${2:-/mnt/kv}" ;;
    test) exec "$PYTHON" -m pytest -q -n 4 tests ;;
    "") echo "kvfs installed: kvfs mount /mnt/kv; kvfsctl status /mnt/kv" ;;
    *) echo "usage: tools/install.sh [demo [MOUNTPOINT] | test]" >&2; exit 2 ;;
esac
