# Set-up and test commands named in the README. Run as root on Debian 12 (CI does).
PYTHON ?= python3
MNT ?= /mnt/kv

.PHONY: deps install demo test lint bench clean

# System packages (FUSE 3 and its headers for pyfuse3, a C compiler for the Cython index),
# then kvfs itself in editable mode so tests import the built extensions from the tree.
deps:
	@if ! dpkg -s fuse3 libfuse3-dev pkg-config gcc >/dev/null 2>&1; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    fuse3 libfuse3-dev pkg-config gcc python3-dev >/dev/null; fi
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q -e '.[test]'

# Helpers mount(8) looks for in /sbin: `mount -t fuse.kvfs` and fstab lines use them.
install: deps
	@bindir=$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("scripts"))'); \
	for name in mount.kvfs mount.fuse.kvfs; do ln -sf $$bindir/mount.kvfs /sbin/$$name; done; \
	for name in kvfs kvfsctl fsck.kvfs; do ln -sf $$bindir/$$name /usr/local/bin/$$name 2>/dev/null || true; done

# Mount with the embedded defaults and show it working.
demo: install
	$(PYTHON) tools/demo.py $(MNT)

test: deps
	$(PYTHON) -m pytest -q tests

lint:
	$(PYTHON) -m ruff check kvfs tools tests

clean:
	rm -rf build *.egg-info kvfs/*.so native/*.c
