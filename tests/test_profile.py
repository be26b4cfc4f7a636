"""KVFS_TRIO_PROFILE: the daemon times its trio task steps and writes them out at unmount."""

from __future__ import annotations

import os


def test_the_trio_profile_is_written_at_unmount(mount_factory, tmp_path, monkeypatch):
    out = tmp_path / "trio-profile.txt"
    monkeypatch.setenv("KVFS_TRIO_PROFILE", str(out))
    kv = mount_factory()
    data = os.urandom(300_000)
    (kv.path / "f").write_bytes(data)
    assert (kv.path / "f").read_bytes() == data
    kv.unmount()
    lines = out.read_text().splitlines()
    assert lines[0].startswith("wall ") and "task steps" in lines[0]
    assert lines[1].startswith("step length")
    assert sum(int(x) for x in lines[1].split("[")[1].rstrip("]").split(",")) > 0
    assert any(line.startswith("step time by where") for line in lines)
