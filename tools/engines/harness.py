#!/usr/bin/env python3
"""Run one engine's KV-cache rounds on kvfs, tmpfs and a plain ext4 directory.

Runs with any Python 3.11 (no kvfs import: kvfs is driven through its command, `kvfs` on
PATH unless KVFS_CMD says otherwise, e.g. KVFS_CMD="python -m kvfs" with PYTHONPATH set).
The engine's own code runs in its virtual environment, in `ROUND_SCRIPT` (tools/engines/
*_round.py), which must accept `--kv-dir DIR --model-dir DIR --round N --out FILE` and write
a JSON object: `tokens` (output token ids per prompt), `seconds` (the engine's store or load
work, with its compute), `io_seconds` (where the round script can tell: the part spent in
the engine's storage calls), `hit` (the engine's own log or counter says the KV came from
the files) and `evidence` (that log line or counter).

Per target directory:
- round 1 (store): an empty KV directory; the engine computes and writes its KV files;
- kvfs only: clean unmount, DRAM tier deleted, remount; every chunk of every KV file must
  then be on the NVMe tier and nowhere else;
- round 2 (load): the same prompts; must be a cache hit with the tokens of round 1;
- kvfs only: SIGKILL of the daemon, the dead mount detached, remount on the same tiers;
- round 3 (load): again a hit with identical tokens.
Before each load round on ext4 and kvfs the KV files (ext4) or the NVMe tier's files (kvfs)
are evicted from the page cache, so that they come from the disk, unless --keep-page-cache.
Only those files: a global drop_caches would also evict the model's weights, which llama.cpp
and transformers map lazily, and the engine would page them in during the timed round.

`--persistent` keeps one engine process for all rounds (LMCache's disk index lives only in
its process): the round script then reads a round number per line on stdin and writes one
JSON object per line on stdout. The engine's directory on the mount is then unmounted and
remounted under it; it must hold no file open between rounds.

Prints one JSON object (the summary) on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path


class HarnessError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


def evict_from_page_cache(root: Path) -> None:
    """Drop the cached pages of every file under *root* (written back first)."""
    os.sync()
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if not os.path.isfile(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def tree_facts(root: Path) -> dict:
    files = 0
    size = 0
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            files += 1
            size += st.st_size
    return {"files": files, "bytes": size}


def getxattr_json(path: Path | str, name: str) -> dict:
    return json.loads(os.getxattr(path, name))


def chunk_tiers(path: str) -> list[list[str]]:
    out = getxattr_json(path, "user.kvfs.where")
    tiers = [c["tiers"] for c in out["chunks"]]
    while out["next"] is not None:
        out = getxattr_json(path, f"user.kvfs.where.{out['next']}")
        tiers += [c["tiers"] for c in out["chunks"]]
    return tiers


@dataclass
class KvfsMount:
    """A kvfs mount at base/mnt with its NVMe tier in base/nvme and a DRAM tier in /dev/shm."""

    base: Path
    cmd: list[str]
    options: str
    path: Path = field(init=False)
    nvme_dir: Path = field(init=False)
    dram_dir: Path = field(init=False)
    log_file: Path = field(init=False)

    def __post_init__(self) -> None:
        self.path = self.base / "mnt"
        self.nvme_dir = self.base / "nvme"
        self.log_file = self.base / "kvfs.log"
        self.dram_dir = Path(f"/dev/shm/kvfs-engines-{uuid.uuid4().hex[:12]}")
        self.path.mkdir(parents=True, exist_ok=True)

    def _kvfs(self, *args: str, timeout: float = 300) -> None:
        r = subprocess.run([*self.cmd, *args], capture_output=True, text=True, cwd="/",
                           timeout=timeout)
        if r.returncode != 0:
            raise HarnessError(f"{shlex.join([*self.cmd, *args])} failed ({r.returncode}): "
                               f"{r.stderr.strip()}\n{self.log_tail()}")

    def mount(self) -> None:
        self._kvfs("mount", str(self.path), "--dram-dir", str(self.dram_dir), "--nvme-dir",
                   str(self.nvme_dir), "--log-file", str(self.log_file), "-o", self.options)
        if not mounted(self.path):
            raise HarnessError(f"kvfs mount returned but {self.path} is not mounted")

    def unmount(self) -> None:
        if mounted(self.path):
            self._kvfs("umount", str(self.path))

    def pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int((self.nvme_dir / "lock").read_text().strip() or 0) or None
        return None

    def kill(self) -> None:
        """SIGKILL the daemon and detach its dead mount; the tiers stay as the kill left them."""
        pid = self.pid()
        if pid is None:
            raise HarnessError("no daemon pid in the NVMe tier's lock file")
        os.kill(pid, signal.SIGKILL)
        for _ in range(500):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.01)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def new_dram_tier(self) -> None:
        shutil.rmtree(self.dram_dir, ignore_errors=True)
        self.dram_dir = Path(f"/dev/shm/kvfs-engines-{uuid.uuid4().hex[:12]}")

    def cpu_seconds(self) -> float:
        """CPU time the daemon has used (user + system)."""
        pid = self.pid()
        if pid is None:
            return 0.0
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def status(self) -> dict:
        return getxattr_json(self.path, "user.kvfs.status")

    def residency(self, root: Path) -> dict[str, int]:
        """Chunks per set of tiers over every file under *root*."""
        counts: dict[str, int] = {}
        for dirpath, _dirs, names in os.walk(root):
            for name in names:
                for tiers in chunk_tiers(os.path.join(dirpath, name)):
                    key = "+".join(tiers) or "none"
                    counts[key] = counts.get(key, 0) + 1
        return counts

    def log_tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.log_file.read_text().splitlines(keepends=True)[-n:])
        return ""

    def cleanup(self) -> None:
        try:
            self.unmount()
        except (HarnessError, subprocess.SubprocessError) as exc:
            log(f"clean unmount failed ({exc}); killing the daemon")
            with contextlib.suppress(HarnessError, OSError):
                self.kill()
        shutil.rmtree(self.dram_dir, ignore_errors=True)


class Engine:
    """Runs round scripts: one process per round, or one process for all (persistent)."""

    def __init__(self, python: str, script: str, model_dir: str, kv_dir: Path, work: Path,
                 persistent: bool, extra: list[str], timeout: float) -> None:
        self.argv = [python, script, "--model-dir", model_dir, "--kv-dir", str(kv_dir),
                     *extra]
        self.work = work
        self.persistent = persistent
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.stderr_path = work / "engine.log"
        # PYTHONPATH may point at a kvfs checkout (for KVFS_CMD): not the engine's business.
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def round(self, n: int) -> dict:
        t0 = time.perf_counter()
        if self.persistent:
            result = self._persistent_round(n)
        else:
            out = self.work / f"round{n}.json"
            with open(self.stderr_path, "a") as err:
                err.write(f"\n===== round {n} =====\n")
                err.flush()
                r = subprocess.run([*self.argv, "--round", str(n), "--out", str(out)],
                                   stdin=subprocess.DEVNULL, stdout=err, stderr=err, cwd="/",
                                   env=self.env, timeout=self.timeout)
            if r.returncode != 0:
                raise HarnessError(f"round {n} exited {r.returncode}:\n{self.log_tail()}")
            result = json.loads(out.read_text())
        result["process_seconds"] = round(time.perf_counter() - t0, 3)
        return result

    def _persistent_round(self, n: int) -> dict:
        if self.proc is None:
            err = open(self.stderr_path, "a")  # noqa: SIM115 - lives as long as the process
            self.proc = subprocess.Popen([*self.argv, "--persistent"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True,
                                         cwd="/", env=self.env)
            err.close()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise HarnessError(f"engine process exited ({self.proc.wait()}) in round {n}:\n"
                               f"{self.log_tail()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.stderr_path.read_text().splitlines(keepends=True)[-n:])
        return ""


def compare(reference: dict, result: dict, n: int) -> dict:
    same = result["tokens"] == reference["tokens"]
    summary = {"round": n, "seconds": result["seconds"], "io_seconds": result.get("io_seconds"),
               "process_seconds": result["process_seconds"], "hit": bool(result["hit"]),
               "evidence": result.get("evidence", ""), "tokens_identical": same}
    if not same:
        summary["tokens"] = result["tokens"]
    return summary


def run_target(kind: str, args: argparse.Namespace, work: Path) -> dict:
    """Rounds on one kind of directory: 'kvfs', 'tmpfs' or 'ext4'."""
    work.mkdir(parents=True, exist_ok=True)
    mount: KvfsMount | None = None
    if kind == "kvfs":
        mount = KvfsMount(work, shlex.split(args.kvfs_cmd), args.kvfs_options)
        mount.mount()
        kv_dir = mount.path / "kv"
    elif kind == "tmpfs":
        kv_dir = Path(f"/dev/shm/kvfs-engines-tmpfs-{uuid.uuid4().hex[:12]}")
    else:
        kv_dir = work / "ext4-kv"
    kv_dir.mkdir(parents=True)  # as an operator would; llama.cpp's slot path must exist
    engine = Engine(args.python, args.round_script, args.model_dir, kv_dir, work,
                    args.persistent, args.engine_arg, args.timeout)
    out: dict = {"target": kind, "kv_dir": str(kv_dir), "rounds": []}
    try:
        log(f"{args.name} on {kind}: round 1 (store) into {kv_dir}")
        cpu = mount.cpu_seconds() if mount is not None else 0.0
        first = engine.round(1)
        out["store"] = {"seconds": first["seconds"], "io_seconds": first.get("io_seconds"),
                        "process_seconds": first["process_seconds"],
                        "hit": bool(first["hit"]), "evidence": first.get("evidence", "")}
        if mount is not None:
            out["store"]["kvfs_daemon_cpu_seconds"] = round(mount.cpu_seconds() - cpu, 2)
        out["written"] = tree_facts(kv_dir)
        if out["written"]["files"] == 0:
            raise HarnessError(f"round 1 wrote no file into {kv_dir}")
        log(f"  {out['written']['files']} files, {out['written']['bytes']} bytes written")
        steps: list[str] = ["load"]
        if mount is not None:
            steps = ["remount", "load", "sigkill", "load"]
        n = 1
        for step in steps:
            if step == "remount":
                log("  clean unmount, DRAM tier deleted, remount")
                t0 = time.perf_counter()
                mount.unmount()
                mount.new_dram_tier()
                mount.mount()
                out["remount_seconds"] = round(time.perf_counter() - t0, 3)
                out["residency_after_remount"] = mount.residency(kv_dir)
                if set(out["residency_after_remount"]) != {"nvme"}:
                    raise HarnessError("after the remount not every chunk is on NVMe only: "
                                       f"{out['residency_after_remount']}")
                log(f"  chunks after remount: {out['residency_after_remount']}")
            elif step == "sigkill":
                log("  SIGKILL of the daemon, remount")
                mount.kill()
                mount.mount()
                out["residency_after_sigkill"] = mount.residency(kv_dir)
                log(f"  chunks after SIGKILL and remount: {out['residency_after_sigkill']}")
            else:
                n += 1
                if kind != "tmpfs" and not args.keep_page_cache:
                    evict_from_page_cache(mount.nvme_dir if mount is not None else kv_dir)
                if mount is not None:
                    before, cpu = mount.status()["reads"], mount.cpu_seconds()
                log(f"{args.name} on {kind}: round {n} (load)")
                summary = compare(first, engine.round(n), n)
                if mount is not None:
                    after = mount.status()["reads"]
                    summary["kvfs_reads"] = {k: after[k] - before.get(k, 0)
                                             for k in ("chunks_from_dram", "chunks_from_nvme",
                                                       "checksum_errors") if k in after}
                    summary["kvfs_daemon_cpu_seconds"] = round(mount.cpu_seconds() - cpu, 2)
                out["rounds"].append(summary)
                log(f"  hit {summary['hit']} ({summary['evidence']}), tokens identical "
                    f"{summary['tokens_identical']}, {summary['seconds']} s")
        if mount is not None:
            st = mount.status()
            out["kvfs_tiers"] = {name: {k: t[k] for k in ("used_bytes", "logical_bytes",
                                                          "chunks")}
                                 for name, t in st["tiers"].items()}
            out["kvfs_checksum_errors"] = st["reads"]["checksum_errors"]
    finally:
        engine.close()
        if mount is not None:
            mount.cleanup()
        elif kind == "tmpfs":
            shutil.rmtree(kv_dir, ignore_errors=True)
    out["ok"] = (all(r["hit"] and r["tokens_identical"] for r in out["rounds"])
                 and not out["store"]["hit"] and out.get("kvfs_checksum_errors", 0) == 0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the engine's name in the report")
    p.add_argument("--python", required=True, help="the engine venv's python")
    p.add_argument("--round-script", required=True)
    p.add_argument("--model-dir", required=True)
    p.add_argument("--work", required=True, type=Path,
                   help="scratch directory on ext4 (mounts, logs, the ext4 target)")
    p.add_argument("--targets", default="kvfs,tmpfs,ext4")
    p.add_argument("--persistent", action="store_true",
                   help="one engine process for all rounds (see the module docstring)")
    p.add_argument("--engine-arg", action="append", default=[],
                   help="extra argument for the round script (repeatable)")
    p.add_argument("--kvfs-cmd", default=os.environ.get("KVFS_CMD", "kvfs"),
                   help="how to run kvfs (default $KVFS_CMD or `kvfs`)")
    p.add_argument("--kvfs-options", default=os.environ.get(
        "KVFS_OPTIONS", "dram_size=2G,nvme_size=16G"), help="-o options of the kvfs mount")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="do not evict the KV files from the page cache before load rounds")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine round")
    p.add_argument("--json-out", type=Path, help="also write the summary here")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("harness.py: run as root (FUSE mounts)")
    if args.work.exists():
        shutil.rmtree(args.work)
    results = {"engine": args.name, "date": time.strftime("%Y-%m-%d"), "targets": {}}
    code = 0
    for kind in args.targets.split(","):
        try:
            res = run_target(kind, args, args.work / kind)
        except (HarnessError, OSError, subprocess.SubprocessError, KeyError,
                json.JSONDecodeError) as exc:
            log(f"{args.name} on {kind} FAILED: {exc}")
            res = {"target": kind, "ok": False, "error": str(exc)}
        results["targets"][kind] = res
        code |= 0 if res["ok"] else 1
    text = json.dumps(results, indent=1)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
