"""Hang watchdog: a thread per rank that notices when the rank has made no communication progress for
`distributed.timeout_s`, collects every rank's flight record, prints who is stuck, and ends the job.

How ranks exchange their records when one of them is stuck: through files in a directory every rank
can read (`<log.dir>/flight/`), not through the process group (which is what hangs) nor its store
(which a stopped rank may host). Each watchdog thread polls that directory:

1. A rank whose oldest pending op has seen no progress for `timeout_s` writes `request.json` and its
   own dump `rank<r>.json`.
2. Every other rank's watchdog sees the request within one poll and writes its dump, wherever its main
   thread is (in another collective, in compute, sleeping). A SIGSTOPped or killed rank cannot: its
   last heartbeat `rank<r>.heartbeat.json` (rewritten every timeout/4, at most 30 s) stands in, and the
   diagnosis says it did not answer.
3. After a grace period the first rank to create `diagnosis.lock` (normally the one that timed out)
   writes `diagnosis.txt`, prints it to stderr, and every rank exits with `HANG_EXIT_CODE`, the
   stuck ranks named in their last line.

Besides its own dump each rank also writes PyTorch's flight-recorder trace (`torch_trace_rank<r>`
files, the ones NCCL itself writes on its timeout: see `distributed.launch.torch_flight_recorder_env`):
the watchdog ends the ranks before the process group's timeout, so NCCL would never get to dump.
`diagnosis.txt` names those files.

Work that does not go through the comm layer — a checkpoint save, whose collectives are DCP's own — is one
pending op for its duration (`Comm.outside`). How far it got is not visible, so it counts as progressing while
the next rank (r+1 mod world, each rank watching one) keeps rewriting its heartbeat: a slow disk is no hang,
a rank stopped or killed during the save is, and is named as a rank stopped mid-step is.

The process group's own timeout is set longer (`process_group_timeout`), so the watchdog speaks first.
On several nodes, `log.dir` must be on a shared filesystem (checked at start: a warning otherwise).
"""

from __future__ import annotations

import faulthandler
import json
import linecache
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pentatron.distributed.launch import DUMP_FILE_ENV, TORCH_TRACE_PREFIX
from pentatron.observe.collective_check import CollectiveChecker
from pentatron.observe.flight_recorder import FlightRecorder, completion_event_for, format_site
from pentatron.observe.hang_diagnosis import diagnose

if TYPE_CHECKING:
    from pentatron.distributed.context import ParallelContext

HANG_EXIT_CODE = 3
REQUEST, LOCK, DIAGNOSIS = "request.json", "diagnosis.lock", "diagnosis.txt"


def process_group_timeout(timeout_s: float) -> float:
    """The process group's own timeout: the backstop, after the watchdog's detection and dump exchange."""
    return 2 * timeout_s + 60.0


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers never see half a file


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _create_exclusive(path: Path, text: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


class HangDetected(RuntimeError):
    """What torchrun's failure summary shows for a rank the watchdog ended."""


def _tell_launcher(message: str) -> None:
    """Under torchrun, write its error file, so that its summary names the stuck rank rather than
    only "exitcode 3" of whichever rank exited first."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ:
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            raise HangDetected(message)
        except HangDetected as e:
            ErrorHandler().record_exception(e)
    except Exception:  # noqa: BLE001 - best effort: the diagnosis is already printed and on disk
        pass


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def main_thread_stack(limit: int = 6) -> list[str]:
    """The main thread's innermost `limit` frames, outermost first, as "site: source line". Read by
    faulthandler from the interpreter's own frame records, never as frame objects: those that
    `sys._current_frames()` makes keep the frames' locals alive while this thread holds them, so a
    tensor local to a function the main thread has left meanwhile was freed here, on a thread the
    profiler does not see (a phantom allocation in the profiled peak, issue 46)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        text = f.read()
    main, frames, inside = threading.main_thread().ident, [], False
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            inside = int(head.group(1), 16) == main
        elif inside and (m := _FRAME.match(line)):
            frames.append((m.group(1), int(m.group(2)), m.group(3)))
    innermost = frames[:limit][::-1]  # faulthandler lists the most recent call first
    return [f"{format_site(site)}: {linecache.getline(site[0], site[1]).strip()}" for site in innermost]


class Watchdog:
    def __init__(self, recorder: FlightRecorder, world_size: int, dump_dir: Path, timeout_s: float,
                 shared_dir: bool = True, device: torch.device | str = "cpu") -> None:
        self.recorder = recorder
        self.device = torch.device(device)  # the rank's: the thread queries its CUDA events there
        self.rank = recorder.rank
        self.world_size = world_size
        self.dir = dump_dir
        self.timeout_s = timeout_s
        self.shared_dir = shared_dir
        self.poll_s = min(1.0, max(0.05, timeout_s / 10))
        self.grace_s = max(1.0, 5 * self.poll_s)
        self.heartbeat_s = max(self.poll_s, min(timeout_s / 4, 30.0))
        self._peer_beat: tuple[int, float] | None = None  # the watched rank's heartbeat: (mtime_ns, seen at)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pentatron-watchdog-{self.rank}", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        if not self.started:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * self.poll_s + 1)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        last_beat = 0.0
        try:
            bind_thread_device(self.device)
            while not self._stop.wait(self.poll_s):
                if (self.dir / REQUEST).exists():
                    self._conclude(requested_by_me=False)
                if self.recorder.outside is None:
                    self._peer_beat = None
                elif self._peer_alive():
                    self.recorder.alive()
                if self.recorder.stalled_for() > self.timeout_s:
                    _create_exclusive(self.dir / REQUEST, json.dumps({"rank": self.rank, "time": time.time()}))
                    self._conclude(requested_by_me=True)
                now = time.monotonic()
                if now - last_beat >= self.heartbeat_s:
                    _write_json(self.dir / f"rank{self.rank}.heartbeat.json", self._dump("heartbeat"))
                    last_beat = now
        except Exception:  # noqa: BLE001 - a broken watchdog must not kill a healthy run
            print(f"pentatron: rank {self.rank}: hang watchdog failed, continuing without it:\n"
                  f"{traceback.format_exc()}", file=sys.stderr, flush=True)

    def _peer_alive(self) -> bool:
        """Whether the rank this one watches (the next) has rewritten its heartbeat lately: within two heartbeat
        periods of the last change seen here (local clock only: no comparison across hosts). Unknown — no
        shared directory, no heartbeat yet — counts as alive: the process group's timeout remains behind it."""
        peer = (self.rank + 1) % self.world_size
        if not self.shared_dir or peer == self.rank:
            return True
        try:
            mtime = os.stat(self.dir / f"rank{peer}.heartbeat.json").st_mtime_ns
        except OSError:
            return True
        now = time.monotonic()
        if self._peer_beat is None or self._peer_beat[0] != mtime:
            self._peer_beat = (mtime, now)
            return True
        return now - self._peer_beat[1] <= 2 * self.heartbeat_s + self.poll_s

    def _dump(self, reason: str) -> dict[str, Any]:
        d = self.recorder.snapshot(reason)
        d["main_stack"] = main_thread_stack()
        return d

    def torch_trace_prefix(self) -> str:
        """The per-rank file prefix of PyTorch's flight-recorder dumps: the user's, or in this directory."""
        return next((os.environ[n] for n in DUMP_FILE_ENV if os.environ.get(n)), str(self.dir / TORCH_TRACE_PREFIX))

    def _conclude(self, requested_by_me: bool) -> None:
        """Dump, wait for the others' dumps, diagnose (one rank) and exit (every rank)."""
        # PyTorch's trace first: a rank's dump then tells the diagnosing rank that both are written.
        dump_torch_trace(Path(self.torch_trace_prefix() + str(self.rank)), timeout_s=self.grace_s / 2)
        _write_json(self.dir / f"rank{self.rank}.json", self._dump("timeout" if requested_by_me else "requested"))
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and len(self._dumps()) < self.world_size:
            time.sleep(self.poll_s / 2)
        if not requested_by_me:  # leave the diagnosis to the rank that timed out, unless it is gone
            self._wait_for(self.dir / DIAGNOSIS, 2 * self.grace_s)
        if _create_exclusive(self.dir / LOCK, str(self.rank)):
            result = diagnose(self._dumps(), self._heartbeats(), self.world_size, self.timeout_s, self.rank,
                              str(self.dir))
            *body, verdict = result.text.splitlines()  # the verdict ("stuck rank: …") stays the last line
            text = "\n".join([*body, torch_trace_note(self.torch_trace_prefix(), self.world_size), verdict])
            if not self.shared_dir:
                text += (f"\nnote: {self.dir} is not shared by all ranks: ranks on other nodes could not "
                         "answer and are shown as silent")
            _write_json(self.dir / "diagnosis.json", {"culprits": result.culprits, "by": self.rank})
            (self.dir / DIAGNOSIS).write_text(text + "\n")
            print(text, file=sys.stderr, flush=True)
            culprits = result.culprits
        else:
            self._wait_for(self.dir / "diagnosis.json", 2 * self.grace_s)
            culprits = (_read_json(self.dir / "diagnosis.json") or {}).get("culprits", [])
        named = ", ".join(map(str, culprits)) if culprits else "unknown"
        message = f"rank {self.rank}: exiting after a hang; stuck rank(s): {named} (see {self.dir / DIAGNOSIS})"
        print(f"pentatron: {message}", file=sys.stderr, flush=True)
        _tell_launcher(message)
        sys.stdout.flush()
        os._exit(HANG_EXIT_CODE)  # the main thread is blocked inside the backend: no clean way out

    def _wait_for(self, path: Path, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not path.exists():
            time.sleep(self.poll_s / 2)

    def _per_rank(self, suffix: str) -> dict[int, dict[str, Any]]:
        """Every rank's `rank<r><suffix>` file that exists and parses."""
        found = {r: _read_json(self.dir / f"rank{r}{suffix}") for r in range(self.world_size)}
        return {r: d for r, d in found.items() if d is not None}

    def _dumps(self) -> dict[int, dict[str, Any]]:
        return self._per_rank(".json")

    def _heartbeats(self) -> dict[int, dict[str, Any]]:
        return self._per_rank(".heartbeat.json")


def bind_thread_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device. A new thread starts on device 0 whatever the
    main thread set, so its first CUDA call (the watchdog's event query) would create a context on GPU 0
    in every rank: hundreds of MB each on one GPU, and on a rank not using it. Nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def dump_torch_trace(path: Path, timeout_s: float) -> bool:
    """Write PyTorch's flight-recorder trace of this process (a pickle, what `torchfrtrace` reads) to
    `path`; on NCCL with the communicators' state. First without stack traces (instant), then with
    them (the first such dump of a process resolves symbols: seconds), all within `timeout_s` (NCCL's
    dump queries CUDA, which a wedged device could block). False when nothing was written."""
    c10d = torch._C._distributed_c10d
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    fn = (getattr(c10d, "_dump_nccl_trace", None) if nccl else None) or getattr(c10d, "_dump_fr_trace", None)
    if fn is None:
        return False

    def write() -> None:
        for stacks in (False, True):
            try:
                data = fn(includeStackTraces=stacks)
                tmp = path.with_name(path.name + f".tmp{os.getpid()}")
                tmp.write_bytes(data)
                os.replace(tmp, path)
            except Exception:  # noqa: BLE001 - our own dump and diagnosis matter more than torch's
                return

    path.parent.mkdir(parents=True, exist_ok=True)
    worker = threading.Thread(target=write, name="pentatron-torch-trace", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return path.exists()


def torch_trace_note(prefix: str, world_size: int) -> str:
    """The diagnosis's line about PyTorch's flight-recorder dumps: where, and which ranks wrote one."""
    found = [r for r in range(world_size) if Path(f"{prefix}{r}").exists()]
    have = f"ranks {', '.join(map(str, found))}" if found else "none yet"
    folder, name = os.path.split(prefix)
    backend = dist.get_backend() if dist.is_initialized() else "c10d"
    return (f"PyTorch flight recorder ({backend}) dumps: {prefix}<rank> (written: {have}); read them with "
            f"`torchfrtrace {folder or '.'} --prefix {name}`")


def attach_flight_recorder(ctx: ParallelContext, dump_dir: Path, timeout_s: float, check: bool,
                           watchdog: bool = True, start: bool = True) -> Watchdog | None:
    """Give `ctx.comm` a flight recorder (and the check-mode verifier), and on more than one process
    create the hang watchdog (started now, or by the caller with `start=False`). Collective over the
    world: every rank must call it."""
    recorder = FlightRecorder(ctx.rank, check=CollectiveChecker() if check else None,
                              completion_event=completion_event_for(ctx.device))
    ctx.comm.recorder = recorder
    if ctx.world_size == 1 or not watchdog:
        return None
    if ctx.rank == 0:
        dump_dir.mkdir(parents=True, exist_ok=True)
        for f in dump_dir.iterdir():  # files of an earlier run in the same log directory
            if f.is_file():
                f.unlink()
    ctx.comm.barrier()
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / f"rank{ctx.rank}.hello").write_text(str(os.getpid()))
    ctx.comm.barrier()
    shared = all((dump_dir / f"rank{r}.hello").exists() for r in range(ctx.world_size))
    if not shared and ctx.rank == 0:
        print(f"pentatron: warning: {dump_dir} is not shared by all ranks (another node?): a hang "
              "diagnosis will only see this node's ranks; put log.dir on a shared filesystem",
              file=sys.stderr, flush=True)
    dog = Watchdog(recorder, ctx.world_size, dump_dir, timeout_s, shared, device=ctx.device)
    if start:
        dog.start()
    return dog
