"""minillm: a small, complete, fast LLM inference engine, and the course that builds it.

    from minillm import LLM, SamplingParams
    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, offline
    out = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))[0]
"""

from minillm import openmp  # noqa: F401  first: libgomp reads its spin setting once, when torch loads
from minillm.config import EngineConfig, ModelConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.llm import LLM
from minillm.models.llama import Transformer
from minillm.models.loader import load_model, load_tokenizer
from minillm.outputs import RequestOutput
from minillm.sampling.guided import GuidedDecodingParams
from minillm.sampling.params import SamplingParams

__all__ = ["LLM", "EngineConfig", "GuidedDecodingParams", "LLMEngine", "ModelConfig", "RequestOutput",
           "SamplingParams", "Transformer", "load_model", "load_tokenizer"]
__version__ = "0.1.0"
