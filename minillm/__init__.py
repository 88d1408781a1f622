"""minillm: a small, complete, fast LLM inference engine, and the course that builds it.

    from minillm import LLM, SamplingParams
    llm = LLM()                                   # embedded SmolLM2-135M-Instruct, offline
    out = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))[0]
"""

from .config import EngineConfig, ModelConfig
from .engine import LLMEngine
from .llm import LLM, RequestOutput
from .loader import load_model, load_tokenizer
from .model import Transformer
from .sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams", "Transformer",
           "load_model", "load_tokenizer"]
__version__ = "0.1.0"
