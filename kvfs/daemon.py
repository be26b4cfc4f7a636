"""The kvfs daemon: check the settings, open the tiers, mount, serve, and shut down cleanly.

Order matters: every check that can fail on user input runs before anything is created or
mounted, so a bad option leaves no trace. In the background mode the parent process waits on
a pipe until the child has mounted (or failed) and exits with the child's verdict.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import resource
import socket
import stat
import sys

import trio

from kvfs.config import ConfigError, Settings, format_size
from kvfs.metrics import MetricsServer, parse_address
from kvfs.profile import from_environment
from kvfs.store.dram import OPEN_FILES, is_tmpfs, own_tmpfs
from kvfs.store.meta import FormatError

log = logging.getLogger(__name__)


class MountError(Exception):
    """The filesystem cannot be mounted; the message says why, for the operator."""


def check(settings: Settings) -> Settings:
    """Validate everything that can be validated without side effects; returns resolved
    settings or raises ConfigError / MountError with one clear message."""
    s = settings.resolve()
    if s.metrics:
        parse_address(s.metrics)
    mp = s.mountpoint
    if not mp:
        raise MountError("no mountpoint given")
    try:
        st = os.stat(mp)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mp} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MountError(dead_mount_message(mp)) from None
        raise MountError(f"mountpoint {mp}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"mountpoint {mp} is not a directory")
    if os.path.ismount(mp) and _is_fuse_mount(mp):
        raise MountError(f"{mp} is already a FUSE mount (unmount it first)")
    if not os.path.exists("/dev/fuse"):
        raise MountError("/dev/fuse is missing: load the fuse module (modprobe fuse) or run "
                         "the container with --device /dev/fuse")
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
        os.close(fd)
    except OSError as exc:
        raise MountError(f"/dev/fuse cannot be opened: {exc.strerror}") from None
    probe = s.dram_dir
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not is_tmpfs(probe):
        raise MountError(f"DRAM directory {s.dram_dir} is not on tmpfs (choose one under "
                         "/dev/shm or mount a tmpfs there)")
    if os.path.exists(s.dram_dir) and not os.path.isdir(s.dram_dir):
        raise MountError(f"DRAM directory {s.dram_dir} is not a directory")
    if os.path.exists(s.nvme_dir) and not os.path.isdir(s.nvme_dir):
        raise MountError(f"NVMe directory {s.nvme_dir} is not a directory")
    if _inside(s.nvme_dir, mp) or _inside(s.dram_dir, mp):
        raise MountError("the tier directories must not be inside the mountpoint")
    shm = os.statvfs(probe)
    if s.dram_size > shm.f_blocks * shm.f_frsize:
        raise ConfigError(f"dram_size {format_size(s.dram_size)} is larger than the tmpfs at "
                          f"{probe} ({format_size(shm.f_blocks * shm.f_frsize)})")
    return s


def dead_mount_message(mp: str) -> str:
    """What to say of *mp*, a FUSE mount whose daemon is gone (every access is ENOTCONN)."""
    kind = _mount_type(os.path.realpath(mp))
    what = "kvfs mount" if kind == "fuse.kvfs" else f"{kind or 'FUSE'} mount"
    return (f"{mp} is a dead {what}: its daemon is gone (a crash?). Clear it with "
            f"`kvfs umount {mp}` (or `fusermount3 -u -z {mp}`), then mount again; a kvfs "
            "mount recovers what the dead one held")


def _mount_type(real: str) -> str | None:
    """The filesystem type of the mount on top at *real* (resolved), from mountinfo."""
    kind = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == real:
                kind = parts[parts.index("-") + 1]
    return kind


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def _fuse_mount_dev(real: str) -> int | None:
    """The device number of the FUSE mount at *real* (a path already resolved: once this
    daemon serves it, a stat or a realpath of it would wait for this very thread), from
    mountinfo; None if there is none."""
    dev = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == real and parts[parts.index("-") + 1].startswith("fuse"):
                major, _, minor = parts[2].partition(":")
                dev = os.makedev(int(major), int(minor))  # the last one is on top
    return dev


def _is_fuse_mount(mp: str) -> bool:
    return _fuse_mount_dev(os.path.realpath(mp)) is not None


def _setup_logging(s: Settings, background: bool) -> None:
    level = logging.DEBUG if s.debug else logging.INFO
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    handlers: list[logging.Handler] = []
    if s.log_file or background:
        path = s.log_file or os.path.join(s.nvme_dir, "kvfs.log")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handlers.append(logging.FileHandler(path))
    if not background:
        handlers.append(logging.StreamHandler(sys.stderr))
    logging.basicConfig(level=level, format=fmt, handlers=handlers, force=True)
    logging.getLogger("pyfuse3").setLevel(logging.INFO if s.debug else logging.WARNING)


def mount(settings: Settings) -> int:
    """Entry point of `kvfs mount`: returns the process exit code."""
    s = check(settings)
    if s.foreground:
        _setup_logging(s, background=False)
        return _serve(s, ready_fd=None)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            verdict = pipe.read().decode(errors="replace")
        if verdict.startswith("ok"):
            return 0
        _, status = os.waitpid(pid, 0)
        sys.stderr.write(f"kvfs: {verdict.strip() or 'the daemon died while mounting'}\n")
        return 1
    os.close(read_fd)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    code = 1
    try:
        _setup_logging(s, background=True)
        code = _serve(s, ready_fd=write_fd)
    finally:
        os._exit(code)


def _load_fallocate_shim():
    """Load kvfs._fuseshim into the global symbol scope *before* pyfuse3, so that pyfuse3's
    session is created by its fuse_session_new (gaining a fallocate handler) and mounted by
    its fuse_session_mount (which can ask for FUSE passthrough)."""
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)
    try:
        from kvfs import _fuseshim
    except ImportError as exc:
        log.warning("fallocate support unavailable: %s", exc)
        return None
    finally:
        sys.setdlopenflags(flags)
    return _fuseshim


# Descriptors the daemon holds besides the NVMe segments' and the DRAM files' (lmdb,
# /dev/fuse, the log, trio's and the worker threads' wake-up pipes, files being disposed of).
FD_RESERVE = 256
DRAM_FDS_MIN = 64
# Segments beyond nvme_size / segment_size that can be open at once (one being filled per
# stream, the cleaner's).
SEGMENTS_EXTRA = 64
FD_TABLE_MAX = 1 << 16


def descriptor_budget(s: Settings) -> int:
    """How many DRAM file descriptors the store may keep open, after raising the soft limit
    on open files to the hard one: systemd and most logins start a process at 1,024, which
    a mount passes after ~1,000 files (every create then failed with EMFILE), and every
    NVMe segment holds one too. Also grows the descriptor table to what the mount will use
    while the process has a single thread: grown later, each doubling of it waits for an RCU
    grace period because threads share it (6-23 ms here, at 256, 512, ... 4,096 files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else FD_TABLE_MAX * 16
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit from %d: %s", soft, exc)
    limit = soft if soft != resource.RLIM_INFINITY else want
    segments = s.nvme_size // s.segment_size + SEGMENTS_EXTRA
    dram = min(OPEN_FILES, limit - segments - FD_RESERVE)
    if dram < DRAM_FDS_MIN:
        log.warning("open files limit %d is low for this NVMe tier (up to %d segment files "
                    "open): raise it (ulimit -n, LimitNOFILE=) or segment_size", limit, segments)
        dram = DRAM_FDS_MIN
    top = min(limit, dram + segments + FD_RESERVE, FD_TABLE_MAX)
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if top - 1 > fd:
            os.dup2(fd, top - 1, inheritable=False)
            os.close(top - 1)
    except OSError as exc:  # only a cost: the table grows as files are opened instead
        log.debug("descriptor table not grown to %d: %s", top, exc)
    finally:
        os.close(fd)
    return dram


def _serve(s: Settings, ready_fd: int | None) -> int:
    dram_fds = descriptor_budget(s)  # first: the process has one thread now
    shim = _load_fallocate_shim()
    import pyfuse3

    from kvfs import fs
    from kvfs.assemble import Assembly

    metrics = None
    if s.metrics:
        # Before anything is created: a port in use fails the mount, with nothing to undo.
        metrics = MetricsServer(s.metrics)
        try:
            metrics.start()
        except OSError as exc:
            msg = (f"metrics: cannot listen on {metrics.url_host()}: "
                   f"{exc.strerror or exc} (choose another -o metrics=[ADDR:]PORT)")
            log.error("cannot start: %s", msg)
            _tell(ready_fd, f"error: {msg}")
            return 1
    lock = None
    try:
        lock = _lock(s.nvme_dir)
        if s.dram_huge:
            log.info("DRAM tier: %s", own_tmpfs(s.dram_dir, 2 * s.dram_size))
        asm = Assembly(s, dram_open_files=dram_fds)
    except Exception as exc:
        msg = _reason(exc)
        log.error("cannot start: %s", msg)
        _tell(ready_fd, f"error: {msg}")
        if lock is not None:
            os.close(lock)
        if metrics is not None:
            metrics.stop()
        return 1
    asm.metrics = metrics
    if shim is not None:
        shim.set_rules(direct_align=fs.DIRECT_IO_ALIGN, file_caps=fs.FILE_CAPS,
                       first_fast_fh=fs.FAST_OPEN_FIRST_FH)
        shim.set_fallocate_handler(asm.ops.fallocate_sync)
        asm.ops.reply_fallocate = shim.fallocate_reply
        shim.set_write_handlers(asm.ops.write_plan, asm.ops.write_done)
        shim.want_passthrough(s.passthrough)
        shim.want_front_thread(s.passthrough and (s.fast_open or s.front_reads))
        shim.set_opened_handler(asm.ops.pt.fast_opened)
        shim.set_kill_handler(asm.ops.kill_suidgid, write=fs.Kill.WRITE,
                              truncate=fs.Kill.TRUNCATE, chown=fs.Kill.CHOWN)
        hot_capacity = shim.hot_limit(s.fast_open_files)
        if s.passthrough:
            asm.ops.pt.use(shim, hot_capacity)
        shim.set_no_capabilities(not asm.ns.security_xattrs)
        asm.ns.on_security_xattr = lambda: shim.set_no_capabilities(False)
    options = set(pyfuse3.default_options)
    options |= {"fsname=kvfs", "subtype=kvfs"}
    if s.allow_other:
        options.add("allow_other")
    if s.debug:
        options.add("debug")
    real_mountpoint = os.path.realpath(s.mountpoint)  # (not once mounted: see _fuse_mount_dev)
    try:
        pyfuse3.init(asm.ops, s.mountpoint, options)
    except RuntimeError as exc:
        asm.close()
        _tell(ready_fd, f"error: mounting {s.mountpoint} failed: {exc}")
        os.close(lock)
        if metrics is not None:
            metrics.stop()
        return 1
    front = shim is not None and shim.front_thread()
    # (dram_verify=open: every open checks the file again, none is answered by the front)
    asm.ops.pt.serve_opens(shim if front and s.fast_open and s.dram_verify != "open" else None,
                           _fuse_mount_dev(real_mountpoint))
    if front:
        if s.front_reads:
            shim.set_read_handler(asm.ops.front_read, asm.store.cs)
            asm.store.through.serve(shim)
    log.info("mounted %s (DRAM %s in %s, NVMe %s in %s, chunk %s, fallocate %s)",
             s.mountpoint, format_size(s.dram_size), s.dram_dir, format_size(s.nvme_size),
             s.nvme_dir, format_size(asm.store.cs),
             "on" if shim is not None and shim.active() else "off")
    _tell(ready_fd, "ok")
    _notify_systemd(b"READY=1")
    code = 0
    profile = from_environment()
    try:
        trio.run(asm.run, instruments=[profile] if profile else [])
    except BaseException:
        log.exception("daemon failed")
        code = 1
    finally:
        if profile is not None:
            profile.write()
        pyfuse3.close(unmount=True)
        if metrics is not None:
            metrics.stop()
        try:
            asm.close()
        finally:
            verdict = _unmount_verdict(s, asm.left_in_dram if code == 0 else None)
            if verdict:
                log.error("unmount: %s", verdict)
                _say_in_lock(lock, verdict)
            os.close(lock)
    log.info("unmounted %s", s.mountpoint)
    return 1 if code or asm.left_in_dram else 0


def _unmount_verdict(s: Settings, left: int | None) -> str:
    """Why the unmount was not clean (*left* bytes only in DRAM, or None: the daemon
    failed), or "" if it was."""
    if left is None:
        return (f"the daemon failed while serving {s.mountpoint} (see its log); what it "
                f"could not write back is kept in {s.dram_dir}")
    if left:
        return (f"{format_size(left)} could not be written back to {s.nvme_dir} (the NVMe "
                f"tier is full or failing: see the log). They are kept in {s.dram_dir}, "
                f"which survives until a reboot: free space there and mount the same "
                f"directories again to write them back")
    return ""


def _say_in_lock(lock: int, verdict: str) -> None:
    """Leave *verdict* in the lock file, where `kvfs umount` (which waits for the daemon to
    exit) and the next mount read it. Not a file of its own: on a full filesystem, making
    one fails, while the lock file's first block was allocated when the pid went in."""
    data = f"{UNCLEAN_PREFIX}{verdict}\n".encode()[:4096]
    try:
        os.pwrite(lock, data, 0)
        os.ftruncate(lock, len(data))
    except OSError as exc:
        log.error("cannot record the unclean unmount in the lock file: %s", exc)


UNCLEAN_PREFIX = "unclean unmount: "


def _tell(fd: int | None, msg: str) -> None:
    if fd is None:
        if msg.startswith("error"):
            sys.stderr.write(f"kvfs: {msg[7:]}\n")
        return
    os.write(fd, msg.encode())
    os.close(fd)


def _reason(exc: Exception) -> str:
    """Why the tiers could not be opened, in one line for the operator."""
    if isinstance(exc, (ConfigError, MountError, FormatError)):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename:
        why = f"{exc.filename}: {exc.strerror or exc}"
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            why += (" (the daemon must be able to read and write every file in its tier "
                    "directories: check their owner, mode, attributes (lsattr) and mount)")
        return why
    return repr(exc)


def _lock(nvme_dir: str) -> int:
    """One daemon per NVMe directory: a second mount of the same store would corrupt it."""
    os.makedirs(nvme_dir, exist_ok=True)
    fd = os.open(os.path.join(nvme_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise MountError(f"{nvme_dir} is in use by another kvfs daemon") from None
        raise
    last = os.pread(fd, 4096, 0).decode(errors="replace")
    if last.startswith(UNCLEAN_PREFIX):
        log.warning("the last %s", last.strip())
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _notify_systemd(msg: bytes) -> None:
    """sd_notify without libsystemd: Type=notify units learn when the mount is ready."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(msg, addr)
        except OSError as exc:
            log.warning("systemd notification failed: %s", exc)

