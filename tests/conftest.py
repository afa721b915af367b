"""Shared pytest settings for minivllm's tests."""


def pytest_configure(config):
    # `make test` deselects these; benchmarks-like checks that are too slow for the default suite.
    config.addinivalue_line("markers", "slow: too slow for the default suite (run with -m slow)")
