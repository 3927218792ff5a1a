"""Verifier kinds by name, built around an already loaded model or loaded from a directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.model.loader import check_checkpoint, load_strictly
from runtime.verify.verifiers.base import Verifier
from runtime.verify.verifiers.confidence import ConfidenceVerifier
from runtime.verify.verifiers.judge import JudgeVerifier
from runtime.verify.verifiers.math_shepherd import MathShepherdVerifier
from runtime.verify.verifiers.outcome import OutcomeVerifier
from runtime.verify.verifiers.qwen_prm import QwenPRMVerifier
from runtime.verify.verifiers.rlhflow import RLHFlowVerifier
from runtime.verify.verifiers.skywork import SkyworkPRMVerifier

VERIFIERS: dict[str, type[Verifier]] = {cls.kind: cls for cls in (
    MathShepherdVerifier, RLHFlowVerifier, QwenPRMVerifier, SkyworkPRMVerifier, OutcomeVerifier,
    JudgeVerifier, ConfidenceVerifier)}

# Verifiers that need no model of their own: they run on the generator.
GENERATOR_VERIFIERS = ("judge", "confidence", "calculator")


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
    """Load a verifier checkpoint (safetensors only) strictly: a parameter the checkpoint leaves
    unset, or a tensor nothing reads, stops it (`runtime.model.loader.CheckpointMismatch`) unless the kind
    lists that key as ignorable."""
    import transformers

    cls = verifier_class(kind)
    model = load_strictly(verifier_model_class(cls, directory, trust_remote_code), str(directory),
                          ignorable=cls.ignorable_keys, dtype=dtype or "auto", use_safetensors=True,
                          trust_remote_code=trust_remote_code).to(device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory),
                                                           trust_remote_code=trust_remote_code)
    return cls(model, tokenizer, **options)


def check_verifier(kind: str, directory: str | Path, *, trust_remote_code: bool = False) -> None:
    """`load_verifier`'s strict check without reading any weight (start-up's settings check)."""
    cls = verifier_class(kind)
    check_checkpoint(verifier_model_class(cls, directory, trust_remote_code), str(directory),
                     ignorable=cls.ignorable_keys, use_safetensors=True, trust_remote_code=trust_remote_code)


def verifier_model_class(cls: type[Verifier], directory: str | Path, trust_remote_code: bool) -> Any:
    """The class that loads this kind's checkpoint.

    A checkpoint in the published Qwen2.5-Math-PRM layout (`Qwen2ForProcessRewardModel`) loads into
    ponder's own copy of that layout, its two-layer head included; with `trust_remote_code` it loads
    through `AutoModel` and the checkpoint's own code, as its model card does. Every other kind uses
    its family's Auto class.
    """
    import transformers

    if cls is QwenPRMVerifier:
        if trust_remote_code:
            return transformers.AutoModel
        from runtime.verify.verifiers.qwen_prm_model import ARCHITECTURE, Qwen2ProcessRewardModel

        config = transformers.AutoConfig.from_pretrained(str(directory))
        if ARCHITECTURE in (config.architectures or ()):
            return Qwen2ProcessRewardModel
    return getattr(transformers, cls.auto_class)
