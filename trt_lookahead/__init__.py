"""trt-lookahead: exact lookahead decoding for Llama models with static, compiled step shapes."""

from trt_lookahead.config import LookaheadConfig
from trt_lookahead.sampling import SamplingParams

__all__ = ["LookaheadConfig", "SamplingParams"]
__version__ = "0.1.0"
