"""Verifier kinds by name, built around an already loaded model or loaded from a directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.search.verifiers.base import Verifier
from runtime.search.verifiers.confidence import ConfidenceVerifier
from runtime.search.verifiers.judge import JudgeVerifier
from runtime.search.verifiers.math_shepherd import MathShepherdVerifier
from runtime.search.verifiers.outcome import OutcomeVerifier
from runtime.search.verifiers.qwen_prm import QwenPRMVerifier
from runtime.search.verifiers.rlhflow import RLHFlowVerifier
from runtime.search.verifiers.skywork import SkyworkPRMVerifier

VERIFIERS: dict[str, type[Verifier]] = {cls.kind: cls for cls in (
    MathShepherdVerifier, RLHFlowVerifier, QwenPRMVerifier, SkyworkPRMVerifier, OutcomeVerifier,
    JudgeVerifier, ConfidenceVerifier)}

# Verifiers that need no model of their own: they run on the generator.
GENERATOR_VERIFIERS = ("judge", "confidence")


def verifier_class(kind: str) -> type[Verifier]:
    """The class for a kind name; `_` and `-` are interchangeable, case is ignored."""
    cls = VERIFIERS.get(kind.strip().lower().replace("_", "-"))
    if cls is None:
        raise ValueError(f"unknown verifier {kind!r}; expected one of {', '.join(VERIFIERS)}")
    return cls


def build_verifier(kind: str, model: Any, tokenizer: Any, **options: Any) -> Verifier:
    """A verifier of `kind` around a loaded model and tokenizer; `options` go to its constructor
    (e.g. `batch_size`, `step_separator`, `value_head`)."""
    return verifier_class(kind)(model, tokenizer, **options)


def load_verifier(kind: str, directory: str | Path, *, device: Any = "cpu", dtype: Any = None,
                  trust_remote_code: bool = False, **options: Any) -> Verifier:
    """Load a verifier checkpoint (safetensors only) with the Auto class its family needs.

    The published Qwen2.5-Math-PRM checkpoints ship their own model class: with
    `trust_remote_code=True` a `qwen-prm` loads through `AutoModel` as its model card does, otherwise
    through `AutoModelForTokenClassification`.
    """
    import transformers

    cls = verifier_class(kind)
    auto_name = cls.auto_class
    if cls is QwenPRMVerifier and trust_remote_code:
        auto_name = "AutoModel"
    auto = getattr(transformers, auto_name)
    model = auto.from_pretrained(str(directory), dtype=dtype or "auto", use_safetensors=True,
                                 trust_remote_code=trust_remote_code).to(device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory),
                                                           trust_remote_code=trust_remote_code)
    return cls(model, tokenizer, **options)
