"""Shared pytest settings for minivllm's tests."""
import os

# The engine core runs in its own process by default (as in vLLM). Most tests look inside the scheduler or
# build many small engines, so they keep it in-process, like vLLM's own in-process tests do; the tests of the
# process split (test_engine_process.py, test_async_llm_mp.py) ask for it explicitly. Export
# MINIVLLM_ENABLE_V1_MULTIPROCESSING=1 to run the whole suite through the process split instead.
os.environ.setdefault("MINIVLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_configure(config):
    # `make test` deselects these; benchmarks-like checks that are too slow for the default suite.
    config.addinivalue_line("markers", "slow: too slow for the default suite (run with -m slow)")


def _slow_for_time() -> set[str]:
    "The node ids listed in tests/slow_for_time.txt (the default suite's slowest tests, measured)."
    path = os.path.join(os.path.dirname(__file__), "slow_for_time.txt")
    with open(path) as f:
        return {line.split("#")[0].strip() for line in f if line.split("#")[0].strip()}


def pytest_collection_modifyitems(config, items):
    # keeps `make test` under its time budget: these run in `make test-slow` (after it, in .ci/run)
    slow = _slow_for_time()
    for item in items:
        if item.nodeid in slow:
            item.add_marker("slow")


# IPC endpoints (ipc://$TMPDIR/minivllm-*) are unlinked by whoever bound them, but tests that SIGKILL an engine
# or a worker leave the dead process's socket files behind. Point the temp folder (here and in every child
# process, which inherits TMPDIR) at one folder per test session and remove it at the end. Short path: a unix
# socket path must stay under 108 bytes.
import shutil
import tempfile

_SESSION_TMP = tempfile.mkdtemp(prefix="mvt-")
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = _SESSION_TMP


def pytest_unconfigure(config):
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)


# `minivllm chat` / `generate` without --verbose set the "minivllm" logger to ERROR for the rest of the process
# (entrypoints/cli/main.py): a test that runs the CLI's main() in-process would silence every later test's
# warnings (caplog then sees nothing). Restore the level after each test.
import logging

import pytest


@pytest.fixture(autouse=True)
def _restore_minivllm_log_level():
    logger = logging.getLogger("minivllm")
    level = logger.level
    yield
    logger.setLevel(level)
