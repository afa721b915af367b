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
