"""adaserve: SLO-customized LLM serving with fine-grained tree speculative decoding."""

from adaserve.llm import LLM, LLMEngine
from adaserve.request_manager.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
