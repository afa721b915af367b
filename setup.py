"""minivllm packaging. Metadata comes from settings.ini (nbdev 2 layout)."""
from configparser import ConfigParser

import setuptools

cfg = ConfigParser(delimiters=["="])
cfg.read("settings.ini")
cfg = cfg["DEFAULT"]

requirements = cfg["requirements"].split()
extras = {
    # nbdev 2.4.14 itself is installed with --no-deps by `make install`: its metadata asks
    # for fastcore>=1.12.3, but only fastcore 1.8.18 + execnb 0.1.16 work with it.
    "dev": ["fastcore==1.8.18", "execnb==0.1.16", "astunparse", "watchdog", "asttokens",
            "PyYAML", "packaging", "pytest", "pytest-timeout", "hypothesis", "jupytext", "gguf",
            "openai",  # the official OpenAI client, used by tests/test_server.py
            "peft==0.21.2",  # the LoRA reference (PeftModel) of tests/test_lora.py
            "redis",  # LMCacheConnectorV1's remote tier (tests/test_lmcache_connector.py)
            "ruff==0.17.6",  # `make lint` (pyproject.toml [tool.ruff])
            "xgrammar", "jsonschema",  # structured outputs and their tests
            # Triton kernels (minivllm_kernels/): tested on the CPU under TRITON_INTERPRET=1; not needed at runtime there
            "triton==3.6.0; platform_system == 'Linux'",
            # the docs site (`make docs`, tools/docs/) and its headless-browser test
            "sphinx==9.0.4", "myst-nb==1.4.0", "furo==2025.12.19", "websocket-client==1.9.2",
            "matplotlib==3.11.2",  # the plots of chapters 62-64 (imported only in their own cells)
            "ray", "psutil"],  # RayDistributedExecutor and tests/test_distributed.py
    # distributed_executor_backend="ray" (RayDistributedExecutor, several machines)
    "ray": ["ray"],
    # building the docs site alone: the renderer and the chapters' plots
    "docs": ["sphinx==9.0.4", "myst-nb==1.4.0", "furo==2025.12.19", "execnb==0.1.16", "matplotlib==3.11.2"],
    "embedded": ["gguf"],
    "structured": ["xgrammar"],  # SamplingParams.structured_outputs / response_format
    # LMCacheConnectorV1 (chapter 48): the Redis tier and LMCACHE_CONFIG_FILE (YAML)
    "lmcache": ["redis", "PyYAML"],
    "serve": ["fastapi", "uvicorn", "prometheus-client", "httpx"],  # httpx: examples/disagg_proxy.py
}

setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    author=cfg["author"],
    python_requires=">=" + cfg["min_python"],
    packages=setuptools.find_packages(include=["minivllm", "minivllm.*", "minivllm_kernels", "minivllm_kernels.*"]),
    include_package_data=True,
    install_requires=requirements + ["gguf"],
    extras_require=extras,
    entry_points={"console_scripts": cfg["console_scripts"].split()},
    zip_safe=False,
)
