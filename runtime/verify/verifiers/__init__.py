"""Verifier adapters: one class per verifier family, each scoring the steps of search paths with a
plain transformers model. `build_verifier(kind, model, tokenizer, **options)` picks the class."""

from runtime.verify.verifiers.base import ScoringInput, Verifier, tokenize_marked
from runtime.verify.verifiers.confidence import ConfidenceVerifier, confidence_from_logprobs
from runtime.verify.verifiers.judge import JudgeVerifier
from runtime.verify.verifiers.math_shepherd import MathShepherdVerifier
from runtime.verify.verifiers.outcome import OutcomeVerifier
from runtime.verify.verifiers.qwen_prm import QwenPRMVerifier
from runtime.verify.verifiers.registry import (
    GENERATOR_VERIFIERS,
    VERIFIERS,
    build_verifier,
    load_verifier,
    verifier_class,
)
from runtime.verify.verifiers.rlhflow import RLHFlowVerifier
from runtime.verify.verifiers.skywork import SkyworkPRMVerifier, load_value_head

__all__ = [
    "GENERATOR_VERIFIERS", "VERIFIERS", "ConfidenceVerifier", "JudgeVerifier", "MathShepherdVerifier",
    "OutcomeVerifier", "QwenPRMVerifier", "RLHFlowVerifier", "ScoringInput", "SkyworkPRMVerifier",
    "Verifier", "build_verifier", "confidence_from_logprobs", "load_value_head", "load_verifier",
    "tokenize_marked", "verifier_class",
]
