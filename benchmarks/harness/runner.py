"""Running workers: one process per measured operation, or one per rank for an operation of a
process group, each in its own session, none ever left behind; their results, merged over the
ranks."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks.common import reap
from benchmarks.library_tree import LIBRARY_ENV, LIBRARY_PACKAGES

# The repository root: the workers' working directory, so that they import its library.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Runner:
    """Starts one worker process per job (or, for a job of a process group, one per rank), each
    in its own session, and never leaves one behind.

    Data lives in ``<dir>/run-<pid>/``, removed on exit (also on Ctrl-C and SIGTERM).
    """

    def __init__(
        self,
        directory: str,
        timeout: float,
        base_env: dict[str, str],
        group_grace: float = 120.0,
        settle_memory: bool = False,
    ) -> None:
        self.created_dir = not os.path.isdir(directory)
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.run_dir = os.path.join(directory, f"run-{os.getpid()}")
        os.makedirs(self.run_dir)
        self.timeout = timeout
        self.group_grace = group_grace
        self.base_env = base_env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.n = 0
        # Each worker waits for the memory to settle before its timed call
        # (``common.settle_memory``); the seconds each waited.
        self.settle_memory = settle_memory
        self.settle_waits: list[float] = []
        # Tree measured (the working tree or a --library PATH) -> the files its workers
        # imported the library from, as they reported them.
        self.imported: dict[str, set[str]] = {}

    def data_dir(self, name: str) -> str:
        return os.path.join(self.run_dir, re.sub(r"[^A-Za-z0-9.]+", "-", name))

    def job(self, job: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        """Runs one measured operation and returns its result.

        When the job's state names a ``world_size``, that many workers run it as the ranks of
        one gloo process group (a FileStore in the run directory, new for every operation), and
        their results are merged by :func:`merge_ranks`.
        """
        world_size = int(job.get("state", {}).get("world_size") or 0)
        if not world_size:
            return self._run([job], env)[0]
        store = os.path.join(self.run_dir, f"store{self.n + 1}")
        ranks = [
            {**job, "rank": r, "world_size": world_size, "store": store} for r in range(world_size)
        ]
        try:
            return merge_ranks(self._run(ranks, env))
        finally:
            if os.path.exists(store):
                os.remove(store)

    def _run(self, jobs: Sequence[dict[str, Any]], env: dict[str, str]) -> list[dict[str, Any]]:
        """Starts a worker per job, all at once, waits for all of them; their results in order."""
        stems = []
        for job in jobs:
            self.n += 1
            stem = os.path.join(self.run_dir, f"job{self.n}")
            with open(stem + ".json", "w") as f:
                json.dump(
                    {**job, "result": stem + ".result.json", "settle_memory": self.settle_memory},
                    f,
                )
            stems.append(stem)
        child_env = {**os.environ, **self.base_env, **env}
        if LIBRARY_ENV not in env:  # the working tree, whatever the harness's environment says
            child_env.pop(LIBRARY_ENV, None)
        with contextlib.ExitStack() as logs:
            try:
                for stem in stems:
                    log = logs.enter_context(open(stem + ".log", "wb"))
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-m", "benchmarks.worker", stem + ".json"],
                            cwd=REPO,
                            env=child_env,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
                killed = self._wait()
                codes = [p.returncode for p in self.procs]
            except BaseException:  # Ctrl-C or SIGTERM: each worker is in its own session
                self.kill()
                raise
            finally:
                self.procs = []
        results = [
            self._result(stem, why or f"exit code {code}")
            for stem, why, code in zip(stems, killed, codes, strict=True)
        ]
        self._note_library(env.get(LIBRARY_ENV) or os.path.realpath(REPO), results)
        return results

    def _note_library(self, tree: str, results: Sequence[dict[str, Any]]) -> None:
        """Records where the workers of ``tree`` imported the library from; says so on stderr
        the first time (a worker whose library came from elsewhere failed its job)."""
        for result in results:
            library = result.get("library") or {}
            files = [library[p] for p in LIBRARY_PACKAGES if p in library]
            if not files:
                continue
            seen = self.imported.setdefault(tree, set())
            new = [f for f in files if f not in seen]
            if new:
                print(f"library for {tree}: imported from {', '.join(new)}", file=sys.stderr)
            seen.update(files)

    def _wait(self) -> list[str | None]:
        """Waits for every running worker. Kills those still running after ``timeout``, or
        ``group_grace`` seconds after another worker of the same operation exited (a rank that
        died leaves the others waiting in a collective). Per worker: why it was killed, or
        None."""
        start = time.monotonic()
        first_exit: float | None = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return [None] * len(codes)
            now = time.monotonic()
            if first_exit is None and any(c is not None for c in codes):
                first_exit = now
            why = None
            if now - start > self.timeout:
                why = f"timed out after {self.timeout:.0f} s"
            elif first_exit is not None and now - first_exit > self.group_grace:
                why = f"still running {self.group_grace:.0f} s after another rank exited"
            if why is not None:
                self.kill()
                return [why if c is None else None for c in codes]
            time.sleep(0.02)

    def _result(self, stem: str, why: str) -> dict[str, Any]:
        """The worker's result file, or a failure built from its log; removes its files."""
        try:
            with open(stem + ".result.json") as f:
                result: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            with open(stem + ".log", "rb") as f:
                tail = f.read()[-600:].decode(errors="replace").strip().splitlines()
            result = {"ok": False, "error": f"worker {why}: {' | '.join(tail[-3:])}"}
        if isinstance(result.get("settled_seconds"), (int, float)):
            self.settle_waits.append(float(result["settled_seconds"]))
        for suffix in (".json", ".result.json", ".log"):
            if os.path.exists(stem + suffix):
                os.remove(stem + suffix)
        return result

    def kill(self) -> None:
        """Kills each running worker's process group (by its id) and reaps it."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reap(proc)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.created_dir:
            try:
                os.rmdir(self.directory)
            except OSError:
                pass


def merge_ranks(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result for an operation of a process group, from each rank's.

    It is ok when every rank's is; seconds, peak RSS and baseline RSS are the largest of any
    rank, bytes on disk and the payload rank 0's, I/O counters the sum over ranks; each rank's
    own figures (and any error with its traceback) are kept under ``ranks``.
    """
    per_rank = [
        {
            "rank": r,
            **{
                k: res.get(k)
                for k in (
                    "ok",
                    "seconds",
                    "own_seconds",
                    "peak_rss_above_baseline",
                    "io",
                    "check",
                    "in_place",
                    "budget_bytes",
                    "later_seconds",
                    "paired_seconds",
                    "error",
                    "traceback",
                )
                if k in res
            },
        }
        for r, res in enumerate(results)
    ]
    failed = [(r, res) for r, res in enumerate(results) if not res.get("ok")]
    if failed:
        # A rank that died or was killed first: the others' errors are usually its echo.
        r, res = min(failed, key=lambda f: not str(f[1].get("error", "")).startswith("worker "))
        others = f" (ranks {[f[0] for f in failed]} of {len(results)} failed)"
        return {
            "ok": False,
            "error": f"rank {r}: {res.get('error', 'no result')}{others}",
            "ranks": per_rank,
        }
    checks = [res.get("check") or {"ok": True, "detail": ""} for res in results]
    bad = [(r, c) for r, c in enumerate(checks) if not c.get("ok")]
    if bad:
        check = {"ok": False, "detail": f"rank {bad[0][0]}: {bad[0][1].get('detail')}"}
    elif all(c.get("detail") == checks[0].get("detail") for c in checks):
        inner = str(checks[0].get("detail", "")).removeprefix("ok ").strip("()")
        who = f"each of {len(results)} ranks" if len(results) > 1 else "1 rank"
        check = {"ok": True, "detail": f"ok ({who}: {inner})"}
    else:
        check = {
            "ok": True,
            "detail": "ok ("
            + "; ".join(
                f"rank {r}: {str(c.get('detail')).removeprefix('ok ').strip('()')}"
                for r, c in enumerate(checks)
            )
            + ")",
        }
    flags = {res.get("in_place") for res in results}
    ios = [res["io"] for res in results if res.get("io")]
    return {
        "ok": True,
        "seconds": max(res["seconds"] for res in results),
        "payload_bytes": results[0].get("payload_bytes", 0),
        "peak_rss_above_baseline": max(res["peak_rss_above_baseline"] for res in results),
        "baseline_rss": max(res["baseline_rss"] for res in results),
        "rss_method": results[0].get("rss_method"),
        "disk": results[0].get("disk"),
        "io": {k: sum(io[k] for io in ios) for k in ios[0]} if ios else None,
        "check": check,
        "in_place": flags.pop() if len(flags) == 1 else False,
        "ranks": per_rank,
        "library": results[0].get("library"),
    }
