"""trt-lookahead: exact lookahead decoding for Llama models with static, compiled step shapes."""

from trt_lookahead.lookahead.config import LookaheadConfig
from trt_lookahead.lookahead.sampling import SamplingParams

__all__ = ["LookaheadConfig", "SamplingParams"]
__version__ = "0.1.0"
