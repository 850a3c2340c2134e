"""specdraft: lossless speculative decoding for causal language models."""

from specdraft.constraints import Constraint
from specdraft.drafters import DRAFTERS, Draft, Drafter, ModelDrafter, make_drafter
from specdraft.engine import Completion, SpeculativeDecoder
from specdraft.run import StepEvent
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.loading import check_compatible, load_model, prepare_draft
from specdraft.sampling import SamplingParams
from specdraft.stats import GenerationStats

__version__ = "0.1.0"

__all__ = [
    "CausalLM", "Completion", "Constraint", "DRAFTERS", "Draft", "Drafter", "GenerationStats", "ModelDrafter",
    "SamplingParams", "SpecdraftError", "SpeculativeDecoder", "StepEvent", "check_compatible",
    "load_model", "make_drafter", "prepare_draft",
]
