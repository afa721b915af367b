__version__ = "0.1.0"

# minivllm: a literate re-implementation of vLLM's v1 inference engine.
#
# The public names vLLM exports at its top level (`from vllm import LLM, SamplingParams`) are
# importable from `minivllm` too. They load lazily, on first access (a module `__getattr__` over a
# name -> "module:attr" map, as vLLM's own `__init__` does), so `import minivllm` stays cheap and
# does not pull in torch. Source: vLLM `vllm/__init__.py` (`MODULE_ATTRS`).

import importlib
import typing

MODULE_ATTRS = {
    "EngineArgs": ".engine.arg_utils:EngineArgs",
    "LLMEngine": ".v1.engine.llm_engine:LLMEngine",
    "AsyncLLM": ".v1.engine.async_llm:AsyncLLM",
    "AsyncLLMEngine": ".v1.engine.async_llm:AsyncLLM",  # v1: vLLM's AsyncLLMEngine is AsyncLLM
    "LLM": ".entrypoints.llm:LLM",
    "SamplingParams": ".sampling_params:SamplingParams",
    "RequestOutputKind": ".sampling_params:RequestOutputKind",
    "CompletionOutput": ".outputs:CompletionOutput",
    "RequestOutput": ".outputs:RequestOutput",
}

if typing.TYPE_CHECKING:  # for type checkers and IDEs only: at run time the names load lazily (below)
    from minivllm.engine.arg_utils import EngineArgs  # noqa: F401
    from minivllm.entrypoints.llm import LLM  # noqa: F401
    from minivllm.outputs import CompletionOutput, RequestOutput  # noqa: F401
    from minivllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: F401
    from minivllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
    from minivllm.v1.engine.async_llm import AsyncLLM as AsyncLLMEngine  # noqa: F401
    from minivllm.v1.engine.llm_engine import LLMEngine  # noqa: F401


def __getattr__(name: str) -> typing.Any:
    "Import `name`'s module on first use and return the attribute (cached in the package namespace)."
    target = MODULE_ATTRS.get(name)
    if target is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attr = target.split(":")
    value = getattr(importlib.import_module(module_name, __package__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(MODULE_ATTRS))


__all__ = ["__version__", *MODULE_ATTRS]
