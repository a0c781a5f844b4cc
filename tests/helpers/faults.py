"""pretrain_gpt.py runs for the fault tests: the tiny run's flags, one that trains (almost) forever, and the
background torchrun job (the ``torchrun_job`` fixture starts it and kills what is left at teardown)."""

import os
import re
import signal
import subprocess
import sys
import time

from tests.helpers import REPO, TINY_RUN

RUN = TINY_RUN + ["--eval-iters", "0", "--num-threads", "1"]
FOREVER = RUN + ["--train-iters", "1000000", "--log-interval", "20"]


class Job:
    """A torchrun job of ``nproc`` ranks (pp=2) whose output goes to files, started in the background."""

    def __init__(self, tmp, name, nproc, extra=(), launcher=()):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    str(nproc),
                    *launcher,
                    "pretrain_gpt.py",
                    "--pipeline-model-parallel-size",
                    "2",
                ]
                + FOREVER
                + list(extra),
                cwd=REPO,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def wait_training(self, timeout=240):
        deadline = time.time() + timeout
        while " iteration " not in self.out.read_text():
            assert self.proc.poll() is None and time.time() < deadline, self.err.read_text()
            time.sleep(0.5)

    def workers(self):
        """pids of the ranks: torchrun's children."""
        text = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in text.split()]

    def wait(self, timeout):
        t0 = time.time()
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return time.time() - t0

    def our_lines(self):
        return [line for line in self.err.read_text().splitlines() if line.startswith("pretrain_gpt.py")]

    def no_rank_traceback(self):
        return not re.search(r"\[rank\d+\]: Traceback", self.err.read_text())

    def kill(self):
        """SIGKILL what is left of the job: its ranks (torchrun starts them in sessions of their own, out of
        reach of killpg) and torchrun's process group."""
        if self.proc.poll() is None:
            workers = self.workers()
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
