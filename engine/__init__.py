"""pagedserve's inference engine: paged KV cache, continuous batching, Llama-family models.

Plain Python and torch; nothing here imports Ray.
"""

from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputsParams

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "EngineConfig",
    "LLM",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> type:  # lazy: keep `import engine` light for the serving layer
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
