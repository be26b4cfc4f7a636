"""`kvfsctl`: ask a mounted kvfs how it is doing.

    kvfsctl status MOUNTPOINT [--json]     tiers, capacities, chunk counts, hit counters
    kvfsctl where PATH... [-r] [--chunks] [--json]
                                           files and directories (-r: recursively): the
                                           tiers of each file's chunks, and a total
    kvfsctl prefetch PATH...               stage files in DRAM: they will be read soon
    kvfsctl top MOUNTPOINT [--interval S] [--count N]
                                           a live view: rates per tier, hit rate,
                                           prefetch accuracy, GC, every S seconds
  For root and the mount's owner only:
    kvfsctl pin PATH... [-r]               keep files in DRAM (until unpinned or deleted)
    kvfsctl unpin PATH... [-r]
    kvfsctl demote PATH... [-r]            write back and drop the files' DRAM copies now
    kvfsctl evict PATH... [-r]             the same (drop the DRAM copies, dirty ones
                                           written back first)
    kvfsctl scrub PATH [--repair] [--json] check every copy of every chunk against its
                                           checksum; exit 1 if damage was found
    kvfsctl trace start FILE [MOUNTPOINT]  record the mount's opens and creates in FILE (an
                                           absolute path outside the mount; MOUNTPOINT: the
                                           kvfs mount FILE... default: the current directory)
                                           in Mooncake's trace format (tools/trace_replay.py
                                           replays it)
    kvfsctl trace stop [MOUNTPOINT]        stop recording; FILE is complete
    kvfsctl config set KEY VALUE [MOUNTPOINT]
                                           change a setting that may change while mounted
                                           (kvfs/liveconfig.py), until the unmount
  For anyone:
    kvfsctl config list [MOUNTPOINT]       the mount's settings, those that may change marked
    kvfsctl config get KEY [MOUNTPOINT]    one setting's value

It talks to the daemon through virtual xattrs on the mount (see kvfs/control.py), so it works
wherever the mount is visible.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import sys
import time

from kvfs.config import ConfigError, Settings, apply_options, format_size

XATTR_SIZE_MAX = 65536
# What a call into a mount whose daemon is gone fails with: ENOTCONN once the kernel knows,
# ECONNABORTED for a request the daemon had taken and died in the middle of.
DAEMON_GONE = (errno.ENOTCONN, errno.ECONNABORTED)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.getxattr.restype = ctypes.c_ssize_t
_libc.getxattr.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t)


def get_status(mountpoint: str) -> dict:
    return json.loads(_getxattr(mountpoint, "user.kvfs.status"))


def get_where(path: str) -> dict:
    out = json.loads(_getxattr(path, "user.kvfs.where"))
    while out["next"] is not None:
        page = json.loads(_getxattr(path, f"user.kvfs.where.{out['next']}"))
        out["chunks"].extend(page["chunks"])
        out["next"] = page["next"]
    return out


class CtlError(Exception):
    """What went wrong with one path, in one line for the operator."""


def _getxattr(path: str, name: str) -> bytes:
    try:
        return os.getxattr(path, name)
    except OSError as exc:
        raise CtlError(_why(path, exc)) from None


def _why(path: str, exc: OSError) -> str:
    if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP, errno.ENOTSUP):
        return f"{path} is not on a kvfs mount"
    if exc.errno in DAEMON_GONE:
        return (f"{path}: the daemon of this kvfs mount is gone (a crash?): clear it with "
                f"`kvfs umount MOUNTPOINT`, then mount again")
    return f"{path}: {exc.strerror}"


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
    return value


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "-"


def print_status(st: dict) -> None:
    print(f"{'tier':6} {'capacity':>12} {'used':>12} {'logical':>12} {'chunks':>10} "
          f"{'compression':>11}")
    for name, t in st["tiers"].items():
        print(f"{name:6} {format_size(t['capacity_bytes']):>12} {format_size(t['used_bytes']):>12}"
              f" {format_size(t['logical_bytes']):>12} {t['chunks']:>10} "
              f"{_ratio(t['logical_bytes'], t['used_bytes']):>11}")
    r = st["reads"]
    total = r["chunks_from_dram"] + r["chunks_from_nvme"]
    hit = f"{100 * r['chunks_from_dram'] / total:.1f}%" if total else "-"
    print(f"reads: {r['chunks_from_dram']} chunks from DRAM, {r['chunks_from_nvme']} from NVMe "
          f"(DRAM hit rate {hit} of chunks read), {r['checksum_errors']} checksum errors, "
          f"{r.get('dram_checked_chunks', 0)} DRAM copies checked")
    if "requests_from_dram" in r:
        print(f"READ requests served by the daemon, per chunk they touched: "
              f"{r['requests_from_dram']} from DRAM, {r['requests_from_nvme']} from NVMe, "
              f"{r['requests_from_holes']} from holes")
    lat = [f"{name} p50 {_percentile(r.get(f'{name}_latency_us_log2_histogram'), 0.5)}"
           f" p99 {_percentile(r.get(f'{name}_latency_us_log2_histogram'), 0.99)}"
           for name in ("dram", "nvme") if f"{name}_latency_us_log2_histogram" in r]
    if lat:
        print(f"read latency (us, log2 buckets): {', '.join(lat)}")
    pt = st.get("passthrough")
    if pt and pt.get("opens"):
        print(f"passthrough: {pt['opens']} opens read by the kernel from DRAM files, "
              f"{pt.get('fast_opens', 0)} of them answered by the front thread "
              f"({pt.get('fast_open_files', 0)} files ready for it; "
              f"{pt.get('fast_open_parked', 0)} opens waited there for a prefetch)")
    if r.get("read_through_buffered_chunks"):
        print(f"read-through files: {r['read_through_buffered_chunks']} NVMe chunks read "
              f"ahead into memory, {r.get('read_through_buffer_used_chunks', 0)} of them read; "
              f"{r.get('read_through_front_reads', 0)} READs answered from them by the front "
              f"thread")
    pod = st.get("pod")
    if pod:
        print(f"pod {pod['name']!r} at {pod['master']}: "
              f"{'connected' if pod['connected'] else 'not connected'}, "
              f"{pod['members'] if pod['members'] is not None else '?'} members; "
              f"{pod['published_files']} files published ({format_size(pod['published_bytes'])}),"
              f" {pod['dropped']} dropped; {pod['lookups']} lookups, {pod['hits']} hits "
              f"(p50 {pod['lookup_p50_us']} us, p99 {pod['lookup_p99_us']} us); "
              f"{r.get('chunks_from_pod', 0)} chunks fetched ({format_size(pod['fetched_bytes'])});"
              f" {pod['errors']} errors, {pod['timeouts']} timeouts, {pod['damaged']} damaged")
    pf = st.get("prefetch")
    if pf:
        used, issued = pf.get("used_chunks", 0), pf.get("issued_chunks", 0)
        state = "" if pf.get("enabled", True) else " (prediction off)"
        print(f"prefetch{state}: {issued} issued, {used} used, {pf.get('late_chunks', 0)} late, "
              f"{pf.get('wasted_chunks', 0)} wasted (accuracy "
              f"{f'{100 * used / issued:.1f}%' if issued else '-'}, DRAM hit rate {hit} of "
              f"chunks read)")
        if pf.get("enabled"):
            lat = pf.get("fetch_latency_us")
            print(f"prefetch depth {pf.get('depth_chunks')} chunks, lead {pf.get('lead_chunks')},"
                  f" NVMe fetch latency {'-' if lat is None else f'{lat} us'}, "
                  f"{pf.get('resident_unread_chunks', 0)} staged unread")
    m = st["moves"]
    print(f"moves: {m['demotions']} demotions, {m['writebacks']} writebacks, "
          f"{m['promotions']} promotions")
    g = st["gc"]
    print(f"nvme writes: user {format_size(g['user_bytes_written'])}, gc "
          f"{format_size(g['gc_bytes_written'])}, write amplification {g['write_amplification']}")
    if st.get("streams"):
        print(f"  {'stream':8} {'hint':8} {'segments':>8} {'live':>10} {'dead':>10} "
              f"{'user written':>12} {'gc copied out':>13} {'WA':>7}")
        for name, s in st["streams"].items():
            hint = (s["write_hint"] or "-") + ("" if s["hint_accepted"] is not False else "!")
            wa = "-" if s["write_amplification"] is None else f"{s['write_amplification']:.3f}"
            print(f"  {name:8} {hint:8} {s['segments']:>8} {format_size(s['live_bytes']):>10} "
                  f"{format_size(s['dead_bytes']):>10} "
                  f"{format_size(s['user_bytes_written']):>12} "
                  f"{format_size(s['gc_bytes_copied_out']):>13} {wa:>7}")
        h = g.get("write_hints", {})
        print(f"  write-life hints kept by the kernel: {h.get('kernel_accepted')}; device "
              f"write streams: {h.get('device_write_streams')}; discard: "
              f"{h.get('device_discard')}")
    if "evictions" in st:
        e = st["evictions"]
        print(f"cache-mode evictions: {e['files']} files, {format_size(e['bytes'])}")
    print(f"files: {st['files']}, uptime {st['uptime_s']}s")


def _percentile(hist: list[int] | None, q: float) -> str:
    """Upper bound of the log2 bucket holding quantile *q* (bucket i: < 2**i us)."""
    total = sum(hist or ())
    if not total:
        return "-"
    seen = 0
    for i, n in enumerate(hist):
        seen += n
        if seen >= q * total:
            return f"<{1 << i}"
    return "-"


def prefetch(paths: list[str]) -> int:
    """Set user.kvfs.prefetch on each path; returns the exit code."""
    code = 0
    for path in paths:
        try:
            os.setxattr(path, "user.kvfs.prefetch", b"1")
        except OSError as exc:
            print(f"kvfsctl: {path}: {exc.strerror}", file=sys.stderr)
            code = 1
    return code


CHANGING = {"pin": "user.kvfs.pin", "unpin": "user.kvfs.pin", "demote": "user.kvfs.demote",
            "evict": "user.kvfs.evict"}


def change(command: str, paths: list[str], recursive: bool) -> int:
    """pin, unpin, demote or evict every file under *paths*; returns the exit code (1 if
    any file failed, each failure one line)."""
    code = 0
    files = files_under(paths, recursive)
    for path in files:
        try:
            if command == "unpin":
                try:
                    os.removexattr(path, CHANGING[command])
                except OSError as exc:
                    if exc.errno != errno.ENODATA:  # (not pinned: nothing to do)
                        raise
            else:
                os.setxattr(path, CHANGING[command], b"1")
        except OSError as exc:
            print(f"kvfsctl: {path}: {_change_failed(command, path, exc)}", file=sys.stderr)
            code = 1
            if exc.errno == errno.EPERM or exc.errno in DAEMON_GONE:
                break  # the same for every other file
    return code


def _change_failed(command: str, path: str, exc: OSError) -> str:
    if exc.errno == errno.EPERM:
        return f"{command} is for root and the user who mounted kvfs only"
    if exc.errno == errno.ENOSPC and command == "pin":
        try:
            dram = get_status(path)["tiers"]["dram"]
            size = format_size(os.stat(path).st_size)
        except (CtlError, OSError):
            return "does not fit in the DRAM tier's room for pinned files"
        return (f"does not fit: pinned files may hold {format_size(dram['pin_limit_bytes'])} "
                f"of DRAM, {format_size(dram['pinned_bytes'])} is pinned, this file is {size}")
    if exc.errno == errno.EBUSY:
        try:
            os.getxattr(path, "user.kvfs.pin")
            return f"pinned: `kvfsctl unpin` it first to {command} it"
        except OSError:
            return ("in use: the kernel reads or writes its DRAM copy itself (passthrough); "
                    "try again once it is closed")
    return _why(path, exc)


def scrub(path: str, repair: bool, as_json: bool) -> int:
    """Check every copy of every chunk of the files under *path*; 0 clean, 1 damage."""
    files, seen = [], set()
    for f in files_under([path], True):
        try:
            st = os.stat(f, follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile
        if st.st_ino not in seen:  # hard links: once
            seen.add(st.st_ino)
            files.append((f, st.st_size))
    name = "user.kvfs.scrub.repair" if repair else "user.kvfs.scrub"
    total_bytes = sum(size for _, size in files) or 1
    done_bytes = checked = unchecked = 0
    damaged: list[dict] = []
    skipped: list[str] = []
    progress = Progress()
    for i, (f, size) in enumerate(files):
        start: int | None = 0
        while start is not None:
            progress.show(f"scrub: {i}/{len(files)} files, "
                          f"{100 * done_bytes / total_bytes:.0f}% of "
                          f"{format_size(total_bytes)}, {checked} copies checked, "
                          f"{len(damaged)} damaged")
            try:
                page = json.loads(getxattr_once(f, f"{name}.{start}" if start else name))
            except OSError as exc:
                if exc.errno == errno.EPERM:
                    progress.end()
                    raise CtlError(f"{f}: scrub is for root and the user who mounted kvfs "
                                   f"only") from None
                if exc.errno in DAEMON_GONE:
                    progress.end()
                    raise CtlError(_why(f, exc)) from None
                if exc.errno != errno.ENOENT:  # (deleted meanwhile: nothing to check)
                    skipped.append(f"{f}: {exc.strerror}")
                break
            checked += page["checked"]
            unchecked += page["unchecked"]
            damaged += [{"path": f, **d} for d in page["damage"]]
            start = page["next"]
        done_bytes += size
    progress.end()
    files_damaged = len({d["path"] for d in damaged})
    if as_json:
        print(json.dumps({"files": len(files), "checked_copies": checked,
                          "unchecked_copies": unchecked, "damage": damaged,
                          "skipped": skipped}, indent=1))
    else:
        for d in damaged:
            fix = f" [{d['repair']}]" if d["repair"] else ""
            print(f"{d['path']}: chunk {d['chunk']}, {d['tier']}: {d['error']}{fix}")
        for s in skipped:
            print(f"not checked: {s}")
        print(f"scrub: {len(files)} files, {checked} copies checked ({unchecked} being "
              f"written, not checked), {len(damaged)} damaged in {files_damaged} files")
    return 1 if damaged else 0


def getxattr_once(path: str, name: str) -> bytes:
    """getxattr(2) with a buffer of the largest size an xattr may have. os.getxattr asks
    with 128 bytes first and again with more if the value is longer: the daemon answers
    both, and a scrub page (with --repair, its repairs) must be done once."""
    buf = ctypes.create_string_buffer(XATTR_SIZE_MAX)
    n = _libc.getxattr(os.fsencode(path), name.encode(), buf, XATTR_SIZE_MAX)
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return buf.raw[:n]


class Progress:
    """One progress line on stderr: rewritten in place on a terminal, else a line every
    PROGRESS_EVERY seconds."""

    PROGRESS_EVERY = 10.0

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = time.monotonic()
        self.shown = False

    def show(self, text: str) -> None:
        now = time.monotonic()
        if self.tty and now - self.last >= 0.2:
            sys.stderr.write(f"\r{text}\033[K")
            self.shown = True
        elif not self.tty and now - self.last >= self.PROGRESS_EVERY:
            sys.stderr.write(text + "\n")
        else:
            return
        sys.stderr.flush()
        self.last = now

    def end(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.shown = False


def print_where(w: dict) -> None:
    print(f"inode {w['ino']}, {w['size']} bytes, chunk size {format_size(w['chunk_size'])}")
    for c in w["chunks"]:
        flags = " dirty" if c["dirty"] else ""
        flags += " LOST" if c["lost"] else ""
        print(f"  chunk {c['chunk']:>8}: {'+'.join(c['tiers']) or '-':10} "
              f"{c['raw_len']:>9} bytes, stored {c['stored_len']:>9}{flags}")


SUMMARY_KEYS = ("chunks", "dram", "nvme", "both", "dirty", "lost", "pod")


def summarize(chunks: list[dict]) -> dict:
    """Chunk counts of one file: all, with a DRAM copy, with an NVMe copy, with both,
    dirty (in DRAM only, not yet written back), lost, and only in the pod (not fetched)."""
    out = dict.fromkeys(SUMMARY_KEYS, 0)
    for c in chunks:
        out["chunks"] += 1
        dram, nvme = "dram" in c["tiers"], "nvme" in c["tiers"]
        out["dram"] += dram
        out["nvme"] += nvme
        out["both"] += dram and nvme
        out["dirty"] += bool(c["dirty"])
        out["lost"] += bool(c["lost"])
        out["pod"] += "pod" in c["tiers"]
    return out


def files_under(paths: list[str], recursive: bool) -> list[str]:
    """The regular files *paths* name: files as given, the files in a directory (and in
    its subdirectories with *recursive*); symbolic links inside directories are not
    followed. Each path must be on a kvfs mount (CtlError otherwise)."""
    out: list[str] = []
    for path in paths:
        _getxattr(path, "user.kvfs.status")  # on a kvfs mount, its daemon alive?
        if not os.path.isdir(path):
            out.append(path)
            continue
        stack = [path]
        while stack:
            d = stack.pop()
            try:
                entries = sorted(os.scandir(d), key=lambda e: e.name)
            except OSError as exc:
                raise CtlError(_why(d, exc)) from None
            subdirs = []
            for e in entries:
                if e.is_file(follow_symlinks=False):
                    out.append(e.path)
                elif recursive and e.is_dir(follow_symlinks=False):
                    subdirs.append(e.path)
            stack.extend(reversed(subdirs))  # depth first, in name order
    return out


def where_many(paths: list[str], recursive: bool) -> tuple[list[dict], list[str]]:
    """`get_where` of every file under *paths*, each with its path and summary; and the
    errors met on files that went away or could not be read meanwhile."""
    files, errors = [], []
    for path in files_under(paths, recursive):
        try:
            w = get_where(path)
        except CtlError as exc:
            errors.append(str(exc))
            continue
        files.append({"path": path, **w, "summary": summarize(w["chunks"])})
    return files, errors


def print_where_summary(files: list[dict], chunks: bool) -> None:
    print(f"{'size':>10} {'chunks':>7} {'dram':>7} {'nvme':>7} {'both':>7} {'dirty':>7} "
          f"{'lost':>5}  path")
    total = dict.fromkeys(SUMMARY_KEYS, 0)
    size = 0
    for f in files:
        s = f["summary"]
        print(f"{format_size(f['size']):>10} {s['chunks']:>7} {s['dram']:>7} {s['nvme']:>7} "
              f"{s['both']:>7} {s['dirty']:>7} {s['lost']:>5}  {f['path']}")
        if chunks:
            print_where(f)
        for k in SUMMARY_KEYS:
            total[k] += s[k]
        size += f["size"]
    print(f"total: {len(files)} files, {format_size(size)}, {total['chunks']} chunks: "
          f"{total['dram']} in DRAM, {total['nvme']} on NVMe ({total['both']} in both), "
          f"{total['dirty']} dirty, {total['lost']} lost"
          + (f", {total['pod']} only in the pod" if total["pod"] else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfsctl", description="inspect a mounted kvfs")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", help="per-tier capacity, use, chunk counts and hit counters")
    p.add_argument("mountpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("where", help="the tiers of files' chunks: per file and a total")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="files, and directories (the files in them)")
    p.add_argument("-r", "--recursive", action="store_true",
                   help="the files in directories' subdirectories too")
    p.add_argument("--chunks", action="store_true",
                   help="each chunk of each file too (the default for one file)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (one file: its chunks; else the files and "
                        "a total)")
    p = sub.add_parser("prefetch", help="stage files in DRAM ahead of reading them")
    p.add_argument("paths", nargs="+", metavar="PATH")
    p = sub.add_parser("top", help="a live view: rates per tier, hit rate, prefetch, GC")
    p.add_argument("mountpoint")
    p.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS",
                   help="seconds between views (default %(default)s)")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="stop after N views (default: until interrupted)")
    for name, what in (("pin", "keep files in DRAM until unpinned or deleted"),
                       ("unpin", "let pinned files leave DRAM again"),
                       ("demote", "write back and drop the files' DRAM copies now"),
                       ("evict", "drop the files' DRAM copies (dirty ones written back "
                                 "first)")):
        p = sub.add_parser(name, help=f"{what} (root and the mount's owner)")
        p.add_argument("paths", nargs="+", metavar="PATH",
                       help="files, and directories (the files in them)")
        p.add_argument("-r", "--recursive", action="store_true",
                       help="the files in directories' subdirectories too")
    p = sub.add_parser("scrub", help="check every copy of every chunk against its checksum "
                                     "(root and the mount's owner)")
    p.add_argument("mountpoint", metavar="PATH",
                   help="the mount, or a directory or file on it")
    p.add_argument("--repair", action="store_true",
                   help="drop damaged copies that have a good one; mark lost the chunks "
                        "that have none (they read as EIO)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("trace", help="record the mount's accesses in Mooncake's trace format "
                                     "(root and the mount's owner)")
    p.add_argument("action", choices=("start", "stop", "status"))
    p.add_argument("args", nargs="*", metavar="FILE MOUNTPOINT",
                   help="start: the trace file, then the mount (default: .); stop, status: "
                        "the mount (default: .)")
    p = sub.add_parser("config", help="the mount's settings; set: change one that may change "
                                      "while mounted (root and the mount's owner)")
    p.add_argument("action", choices=("list", "get", "set"))
    p.add_argument("args", nargs="*", metavar="KEY VALUE MOUNTPOINT",
                   help="list: [MOUNTPOINT]; get: KEY [MOUNTPOINT]; set: KEY VALUE "
                        "[MOUNTPOINT] (MOUNTPOINT default: .)")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except CtlError as exc:
        print(f"kvfsctl: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvfsctl status M | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _run(args: argparse.Namespace) -> int:
    if args.command == "status":
        st = get_status(args.mountpoint)
        print(json.dumps(st, indent=1)) if args.json else print_status(st)
    elif args.command == "where":
        return where(args)
    elif args.command == "prefetch":
        return prefetch(args.paths)
    elif args.command == "top":
        return top(args.mountpoint, args.interval, args.count)
    elif args.command in CHANGING:
        return change(args.command, args.paths, args.recursive)
    elif args.command == "scrub":
        return scrub(args.mountpoint, args.repair, args.json)
    elif args.command == "trace":
        return trace(args.action, args.args)
    elif args.command == "config":
        return config(args.action, args.args)
    return 0


def config(action: str, args: list[str]) -> int:
    """`kvfsctl config list [MOUNT]`, `get KEY [MOUNT]`, `set KEY VALUE [MOUNT]`."""
    want = {"list": 1, "get": 2, "set": 3}[action]
    if not want - 1 <= len(args) <= want:
        raise CtlError(f"config {action}: " + ("KEY VALUE " if action == "set" else "KEY "
                                               if action == "get" else "") + "[MOUNTPOINT]")
    mount = args[want - 1] if len(args) == want else "."
    values = json.loads(_getxattr(mount, "user.kvfs.config"))
    settings, live = values["settings"], values["live"]
    if action == "list":
        width = max(map(len, settings))
        for key, value in settings.items():
            print(f"{key:{width}} = {_shown(value)}"
                  + ("  (may change while mounted)" if key in live else ""))
        return 0
    key = args[0]
    if key not in settings and action == "get":
        raise CtlError(f"{key}: no such setting (`kvfsctl config list` shows them)")
    if action == "get":
        print(_shown(settings[key]))
        return 0
    if key not in live:
        raise CtlError(f"{key}: " + ("cannot change while mounted (mount again with -o "
                                     f"{key}=...); these may: {', '.join(live)}"
                                     if key in settings else "no such setting"))
    try:
        os.setxattr(mount, f"user.kvfs.config.{key}", os.fsencode(args[1]))
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise CtlError("config set is for root and the user who mounted kvfs "
                           "only") from None
        if exc.errno == errno.EINVAL:
            raise CtlError(f"{key}: {args[1]!r} is not a value it may take"
                           + _why_not(settings, key, args[1])) from None
        raise CtlError(_why(mount, exc)) from None
    now = json.loads(_getxattr(mount, f"user.kvfs.config.{key}"))
    print(f"{key} = {_shown(now)} until the unmount")
    return 0


def _shown(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _why_not(settings: dict, key: str, text: str) -> str:
    """Why the daemon refused *key*=*text* (the checks of `-o`), or nothing if we cannot
    tell (our copy of the settings lacks the tiers' directories of an unprivileged user)."""
    s = Settings(**{k: v for k, v in settings.items() if k in Settings.__dataclass_fields__})
    try:
        apply_options(s, f"{key}={text}")
        s.resolve()
    except ConfigError as exc:
        return f": {exc}"
    return ""


def trace(action: str, args: list[str]) -> int:
    """`kvfsctl trace start FILE [MOUNT]`, `stop [MOUNT]`, `status [MOUNT]`."""
    want = 2 if action == "start" else 1
    if not want - 1 <= len(args) <= want:
        raise CtlError(f"trace {action}: " + ("FILE [MOUNTPOINT]" if action == "start"
                                              else "[MOUNTPOINT]"))
    mount = args[want - 1] if len(args) == want else "."
    try:
        if action == "status":
            print(os.getxattr(mount, "user.kvfs.trace").decode())
            return 0
        if action == "start":
            path = os.path.realpath(args[0])
            if os.stat(os.path.dirname(path)).st_dev == os.stat(mount).st_dev:
                raise CtlError(f"{args[0]}: the trace file must be outside the mount")
            os.setxattr(mount, "user.kvfs.trace.start", os.fsencode(path))
            print(f"recording {mount}'s accesses in {path}; `kvfsctl trace stop` ends it")
        else:
            done = json.loads(os.getxattr(mount, "user.kvfs.trace"))
            os.setxattr(mount, "user.kvfs.trace.stop", b"1")
            print(f"{done['file']}: recording stopped" + (
                f"; writing it failed ({done['error']}): it holds the first "
                f"{done['requests']} requests only" if done.get("error") else ""))
    except OSError as exc:
        if exc.errno == errno.ENODATA and action != "start":
            raise CtlError(f"{mount}: no trace is being recorded") from None
        if exc.errno == errno.EBUSY:
            raise CtlError(f"{mount}: a trace is being recorded already") from None
        if exc.errno in (errno.EPERM, errno.EACCES):
            raise CtlError("trace is for root and the user who mounted kvfs only") from None
        raise CtlError(_why(exc.filename or mount, exc)) from None
    return 0


def top(mountpoint: str, interval: float, count: int | None) -> int:
    """Print a view of the mount every *interval* seconds (*count* times, or until
    interrupted), the rates from the difference of two status snapshots."""
    clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
    before, t0 = get_status(mountpoint), time.monotonic()
    shown = 0
    try:
        while count is None or shown < count:
            time.sleep(max(0.0, t0 + interval - time.monotonic()))
            now, t1 = get_status(mountpoint), time.monotonic()
            sys.stdout.write(clear + top_frame(mountpoint, before, now, t1 - t0) + "\n")
            sys.stdout.flush()
            before, t0 = now, t1
            shown += 1
    except KeyboardInterrupt:
        return 0
    return 0


def top_frame(mountpoint: str, a: dict, b: dict, dt: float) -> str:
    """One view of `kvfsctl top`: the state in status *b*, the rates from *a* to *b* (*dt*
    seconds apart)."""
    def rate(section: str, key: str) -> float:
        return (b[section].get(key, 0) - a[section].get(key, 0)) / dt if dt > 0 else 0.0

    def pct(num: float, den: float) -> str:
        return f"{100 * num / den:.1f}%" if den else "-"

    r, rb = b["reads"], {k: rate("reads", k) for k in ("chunks_from_dram", "chunks_from_nvme")}
    g = b["gc"]
    user, gc = rate("gc", "user_bytes_written"), rate("gc", "gc_bytes_written")
    lines = [f"kvfs {mountpoint}  {time.strftime('%H:%M:%S')}  every {dt:.1f}s, "
             f"up {b['uptime_s']:.0f}s, {b['files']} files",
             f"{'tier':6} {'used':>11} {'capacity':>11} {'use':>6} {'chunks':>9} "
             f"{'reads/s':>9}  writes"]
    for name, t in b["tiers"].items():
        if name == "dram":
            writes = (f"dirty {format_size(t.get('dirty_bytes', 0))}, "
                      f"promoted {rate('moves', 'promotions'):.1f}/s, "
                      f"demoted {rate('moves', 'demotions'):.1f}/s")
        else:
            writes = (f"user {format_size(user)}/s, gc {format_size(gc)}/s, "
                      f"written back {rate('moves', 'writebacks'):.1f}/s")
        lines.append(f"{name:6} {format_size(t['used_bytes']):>11} "
                     f"{format_size(t['capacity_bytes']):>11} "
                     f"{pct(t['used_bytes'], t['capacity_bytes']):>6} {t['chunks']:>9} "
                     f"{rb.get(f'chunks_from_{name}', 0.0):>9.1f}  {writes}")
    hits, misses = rb["chunks_from_dram"], rb["chunks_from_nvme"]
    lines.append(f"DRAM hit rate (chunks read from DRAM / from DRAM or NVMe): "
                 f"{pct(hits, hits + misses)} now, "
                 f"{pct(r['chunks_from_dram'], r['chunks_from_dram'] + r['chunks_from_nvme'])}"
                 f" since mount; {r['checksum_errors']} checksum errors")
    pf = b.get("prefetch")
    if pf:
        issued, used = rate("prefetch", "issued_chunks"), rate("prefetch", "used_chunks")
        lines.append(f"prefetch: {issued:.1f} issued/s, {used:.1f} used/s, "
                     f"{rate('prefetch', 'late_chunks'):.1f} late/s, "
                     f"{rate('prefetch', 'wasted_chunks'):.1f} wasted/s; accuracy (used / "
                     f"issued) {pct(used, issued)} now, "
                     f"{pct(pf.get('used_chunks', 0), pf.get('issued_chunks', 0))} since mount")
    wa_now = f"{(user + gc) / user:.2f}" if user else "-"
    lines.append(f"gc: {format_size(gc)}/s copied; write amplification {wa_now} now, "
                 f"{g['write_amplification']} since mount")
    return "\n".join(lines)


def where(args: argparse.Namespace) -> int:
    one = len(args.paths) == 1 and not os.path.isdir(args.paths[0])
    files, errors = where_many(args.paths, args.recursive)
    if one and files:  # one file: its chunks, as before (with its summary)
        print(json.dumps(files[0], indent=1)) if args.json else print_where_summary(files, True)
    elif args.json:
        total = {k: sum(f["summary"][k] for f in files) for k in SUMMARY_KEYS}
        total |= {"files": len(files), "size": sum(f["size"] for f in files)}
        print(json.dumps({"files": files, "total": total}, indent=1))
    else:
        print_where_summary(files, args.chunks)
    for e in errors:
        print(f"kvfsctl: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
