"""``python tests/helpers/slow_rank0.py SCRIPT ARGS...``: run SCRIPT as ``__main__`` (as torchrun would), with
global rank 0 sleeping ``MEGALITE_TEST_SLOW_RANK0_S`` seconds first (default 5): the rank that used to be the
only one to say a bad flag is the last to get there, and torchrun stops it once another rank exits."""

import os
import runpy
import sys
import time

if __name__ == "__main__":
    if os.environ.get("RANK") == "0":
        time.sleep(float(os.environ.get("MEGALITE_TEST_SLOW_RANK0_S", "5")))
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script] + sys.argv[2:]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")
