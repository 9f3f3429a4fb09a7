"""Data-parallel `harness train` for the many FSDP and DDP cases, and the fsdp peak ranks of
tests/cost/fsdp_peaks.py: ranks forked from the harness's warm fork server
(harness/sweep/run/starter.py) with the environment torchrun gives its workers, instead of
torchrun's agent starting each cold (each rank's and the agent's imports, most of the
suite's FSDP time). What torchrun itself adds, the user's command and its agent stopping the
other ranks once one ends, is tested with torchrun: tests/train/test_ddp.py's interrupted pair."""

from __future__ import annotations

import os
import signal
import threading
import time
from multiprocessing.connection import wait

from harness.sweep.run.starter import ForkedTrial


class Ranks:
    """`procs` ranks on one thread each (kernels sum in the 1-process reference's order), their
    stdout and stderr one stream as torchrun's; one rank failing ends the others, as torchrun
    does. The part of `subprocess.Popen` the tests use: `stdout`, `communicate`, `returncode`."""

    def __init__(self, argv: list[str], procs: int, port: int,
                 module: str = "harness.cli") -> None:
        """Each rank runs `module`'s `main(argv)`: `harness` itself, or a test's script."""
        read, write = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(procs),
               "LOCAL_WORLD_SIZE": str(procs), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        try:
            self.ranks = [ForkedTrial(argv, {**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                      write, write, module) for r in range(procs)]
        finally:
            os.close(write)
        self.stdout = open(read, encoding="utf-8", errors="replace")  # noqa: SIM115
        self.returncode: int | None = None

    def communicate(self, timeout: float) -> tuple[str, None]:
        """The rest of the output once every rank has ended; all are killed at `timeout`."""
        deadline = time.monotonic() + timeout
        chunks: list[str] = []
        reader = threading.Thread(target=lambda: chunks.append(self.stdout.read()), daemon=True)
        reader.start()
        left = list(self.ranks)
        while left:
            ended = wait([r.process.sentinel for r in left], max(0, deadline - time.monotonic()))
            if not ended:
                break
            left = [r for r in left if r.poll() is None]
            if any(r.poll() for r in self.ranks):  # torchrun stops the others when one fails:
                for rank in left:  # SIGTERM (a trial saves and ends), SIGKILL after 30 s
                    rank.send_signal(signal.SIGTERM)
                wait([r.process.sentinel for r in left], 30)
                break
        for rank in self.ranks:
            rank.kill()
        codes = [rank.wait(30) for rank in self.ranks]
        reader.join(30)
        self.returncode = next((c for c in codes if c), 0)
        return "".join(chunks), None
