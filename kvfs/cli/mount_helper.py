"""`mount.kvfs`: the helper mount(8) runs for `mount -t fuse.kvfs kvfs /mnt/kv -o ...` and
for fstab lines (installed as /sbin/mount.kvfs and /sbin/mount.fuse.kvfs).

mount(8) calls `mount.kvfs SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]`; the options are the kvfs
settings (dram_size=8G,nvme_dir=/data/kvfs,...) plus generic ones (rw, nofail, ...) that are
ignored. The daemon goes to the background once the mount is ready.
"""

from __future__ import annotations

import sys

from kvfs.cli.main import main as kvfs_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    positional: list[str] = []
    options: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-o" and i + 1 < len(argv):
            options.append(argv[i + 1])
            i += 2
            continue
        if a.startswith("-o") and len(a) > 2:
            options.append(a[2:])
        elif a in ("-h", "--help"):
            print(__doc__)
            return 0
        elif a.startswith("-"):
            pass  # -s (sloppy), -f (fake), -n (no mtab), -v (verbose): nothing to do
        else:
            positional.append(a)
        i += 1
    if len(positional) != 2:
        sys.stderr.write("usage: mount.kvfs SOURCE MOUNTPOINT [-o OPTIONS]\n")
        return 2
    opts = ",".join(o for o in options if o)
    args = ["mount", positional[1]] + (["-o", opts] if opts else [])
    return kvfs_main(args)


if __name__ == "__main__":
    sys.exit(main())
