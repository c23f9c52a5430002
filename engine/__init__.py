"""pagedserve's inference engine: paged KV cache, continuous batching, Llama-family models.

Plain Python and torch; nothing here imports Ray. This module is the engine's one door: the
serving layer (``serve_app``) imports only the names below. Inside, the wings are folders, each
saying in its ``__init__`` what it may import: ``core`` (requests, scheduler, KV-cache manager),
``grammar`` (structured output), ``sample`` (logits to tokens), ``layers`` and ``models`` (the
network), ``executor`` (running a step). At the top sit the foundations every wing may use
(``config``, ``envs``, ``distributed``, ``loader``) and the three faces built from the wings:
``LLMEngine`` (synchronous steps), ``LLM`` (offline, with a progress bar) and ``AsyncEngine``
(the step loop thread a Worker runs), with ``tokenizer`` and ``health`` beside them.
"""

from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.core.detokenizer import TextStream
from engine.core.outputs import CompletionOutput, Logprobs, PromptLogprobs, RequestOutput
from engine.core.sampling_params import (
    INT32_MAX,
    MAX_BAD_WORDS,
    MAX_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_LEN,
    MAX_STOP_TOKEN_IDS,
    MAX_WORD_LEN,
    SamplingParams,
)
from engine.core.stats import AsyncEngineStats, EngineStats
from engine.envs import cache_dir
from engine.grammar.structured_output import StructuredOutputsParams
from engine.health import EngineDeadError
from engine.models.default_model import DEFAULT_MODEL_NAME
from engine.models.hub import looks_like_repo_id
from engine.step_stream import StepOutputs, StepStream

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.executor.tp_ranks import RankSpec, run_rank
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

# Heavier faces, imported when first asked for: ``import engine`` stays light for the Router.
_LAZY = {
    "AsyncEngine": "engine.async_engine",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "RankSpec": "engine.executor.tp_ranks",
    "run_rank": "engine.executor.tp_ranks",
}

__all__ = [
    "DEFAULT_MODEL_NAME",
    "INT32_MAX",
    "MAX_BAD_WORDS",
    "MAX_BIAS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_LEN",
    "MAX_STOP_TOKEN_IDS",
    "MAX_WORD_LEN",
    "AsyncEngine",
    "AsyncEngineStats",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "LLM",
    "LLMEngine",
    "Logprobs",
    "PromptLogprobs",
    "RankSpec",
    "RequestOutput",
    "SamplingParams",
    "StepOutputs",
    "StepStream",
    "StructuredOutputsParams",
    "TextStream",
    "cache_dir",
    "looks_like_repo_id",
    "run_rank",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
