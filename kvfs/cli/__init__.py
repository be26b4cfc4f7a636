"""Command-line entry points: kvfs, mount.kvfs, kvfsctl, fsck.kvfs."""
