"""splitmoe: attention-FFN disaggregated inference for Mixture-of-Experts language models."""

from splitmoe.llm import LLM, RankFailure
from splitmoe.outputs import RequestMetrics, RequestOutput
from splitmoe.sampling_params import SamplingParams

__all__ = ["LLM", "RankFailure", "RequestMetrics", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
