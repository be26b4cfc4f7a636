"""The namespace and the file operations through `kvfs.fs.Operations`, without a mount: the
requests a process's system calls make the kernel send, and the errno a local filesystem
(tmpfs, ext4) answers them with."""

from __future__ import annotations

import errno
import os
import stat

import pyfuse3

ROOT_INO = pyfuse3.ROOT_INODE
CHUNK = 64 << 10


async def test_root_is_a_directory(tiers):
    async with tiers.mount() as kv:
        attr = await kv.ops.getattr(ROOT_INO, None)
        assert stat.S_ISDIR(attr.st_mode) and attr.st_nlink == 2


async def test_mkdir_and_rmdir_count_links_and_touch_the_parent(tiers):
    async with tiers.mount() as kv:
        before = await kv.getattr("")
        ino = await kv.mkdir("d", 0o750)
        await kv.mkdir("d/e")
        attr = await kv.getattr("d")
        assert attr.st_ino == ino and stat.S_IMODE(attr.st_mode) == 0o750 & ~0o022
        assert attr.st_nlink == 3  # ".", its name, "e/.."
        parent = await kv.getattr("")
        assert parent.st_nlink == before.st_nlink + 1
        assert parent.st_mtime_ns >= before.st_mtime_ns
        assert await kv.errno_of(kv.ops.rmdir(ROOT_INO, b"d", None)) == errno.ENOTEMPTY
        assert await kv.errno_of(kv.mkdir("d")) == errno.EEXIST
        await kv.ops.rmdir(ino, b"e", None)
        await kv.ops.rmdir(ROOT_INO, b"d", None)
        assert await kv.errno_of(kv.lookup("d")) == errno.ENOENT
        assert (await kv.getattr("")).st_nlink == before.st_nlink


async def test_create_write_read_unlink(tiers):
    async with tiers.mount() as kv:
        fh = await kv.create("f", 0o640)
        data = os.urandom(3 * CHUNK + 123)
        assert await kv.write(fh, 0, data) == len(data)
        assert await kv.read(fh, 0, len(data) + 10) == data  # short at the end
        assert await kv.read(fh, len(data), 10) == b""
        await kv.release(fh)
        attr = await kv.getattr("f")
        assert attr.st_size == len(data) and stat.S_IMODE(attr.st_mode) == 0o640
        assert attr.st_blocks * 512 >= len(data)
        assert await kv.errno_of(kv.create("f")) == errno.EEXIST
        await kv.unlink("f")
        assert await kv.errno_of(kv.lookup("f")) == errno.ENOENT
        assert await kv.errno_of(kv.unlink("f")) == errno.ENOENT


async def test_names_longer_than_name_max_are_enametoolong_everywhere(tiers):
    long = "n" * 256
    async with tiers.mount() as kv:
        await kv.write_file("f", b"x")
        ino = await kv.lookup("f")
        assert await kv.errno_of(kv.lookup(long)) == errno.ENAMETOOLONG
        assert await kv.errno_of(kv.create(long)) == errno.ENAMETOOLONG
        assert await kv.errno_of(kv.mkdir(long)) == errno.ENAMETOOLONG
        assert await kv.errno_of(kv.rename("f", long)) == errno.ENAMETOOLONG
        assert await kv.errno_of(kv.ops.link(ino, ROOT_INO, long.encode(), None)) == \
            errno.ENAMETOOLONG
        assert await kv.errno_of(kv.ops.symlink(ROOT_INO, long.encode(), b"f", kv.ctx)) == \
            errno.ENAMETOOLONG
        await kv.create("n" * 255)  # NAME_MAX itself is a name



async def test_hard_links_keep_the_data_until_the_last_name_goes(tiers):
    async with tiers.mount() as kv:
        data = os.urandom(2 * CHUNK)
        ino = await kv.write_file("a", data)
        await kv.mkdir("d")
        attr = await kv.ops.link(ino, await kv.lookup("d"), b"b", kv.ctx)
        assert attr.st_ino == ino and attr.st_nlink == 2
        assert await kv.errno_of(kv.ops.link(await kv.lookup("d"), ROOT_INO, b"dl", kv.ctx)) \
            == errno.EPERM  # no hard links to directories
        await kv.unlink("a")
        assert (await kv.getattr("d/b")).st_nlink == 1
        assert await kv.read_file("d/b") == data
        held = (await kv.status())["tiers"]["dram"]["used_bytes"]
        await kv.unlink("d/b")
        assert (await kv.status())["tiers"]["dram"]["used_bytes"] == held - len(data)


async def test_rename_replaces_atomically_and_frees_what_it_replaced(tiers):
    async with tiers.mount() as kv:
        old, new = os.urandom(CHUNK + 1), os.urandom(2 * CHUNK)
        await kv.write_file("a", old)
        ino = await kv.write_file("b", new)
        used = (await kv.status())["tiers"]["dram"]["used_bytes"]
        await kv.rename("b", "a")
        assert await kv.lookup("a") == ino and await kv.read_file("a") == new
        assert await kv.errno_of(kv.lookup("b")) == errno.ENOENT
        assert (await kv.status())["tiers"]["dram"]["used_bytes"] < used  # a's chunks went


async def test_rename_flags_and_the_errno_of_impossible_renames(tiers):
    noreplace, exchange = 1, 2  # RENAME_NOREPLACE, RENAME_EXCHANGE
    async with tiers.mount() as kv:
        await kv.write_file("a", b"A")
        await kv.write_file("b", b"B")
        await kv.mkdir("d")
        await kv.mkdir("d/sub")
        await kv.mkdir("e")
        await kv.write_file("e/x", b"x")
        assert await kv.errno_of(kv.rename("a", "b", noreplace)) == errno.EEXIST
        assert await kv.errno_of(kv.rename("a", "c", exchange)) == errno.ENOENT
        await kv.rename("a", "b", exchange)
        assert await kv.read_file("a") == b"B" and await kv.read_file("b") == b"A"
        assert await kv.errno_of(kv.rename("d", "d/sub/d2")) == errno.EINVAL
        assert await kv.errno_of(kv.rename("a", "d")) == errno.EISDIR
        assert await kv.errno_of(kv.rename("d", "a")) == errno.ENOTDIR
        assert await kv.errno_of(kv.rename("d", "e")) == errno.ENOTEMPTY
        await kv.rename("d", "e/x2")  # a directory moves, with its links
        assert (await kv.getattr("e")).st_nlink == 3
        assert await kv.lookup("e/x2/sub")


async def test_symlinks(tiers):
    async with tiers.mount() as kv:
        attr = await kv.ops.symlink(ROOT_INO, b"l", b"some/target", kv.ctx)
        assert stat.S_ISLNK(attr.st_mode) and attr.st_size == len(b"some/target")
        assert await kv.ops.readlink(attr.st_ino, kv.ctx) == b"some/target"
        await kv.write_file("f", b"x")
        assert await kv.errno_of(kv.ops.readlink(await kv.lookup("f"), kv.ctx)) == errno.EINVAL
        assert await kv.errno_of(kv.ops.symlink(ROOT_INO, b"l2", b"t" * 4096, kv.ctx)) == \
            errno.ENAMETOOLONG


async def test_an_unlinked_file_stays_readable_until_its_last_close(tiers):
    async with tiers.mount() as kv:
        data = os.urandom(3 * CHUNK)
        ino = await kv.write_file("f", data)
        fh = await kv.open("f")
        await kv.unlink("f")
        assert await kv.read(fh, 0, len(data)) == data
        await kv.release(fh)
        assert (await kv.status())["tiers"]["dram"]["used_bytes"] == 0  # freed at the close
        # The kernel still knows the inode: an OPEN on its way finds it gone.
        assert await kv.errno_of(kv.ops.open(ino, os.O_RDONLY, kv.ctx)) == errno.ENOENT
        await kv.ops.forget([(ino, kv.ns.inodes[ino].lookups)])
        assert ino not in kv.ns.inodes


async def test_setattr_changes_what_it_names_and_ctime(tiers):
    async with tiers.mount() as kv:
        await kv.write_file("f", b"data")
        before = await kv.getattr("f")
        attr = await kv.setattr("f", st_mode=stat.S_IFREG | 0o600, st_uid=1000, st_gid=100,
                                st_atime_ns=10**18, st_mtime_ns=2 * 10**18)
        assert stat.S_IMODE(attr.st_mode) == 0o600 and stat.S_ISREG(attr.st_mode)
        assert (attr.st_uid, attr.st_gid) == (1000, 100)
        assert (attr.st_atime_ns, attr.st_mtime_ns) == (10**18, 2 * 10**18)
        assert attr.st_ctime_ns >= before.st_ctime_ns and attr.st_size == 4


async def test_truncation_within_and_across_chunks(tiers):
    """As S3QL's truncate tests: what a truncation cuts off reads as zeros when the file
    grows again."""
    async with tiers.mount() as kv:
        data = os.urandom(3 * CHUNK + 100)
        await kv.write_file("f", data)
        for size in (3 * CHUNK + 50, 2 * CHUNK + 7, CHUNK, 10, 0):
            await kv.truncate("f", size)
            assert await kv.size("f") == size
            assert await kv.read_file("f") == data[:size]
            await kv.truncate("f", size + 1000)
            assert await kv.read_file("f") == data[:size] + bytes(1000)
            await kv.truncate("f", size)
        assert await kv.errno_of(kv.truncate("", 0)) == errno.EISDIR


async def test_an_open_with_o_trunc_empties_the_file(tiers):
    async with tiers.mount() as kv:
        await kv.write_file("f", os.urandom(2 * CHUNK))
        fh = await kv.open("f", os.O_WRONLY | os.O_TRUNC)
        assert await kv.size("f") == 0
        await kv.write(fh, 0, b"new")
        await kv.release(fh)
        assert await kv.read_file("f") == b"new"


async def test_o_direct_wants_aligned_offsets_and_lengths(tiers):
    async with tiers.mount() as kv:
        await kv.write_file("f", os.urandom(8192))
        fh = await kv.open("f", os.O_RDWR | os.O_DIRECT)
        assert await kv.errno_of(kv.ops.read(fh, 1, 512)) == errno.EINVAL
        assert await kv.errno_of(kv.ops.read(fh, 0, 100)) == errno.EINVAL
        assert await kv.errno_of(kv.ops.write(fh, 512, b"x" * 100)) == errno.EINVAL
        assert await kv.write(fh, 512, b"y" * 512) == 512
        assert (await kv.read(fh, 0, 1024))[512:] == b"y" * 512
        await kv.release(fh)


async def test_files_end_at_2_to_the_50(tiers):
    """(A byte written just below the end is the mount tests' business: this tier's DRAM
    directory may be on ext4, whose files end at 16 TiB.)"""
    top = 1 << 50
    async with tiers.mount() as kv:
        fh = await kv.create("f")
        assert await kv.errno_of(kv.ops.write(fh, top - 1, b"ab")) == errno.EFBIG
        await kv.truncate("f", top)
        assert await kv.read(fh, top - 2, 10) == bytes(2)
        await kv.release(fh)
        assert await kv.errno_of(kv.truncate("f", top + 1)) == errno.EFBIG


async def test_opening_a_directory_is_eisdir(tiers):
    async with tiers.mount() as kv:
        await kv.mkdir("d")
        assert await kv.errno_of(kv.open("d")) == errno.EISDIR


async def test_xattrs(tiers):
    async with tiers.mount() as kv:
        ino = await kv.write_file("f", b"x")
        ops = kv.ops
        await ops.setxattr(ino, b"user.a", b"1", kv.ctx)
        await ops.setxattr(ino, b"trusted.b", b"2" * 1000, kv.ctx)
        assert await ops.getxattr(ino, b"user.a", kv.ctx) == b"1"
        assert sorted(await ops.listxattr(ino, kv.ctx)) == [b"trusted.b", b"user.a"]
        await ops.removexattr(ino, b"user.a", kv.ctx)
        assert await kv.errno_of(ops.getxattr(ino, b"user.a", kv.ctx)) == errno.ENODATA
        assert await kv.errno_of(ops.removexattr(ino, b"user.a", kv.ctx)) == errno.ENODATA
        for name in (b"system.posix_acl_access", b"other.x"):
            assert await kv.errno_of(ops.setxattr(ino, name, b"v", kv.ctx)) == errno.EOPNOTSUPP
        assert await kv.errno_of(ops.setxattr(ino, b"user.big", bytes(65537), kv.ctx)) == \
            errno.E2BIG
        # the control names kvfsctl uses
        status = await kv.status()
        assert status["files"] == 1 and status["settings"]["chunk_size"] == CHUNK
        assert await kv.where("f") == [{"chunk": 0, "tiers": ["dram"], "packed": False,
                                        "raw_len": 1, "stored_len": 1, "codec": 0,
                                        "segment": None, "dirty": True, "lost": False}]
        assert await kv.errno_of(ops.getxattr(ROOT_INO, b"user.kvfs.where", kv.ctx)) == \
            errno.EISDIR
        assert await kv.errno_of(ops.setxattr(ino, b"user.kvfs.status", b"", kv.ctx)) == \
            errno.EPERM


async def test_statfs_counts_what_files_hold(tiers):
    async with tiers.mount() as kv:
        empty = await kv.ops.statfs(kv.ctx)
        assert empty.f_namemax == 255 and empty.f_bfree <= empty.f_blocks
        await kv.write_file("f", os.urandom(4 * CHUNK))
        full = await kv.ops.statfs(kv.ctx)
        assert (empty.f_bfree - full.f_bfree) * full.f_bsize == 4 * CHUNK
        assert full.f_ffree == empty.f_ffree - 1


async def test_readdir_lists_every_name(tiers, monkeypatch):
    async with tiers.mount() as kv:
        names = {f"f{i}" for i in range(50)}
        for name in names:
            fh = await kv.create(name)
            await kv.release(fh)
        await kv.mkdir("d")
        assert sorted(await kv.listdir("", monkeypatch)) == sorted(names | {"d"})
        assert await kv.listdir("d", monkeypatch) == []


async def test_setid_bits_go_as_on_a_local_filesystem(tiers):
    """A write or a truncation by a caller without CAP_FSETID, and any chown, clear
    set-user-ID (and set-group-ID where the group may execute): the kernel asks (the
    shim's kill handler), kvfs clears. A chown(-1, -1) by someone neither root nor the
    owner, of a file not open for writing, is EPERM."""
    from kvfs.fs import Kill

    async with tiers.mount() as kv:
        ino = await kv.write_file("f", b"x")
        await kv.setattr("f", st_mode=stat.S_IFREG | 0o6755, st_uid=1000, st_gid=1000)
        kv.ops.kill_suidgid(ino, 1001, 1001, os.getpid(), Kill.TRUNCATE)
        assert stat.S_IMODE((await kv.getattr("f")).st_mode) == 0o755
        await kv.setattr("f", st_mode=stat.S_IFREG | 0o6755)
        kv.ops.kill_suidgid(ino, 1001, 1001, os.getpid(), Kill.WRITE)
        assert stat.S_IMODE((await kv.getattr("f")).st_mode) == 0o755
        await kv.setattr("f", st_mode=stat.S_IFREG | 0o6755)
        assert await kv.errno_of(kv.setattr("f", ctx=kv.caller(uid=1001, gid=1001))) == \
            errno.EPERM
        await kv.setattr("f", ctx=kv.caller(uid=1000, gid=1000))  # the owner's chown(-1, -1)
        assert stat.S_IMODE((await kv.getattr("f")).st_mode) == 0o755


async def test_the_namespace_outlives_a_remount(tiers):
    async with tiers.mount() as kv:
        await kv.mkdir("d", 0o700)
        ino = await kv.write_file("d/f", b"data")
        await kv.ops.link(ino, ROOT_INO, b"hard", kv.ctx)
        await kv.ops.symlink(ROOT_INO, b"l", b"d/f", kv.ctx)
        await kv.ops.setxattr(ino, b"user.k", b"v", kv.ctx)
        await kv.setattr("d/f", st_mode=stat.S_IFREG | 0o604, st_mtime_ns=12345)
        await kv.write_file("sparse", b"end", at=5 * CHUNK)
        before = {p: await kv.getattr(p) for p in ("d", "d/f", "l", "sparse")}
    async with tiers.mount() as kv:
        for path, attr in before.items():
            now = await kv.getattr(path)
            for key in ("st_ino", "st_mode", "st_nlink", "st_size", "st_mtime_ns"):
                assert getattr(now, key) == getattr(attr, key), (path, key)
        assert await kv.lookup("hard") == ino and await kv.read_file("hard") == b"data"
        assert await kv.ops.readlink(await kv.lookup("l"), kv.ctx) == b"d/f"
        assert await kv.ops.getxattr(ino, b"user.k", kv.ctx) == b"v"
        assert await kv.read_file("sparse") == bytes(5 * CHUNK) + b"end"
        fh = await kv.create("new")  # inode numbers go on, not over
        await kv.release(fh)
        assert await kv.lookup("new") > max(a.st_ino for a in before.values())
