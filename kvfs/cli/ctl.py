"""`kvfsctl`: ask a mounted kvfs how it is doing.

    kvfsctl status MOUNTPOINT [--json]     tiers, capacities, chunk counts, hit counters
    kvfsctl where PATH... [-r] [--chunks] [--json]
                                           files and directories (-r: recursively): the
                                           tiers of each file's chunks, and a total
    kvfsctl prefetch PATH...               stage files in DRAM: they will be read soon
    kvfsctl top MOUNTPOINT [--interval S] [--count N]
                                           a live view: rates per tier, hit rate,
                                           prefetch accuracy, GC, every S seconds

It talks to the daemon through virtual xattrs on the mount (see kvfs/control.py), so it works
wherever the mount is visible.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time

from kvfs.config import format_size


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
    if exc.errno == errno.ENOTCONN:
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
    if r.get("read_ahead_chunks"):
        print(f"read-through files: {r['read_ahead_chunks']} NVMe chunks read ahead into "
              f"memory, {r.get('read_ahead_used_chunks', 0)} of them read; "
              f"{r.get('read_ahead_front_reads', 0)} READs answered from them by the front "
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
