"""MINIVLLM_WORKER_MULTIPROC_METHOD (vLLM's VLLM_WORKER_MULTIPROC_METHOD): fork by default on Linux, as vLLM.

- a script fed on stdin (`python - <<EOF`) and a script file without a `__main__` guard build `LLM` with the
  engine core in a forked process, after OpenMP work in their main thread (which hangs a child forked from
  that thread), and generate the in-process engine's greedy tokens;
- under spawn the guard-less script is refused with the guard hint;
- a script read from stdin under spawn or forkserver is refused: no file to re-import, use fork or no
  multiprocessing (not the guard hint);
- fork, forkserver and spawn (slow) each start an engine with a worker process, generate the in-process
  tokens, and take the engine and worker along when the front end is SIGKILLed;
- an invalid value is a ValueError naming the variable and the allowed values, raised before any IPC file;
- CUDA initialised in this process falls back to spawn with one log line giving the reason;
- a SIGKILLed front end takes its forked engine process and that engine's worker process with it, even while
  a process it forked later holds a copy of the engine's parent-death pipe.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from minivllm.engine.arg_utils import EngineArgs
from minivllm.testing import make_tiny_checkpoint
from minivllm.utils import system_utils
from minivllm.utils.system_utils import MP_METHOD_ENV, FreshThreadForkContext, get_mp_context
from minivllm.v1.engine.core_client import EngineCoreClient
from minivllm.v1.executor.abstract import Executor

# No `if __name__ == "__main__":` guard, on purpose. The in-process engine runs first, in the main thread,
# with two torch threads and one large elementwise op, so libgomp keeps a thread pool there before the fork.
GUARDLESS = """
import json, os, sys
import torch
torch.set_num_threads(2)
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
ckpt = {ckpt!r}
prompts = ["hello world", "the cat sat on the mat", {{"prompt_token_ids": [5, 6, 7, 8, 9]}}]
params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(3)]
kw = dict(dtype="float32", max_model_len=64, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20)
(torch.randn(1 << 20) * 2).exp_()
os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
ref = [o.outputs[0].token_ids for o in LLM(ckpt, **kw).generate(prompts, params, use_tqdm=False)]
os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
llm = LLM(ckpt, **kw)
print("built", flush=True)
client = llm.llm_engine.engine_core
got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps(dict(ref=ref, got=got, client=type(client).__name__, proc=type(client.proc).__name__,
                      method=client._start_method, engine_pid=client.proc.pid)), flush=True)
llm.llm_engine.shutdown()
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def _env(**extra) -> dict:
    "This environment without the conftest's in-process switch or a start method, plus `extra`."
    drop = {"MINIVLLM_ENABLE_V1_MULTIPROCESSING", MP_METHOD_ENV}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def _alive(pid: int) -> bool:
    "True while `pid` runs (a zombie, exited but not yet reaped, counts as gone)."
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    "Live child processes of `pid`, multiprocessing's resource tracker left out."
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmd = (stat.parent / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and "resource_tracker" not in cmd:
            out.append(int(stat.parent.name))
    return out


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("how", [pytest.param("stdin", marks=pytest.mark.slow), "file"])  # stdin: 16 s
def test_guardless_script_forks_and_matches_in_process(ckpt, tmp_path, how):
    script = GUARDLESS.format(ckpt=ckpt)
    if how == "stdin":  # python - <<EOF
        cmd, stdin = [sys.executable, "-"], script
    else:
        (tmp_path / "no_guard.py").write_text(script)
        cmd, stdin = [sys.executable, str(tmp_path / "no_guard.py")], None
    r = subprocess.run(
        cmd, input=stdin, env=_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["client"], out["proc"], out["method"]) == ("SyncMPClient", "FreshThreadForkProcess", "fork")
    assert out["got"] == out["ref"] and [len(t) for t in out["got"]] == [3, 4, 5]
    assert not _alive(out["engine_pid"])
    assert "<stdin>" not in r.stderr  # spawn would look for a file of that name


@pytest.mark.slow  # 15 s (two spawned interpreters); spawn is no longer the default: `make test-slow`
def test_spawn_refuses_the_guardless_script_with_the_hint(ckpt, tmp_path):
    (tmp_path / "no_guard.py").write_text(GUARDLESS.format(ckpt=ckpt))
    r = subprocess.run(
        [sys.executable, str(tmp_path / "no_guard.py")],
        env=_env(**{MP_METHOD_ENV: "spawn"}),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode != 0 and "built" not in r.stdout
    assert "initialization failed" in r.stderr and 'if __name__ == "__main__":' in r.stderr
    assert "re-imports your script" in r.stderr and "spawns the engine core process" in r.stderr


def test_invalid_method_is_a_clear_error_before_any_ipc_file(ckpt, monkeypatch):
    # the config is built first: create_engine_config itself refuses the bad value now (chapter 01b's table)
    cfg = EngineArgs(model=ckpt, dtype="float32", max_model_len=64).create_engine_config()
    monkeypatch.setenv(MP_METHOD_ENV, "threads")
    with pytest.raises(ValueError, match=f"{MP_METHOD_ENV}='threads'.*fork, spawn, forkserver"):
        get_mp_context()
    with pytest.raises(ValueError, match=f"{MP_METHOD_ENV}='threads'"):
        EngineArgs(model=ckpt, dtype="float32", max_model_len=64).create_engine_config()
    before = set(Path(tempfile.gettempdir()).glob("minivllm-*"))
    with pytest.raises(ValueError, match=MP_METHOD_ENV):
        EngineCoreClient.make_client(True, False, cfg, Executor.get_class(cfg), False)
    assert set(Path(tempfile.gettempdir()).glob("minivllm-*")) == before


def test_methods_and_the_cuda_fallback(monkeypatch, caplog):
    monkeypatch.delenv(MP_METHOD_ENV, raising=False)
    assert isinstance(get_mp_context(), FreshThreadForkContext)
    for method in ("fork", "spawn", "forkserver"):
        monkeypatch.setenv(MP_METHOD_ENV, method)
        assert get_mp_context().get_start_method() == method
    monkeypatch.setattr(system_utils, "_logged_fallbacks", set())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    caplog.set_level(logging.WARNING, logger=system_utils.__name__)
    monkeypatch.setenv(MP_METHOD_ENV, "spawn")
    assert get_mp_context().get_start_method() == "spawn" and caplog.records == []  # asked for: no line
    for env in ("fork", None):  # fork asked for, or the default
        if env is None:
            monkeypatch.delenv(MP_METHOD_ENV)
        else:
            monkeypatch.setenv(MP_METHOD_ENV, env)
        assert get_mp_context().get_start_method() == "spawn"
    (rec,) = caplog.records  # one line per process and reason
    assert "CUDA is initialized" in rec.getMessage() and MP_METHOD_ENV in rec.getMessage()


# Builds the engine under fork with a worker process, then forks a sleeper (which inherits the write end of
# the engine's parent-death pipe), and waits to be killed.
KILLED_FRONT_END = """
import multiprocessing, time
from minivllm.entrypoints.llm import LLM
llm = LLM({ckpt!r}, distributed_executor_backend="mp", dtype="float32", max_model_len=64,
          kv_cache_memory_bytes=1 << 20)
sleeper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
sleeper.start()
print(llm.llm_engine.engine_core.proc.pid, sleeper.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_front_end_takes_its_forked_engine_and_worker_along(ckpt, tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = _env(MINIVLLM_ENABLE_V1_MULTIPROCESSING="1", TMPDIR=str(tmpdir), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
        cwd=tmp_path,
    )
    proc.stdin.write(KILLED_FRONT_END.format(ckpt=ckpt))
    proc.stdin.close()
    pids = []
    try:
        line = proc.stdout.readline()
        engine, sleeper = map(int, line.split())
        workers = _children(engine)
        pids = [engine, sleeper, *workers]
        assert len(workers) == 1 and _alive(sleeper)
        assert any(p.name.startswith("minivllm-") for p in tmpdir.iterdir())
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20
        while (_alive(engine) or _alive(workers[0])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(engine) and not _alive(workers[0]) and _alive(sleeper)
        assert [p.name for p in tmpdir.iterdir() if p.name.startswith("minivllm-")] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _kill(pids)


STDIN_SPAWN = """
from minivllm.entrypoints.llm import LLM
LLM({ckpt!r}, dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20)
print("built", flush=True)
"""


@pytest.mark.parametrize("method", ["spawn", pytest.param("forkserver", marks=pytest.mark.slow)])
def test_a_stdin_script_under_spawn_is_refused_naming_the_real_cause(ckpt, tmp_path, method):
    r = subprocess.run(
        [sys.executable, "-"],
        input=STDIN_SPAWN.format(ckpt=ckpt),
        env=_env(**{MP_METHOD_ENV: method, "MINIVLLM_ENABLE_V1_MULTIPROCESSING": "1"}),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert r.returncode != 0 and "built" not in r.stdout
    assert "no file to re-import" in r.stderr and "'<stdin>'" in r.stderr
    assert "MINIVLLM_WORKER_MULTIPROC_METHOD=fork" in r.stderr
    assert "MINIVLLM_ENABLE_V1_MULTIPROCESSING=0" in r.stderr
    assert "__name__" not in r.stderr  # not the guard: this program may have one


# A guarded script file (spawn and forkserver re-import it): builds the in-process engine for reference, then
# the engine core in its own process with a worker process, generates, forks a sleeper that inherits every
# pipe end, prints what it saw and waits to be killed.
GUARDED_KILLED = """
import json, multiprocessing, os, time
from minivllm.entrypoints.llm import LLM
from minivllm.sampling_params import SamplingParams
if __name__ == "__main__":
    kw = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    ref = LLM({ckpt!r}, **kw).generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    os.environ["MINIVLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    llm = LLM({ckpt!r}, distributed_executor_backend="mp", **kw)
    got = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].token_ids
    client = llm.llm_engine.engine_core
    sleeper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    sleeper.start()
    out = dict(ref=list(ref), got=list(got), method=client._start_method, engine=client.proc.pid,
               sleeper=sleeper.pid)
    print(json.dumps(out), flush=True)
    time.sleep(120)
"""


def _descendants(pid: int) -> list[int]:
    "Every live process below `pid` (a fork server's children are its grandchildren), resource trackers left out."
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.mark.parametrize(
    "method", ["fork", *(pytest.param(m, marks=pytest.mark.slow) for m in ("forkserver", "spawn"))]  # 23 s, 3 interpreters
)
def test_every_start_method_starts_and_dies_with_its_front_end(ckpt, tmp_path, method):
    # short: the fork server binds an AF_UNIX socket in $TMPDIR (108 bytes at most); removed below
    tmpdir = Path(tempfile.mkdtemp(prefix="mvt-"))
    (tmp_path / "guarded.py").write_text(GUARDED_KILLED.format(ckpt=ckpt))
    env = _env(**{MP_METHOD_ENV: method, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "guarded.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        cwd=tmp_path,
    )
    pids = []
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:] if proc.wait(60) is not None else "no output"
        out = json.loads(line)
        assert out["method"] == method and out["got"] == out["ref"] and len(out["got"]) == 4
        below = _descendants(out["engine"])  # the worker (and under forkserver the engine's fork server)
        pids = [out["engine"], out["sleeper"], *below]
        assert len(below) >= (2 if method == "forkserver" else 1) and _alive(out["sleeper"])
        proc.kill()
        proc.wait(30)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in [out["engine"], *below]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in [out["engine"], *below] if _alive(p)] == []
        assert _alive(out["sleeper"])
        assert [p.name for p in tmpdir.iterdir() if p.name.startswith("minivllm-")] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        _kill(pids)
        shutil.rmtree(tmpdir, ignore_errors=True)
