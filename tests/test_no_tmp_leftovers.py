"""Tests leave nothing in the temporary folder: a representative set (the fake-engine chapter and the
step-trace chapter under `nbdev_test`, whose worker processes exit without running finalizers, and the
step-trace tests, which build engines in this process and in an engine-core process with IPC sockets) runs
with its own $TMPDIR, and afterwards that folder holds no `minivllm-*` entry (fake model folders, step
traces, IPC socket files).
"""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _run(cmd: list[str], tmpdir: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (cmd, r.stdout[-2000:], r.stderr[-2000:])


@pytest.mark.skipif(not (BIN / "nbdev_test").exists(), reason="needs nbdev_test beside this python")
@pytest.mark.slow  # 40 s on a 2-core CPU (it runs notebooks and tests again); `make test-slow`
def test_a_representative_set_leaves_no_minivllm_entries(tmp_path):
    tmpdir = Path(tempfile.mkdtemp(prefix="mvt-"))  # short: IPC socket paths must stay under 108 bytes
    try:
        # two notebooks, two workers: nbdev_test runs a single notebook in its own process, where exit
        # handlers run; in its worker processes they do not (the old fake folder survived only there)
        nbs = r"^(50_fake_client|24c_step_trace)\.ipynb$"
        _run([str(BIN / "nbdev_test"), "--path", "nbs", "--file_re", nbs, "--n_workers", "2"], tmpdir)
        _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_step_trace.py",
              "-k", "prefix_cache_hits or traced_token_counts", "--basetemp", str(tmp_path / "inner")], tmpdir)
        left = sorted(p.name for p in tmpdir.rglob("minivllm-*"))
        assert left == [], left
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
