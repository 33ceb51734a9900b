"""The GPU run's script (.ci/gpu) and its benchmarks, as far as a CPU can
check them: the stage runner's time limits, that a cut or failed stage is
reported and the next one runs, the stages' order and budget, and the
benchmark scripts' arguments at tiny sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / ".ci" / "gpu"


def run_script(*args, env=None, timeout=60):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=ROOT)


def test_the_stages_fit_one_nine_minute_command_in_priority_order():
    done = run_script("--dry-run")
    assert done.returncode == 0, done.stderr
    plan = [line.split()[:2] for line in done.stdout.splitlines()]
    assert [name for name, _ in plan] == ["build", "cuda-tests", "sanitize", "bench-ops", "bench-qat", "profile",
                                          "qat-compiled"]
    limits = [int(s) for _, s in plan]
    assert limits[:6] == [120, 90, 120, 90, 60, 30]
    assert limits[-1] == 540 - sum(limits[:6])  # the last stage takes what remains of 9 minutes


def test_a_cut_or_failed_stage_is_reported_and_the_next_runs(tmp_path):
    stages = tmp_path / "stages"
    stages.write_text("first 10 echo one $STAGE_LIMIT\n"
                      "stuck 2 sleep 30\n"
                      "broken 10 exit 3\n"
                      "rest rest echo rest ran\n")
    out = tmp_path / "out"
    done = run_script(env={"GPU_STAGES_FILE": str(stages), "OUT": str(out), "TOTAL": "20"})
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0].startswith("== first: ok")
    assert summary[1].startswith("== stuck: cut after 2 s")
    assert summary[2].startswith("== broken: failed (exit 3)")
    assert summary[3].startswith("== rest: ok")
    assert done.returncode == 2  # stuck and broken
    assert (out / "first.log").read_text() == "one 10\n"  # a stage's command sees its limit
    assert (out / "rest.log").read_text() == "rest ran\n"


def test_no_stage_runs_past_the_total(tmp_path):
    stages = tmp_path / "stages"
    stages.write_text("long 60 sleep 30\nnext 60 echo next\n")  # the total is spent in long
    out = tmp_path / "out"
    done = run_script(env={"GPU_STAGES_FILE": str(stages), "OUT": str(out), "TOTAL": "3"})
    summary = (out / "summary.txt").read_text()
    assert "== long: cut after 3 s" in summary  # its 60 s cut to the 3 s there were
    assert "== next: skipped" in summary
    assert done.returncode == 2


def test_an_unknown_stage_is_refused_with_the_stage_names():
    done = run_script("--dry-run", "benchmark")
    assert done.returncode == 2
    assert "unknown stage benchmark (stages: build cuda-tests" in done.stdout


def bench(script, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)


def test_bench_ops_runs_the_aten_baselines_at_a_tiny_size():
    done = bench("bench_ops.py", "--device", "cpu", "--shape", "64x64", "--repeats", "1", "--dtype", "float32",
                 "--only", "int8 per-tensor", "--baselines", "aten", "--no-compile")
    assert done.returncode == 0, done.stderr[-3000:]
    results = done.stdout.split("\nTargets")[0]
    rows = [line for line in results.splitlines() if line.startswith("| int8 per-tensor")]
    assert [row.split("|")[2].strip() for row in rows] == ["pt2e_fq", "torch.fake_quantize_per_tensor_affine"]


def test_bench_ops_refuses_the_previous_kernels_on_cpu():
    done = bench("bench_ops.py", "--device", "cpu", "--previous-kernels", "--only", "int8 per-tensor")
    assert done.returncode == 2
    assert "--previous-kernels: the previous kernels are CUDA kernels" in done.stderr


def _sources_digest() -> str:
    """What `sha256sum` of each C++/CUDA source and setup.py, in byte order
    of their paths, then `sha256sum` of those lines, gives (16 hex digits)."""
    import hashlib

    paths = sorted([p.relative_to(ROOT).as_posix() for p in (ROOT / "pt2e_fq" / "csrc").rglob("*") if p.is_file()]
                   + ["setup.py"], key=lambda p: p.encode())
    lines = "".join(f"{hashlib.sha256((ROOT / p).read_bytes()).hexdigest()}  {p}\n" for p in paths)
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


def test_the_build_takes_a_prebuilt_extension_only_for_this_torch_architecture_and_tree(tmp_path):
    import torch

    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    (prebuilt / "_C.abi3.so").write_bytes(b"")
    env = {"GPU_PREBUILT": str(prebuilt), "TORCH_CUDA_ARCH_LIST": "9.0", "PYTHON": sys.executable}
    right = {"torch": torch.__version__, "arch": "9.0", "sources": _sources_digest()}
    for field, wrong in [(None, None), ("torch", "2.11.0+cu130" if torch.__version__ != "2.11.0+cu130" else "2.13.0"),
                         ("arch", "8.0"), ("sources", "0" * 16)]:
        fields = {**right, **({field: wrong} if field else {})}
        (prebuilt / "built-for.txt").write_text("".join(f"{k} {v}\n" for k, v in fields.items()))
        done = run_script("--run", "prebuilt_matches", env=env)
        if field is None:
            assert done.returncode == 0, done.stdout + done.stderr
        else:
            assert done.returncode == 1, field
            assert f"  > {field} {wrong}" in done.stdout and f"  < {field} {right[field]}" in done.stdout, done.stdout
    (prebuilt / "built-for.txt").unlink()
    done = run_script("--run", "prebuilt_matches", env=env)
    assert done.returncode == 1 and done.stdout == f"no {prebuilt}\n"
