"""adaserve: SLO-customized LLM serving with fine-grained tree speculative decoding."""

from adaserve.llm import LLM, LLMEngine
from adaserve.request_manager.request import CompletionOutput, RequestOutput, SamplingParams
from adaserve.request_manager.structured import StructuredOutput

__all__ = [
    "LLM",
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "StructuredOutput",
]
__version__ = "0.1.0"
