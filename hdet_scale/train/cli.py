"""``hdet-train [CONFIG.yaml] [key=value ...]``: the reference HDET trainer.

Under ``torchrun`` or the ``deepspeed`` launcher (``RANK``/``WORLD_SIZE`` set) it trains
the rank it is. Started bare, it validates the config, then starts ``nproc`` local ranks
itself (CPU, gloo) and waits for them; if one fails, the others are stopped.
Exit codes: 0 done, 2 bad config (message on stderr), 1 a rank failed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from multiprocessing import get_context

from hdet_scale.errors import HDETConfigError, HDETStateError


def _split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    if argv and "=" not in argv[0]:
        return argv[0], argv[1:]
    return None, argv


def _rank_main(run: dict, rank: int, world: int, port: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from hdet_scale.train.loop import train

    summary = train(run)
    if rank == 0:
        print(json.dumps(summary, indent=2), flush=True)


def _launch_local(run: dict) -> int:
    n = run["nproc"]
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(run, r, n, port)) for r in range(n)]

    def stop(signum, frame):  # a killed launcher takes its ranks with it
        for p in procs:
            if p.is_alive():
                p.terminate()
        sys.exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        for p in procs:
            p.start()
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                # give the other ranks a moment to fail by themselves, then stop them
                deadline = time.monotonic() + 10
                while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                    time.sleep(0.2)
                break
            time.sleep(0.2)
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if failed:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
            print(f"hdet-train: rank(s) {failed} failed (exit codes {[procs[r].exitcode for r in failed]})",
                  file=sys.stderr)
            return 1
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    path, overrides = _split_args(argv)
    try:
        from hdet_scale.train.config import load_run_config

        run = load_run_config(path, overrides)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            from hdet_scale.train.loop import train

            summary = train(run)
            if int(os.environ["RANK"]) == 0:
                print(json.dumps(summary, indent=2), flush=True)
            return 0
        from hdet_scale.train.loop import validate

        validate(run, run["nproc"])
    except (HDETConfigError, HDETStateError) as e:
        print(f"hdet-train: error: {e}", file=sys.stderr)
        return 2
    return _launch_local(run)


if __name__ == "__main__":
    sys.exit(main())
