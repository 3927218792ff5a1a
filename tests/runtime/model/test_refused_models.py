"""A model ponder cannot run exactly is refused at start-up in one line naming what it lacks, and a model
that fails to load ends `ponder serve` with a non-zero status (runtime.model.families, runtime.preflight,
server.cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from runtime.model import families
from runtime.preflight import MODEL_REFUSED, problem
from runtime.wire.options import RuntimeOptions
from tests.replicas.generators import write_generator

ROOT = Path(__file__).resolve().parents[3]
SHORT_CONV = "short-convolution layers keep a convolution state ponder does not hold"


def config_of(model_type: str, **fields):
    return AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("model_type, fields, lacking", [
    ("lfm2", {"num_hidden_layers": 3, "full_attn_idxs": [2]}, [SHORT_CONV]),
    ("jamba", {"num_hidden_layers": 2}, ["Mamba layers keep a recurrent state ponder does not hold"]),
    ("granitemoehybrid", {"num_hidden_layers": 2},
     ["linear-attention layers keep a recurrent state ponder does not hold"]),
    ("mamba", {}, ["Mamba layers keep a recurrent state ponder does not hold"]),
])
def test_a_family_keeping_state_outside_the_kv_is_named(model_type, fields, lacking):
    assert families.lacks(config_of(model_type, **fields)) == lacking


def test_a_multimodal_config_is_judged_by_its_text_model():
    """Qwen3.5's Gated DeltaNet layers run in ponder's recurrent layers (runtime.model.recurrent)."""
    config = config_of("qwen3_5", text_config={"num_hidden_layers": 4})
    assert families.family(config) == "qwen3_5"
    assert families.refusal(config, "/m") is None


@pytest.mark.parametrize("model_type, fields", [
    ("llama", {}), ("qwen3", {}), ("qwen3_moe", {}), ("mistral", {}), ("phi3", {}), ("smollm3", {}),
    ("gemma2", {}), ("gemma3_text", {}), ("gpt_oss", {"num_hidden_layers": 2}),
    ("qwen3_5_text", {"num_hidden_layers": 4}), ("qwen3_5_moe_text", {"num_hidden_layers": 4}),
    ("qwen3_next", {"num_hidden_layers": 4}),
])
def test_the_families_ponder_serves_lack_nothing(model_type, fields):
    assert families.lacks(config_of(model_type, **fields)) == []
    families.check(config_of(model_type, **fields), "/m")  # does not raise


def test_bidirectional_attention_is_refused():
    config = config_of("gemma3_text", use_bidirectional_attention=True)
    assert families.lacks(config) == ["bidirectional attention, where ponder's paged attention is causal"]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """An LFM2 checkpoint directory (short convolutions beside attention) as far as start-up reads it:
    the config, and a safetensors file."""
    directory = tmp_path_factory.mktemp("lfm2")
    config = config_of("lfm2", num_hidden_layers=3, full_attn_idxs=[2], hidden_size=64)
    config.save_pretrained(directory)
    save_file({"model.embedding_norm.weight": torch.ones(64)}, str(directory / "model.safetensors"))
    return directory


def test_the_settings_check_refuses_a_hybrid_model(hybrid_dir):
    verdict = problem(RuntimeOptions(model=str(hybrid_dir), device="cpu"))
    assert verdict.status == MODEL_REFUSED
    assert verdict.problem == (f"{hybrid_dir}: lfm2: {SHORT_CONV}; ponder refuses it rather than serve "
                               "wrong tokens")


def test_the_settings_check_reads_a_config_whose_sizes_differ_by_layer(tmp_path):
    """Gemma 4's config answers no global head size (transformers raises on reading it): the check once
    ended the runtime process before it could say anything."""
    from tests.replicas.families import write_family

    directory = write_family("gemma4_text", tmp_path / "gemma4")
    assert problem(RuntimeOptions(model=str(directory), device="cpu")).problem is None


def serve(model: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(model), "--port", "0",
                           "--device", "cpu"], capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "CI": "true"})


def test_serve_refuses_a_hybrid_model_in_one_line(hybrid_dir):
    out = serve(hybrid_dir)
    assert out.returncode == 2
    assert out.stderr == (f"ponder: refusing the model {hybrid_dir}: lfm2: {SHORT_CONV}; ponder refuses "
                          "it rather than serve wrong tokens\n")


def test_serve_exits_when_the_model_fails_to_load(tmp_path):
    """The settings check passes (it reads no tokenizer), the load fails: the server stops and exits 1
    with the runtime's message on its last line, instead of answering 503 forever."""
    directory = write_generator("llama3", tmp_path / "llama3")
    (directory / "tokenizer.json").write_text("{not json")
    out = serve(directory)
    assert out.returncode == 1
    last = out.stderr.splitlines()[-1]
    assert last.startswith("ponder: cannot load the model: "), out.stderr[-2000:]
    assert last.startswith(f"ponder: cannot load the model: RuntimeError: the tokenizer of {directory} cannot be "
                           "read: "), last
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_serve_still_exits_3_where_its_port_is_taken(tiny_llama):
    """uvicorn's own start-up failure status (as `uvicorn.run` gives it) is kept."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(tiny_llama), "--port",
                              str(taken.getsockname()[1]), "--device", "cpu"], capture_output=True, text=True,
                             cwd=ROOT, timeout=300)
    assert out.returncode == 3, out.stderr[-2000:]
    assert "cannot load the model" not in out.stderr


def test_the_replica_configs_need_nothing_ponder_lacks(tmp_path):
    """Every published generator layout the replicas copy is served, not refused."""
    from tests.replicas.families import FAMILIES, write_family

    for family in FAMILIES:
        directory = write_family(family, tmp_path / family)
        config = AutoConfig.from_pretrained(directory)
        assert families.lacks(config) == [], family
        assert json.loads((directory / "config.json").read_text())["model_type"] == config.model_type


@pytest.mark.parametrize("feature, match", [
    ({"position_bias": torch.zeros(1)}, "does not implement 'position_bias' \\(Module\\)"),
    ({"sinks": torch.zeros(4)}, "does not implement 'sinks'"),
    ({"is_causal": False}, "is causal; Module is not"),
])
def test_an_attention_feature_ponder_lacks_stops_the_step_naming_it(feature, match):
    """A family passing transformers' attention function something ponder's does not implement is
    stopped, never attended without it."""
    from runtime.model.attention import paged_attention

    module = torch.nn.Module()
    module.layer_idx = 0
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)
    with pytest.raises(NotImplementedError, match=match):
        paged_attention(module, q, kv, kv, None, ponder_attention=None, **feature)


def test_the_head_wise_residency_refuses_attention_it_does_not_compute():
    """The head-wise KV residency (one long request streamed a KV-head group at a time) computes plain
    causal attention: a layer with a window, soft-capping or sinks stops, naming them, never attends without."""
    from runtime.model.attention import AttentionMetadata, attend

    meta = AttentionMetadata(None, torch.empty(0), [], [], attention=lambda *args: pytest.fail("attended"))
    q, kv = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    with pytest.raises(NotImplementedError, match="does not apply attention sinks or a sliding window"):
        attend(meta, 0, q, kv, kv, None, window=24, sinks=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="does not apply soft-capping"):
        attend(meta, 0, q, kv, kv, None, softcap=50.0)


def test_a_reward_model_ponder_cannot_run_exactly_is_refused_too(tiny_llama, tmp_path):
    """A verifier attends through the same paged attention: a hybrid one is refused as a generator is."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import VOCAB, build_tokenizer
    from tests.runtime.engine_helpers import engine_for

    config = config_of("lfm2", vocab_size=len(VOCAB), hidden_size=64, intermediate_size=128,
                       num_hidden_layers=3, full_attn_idxs=[2], num_attention_heads=4, num_key_value_heads=2)
    verifier = tmp_path / "prm"
    AutoModelForCausalLM.from_config(config).save_pretrained(verifier)
    build_tokenizer(verifier)
    with pytest.raises(families.UnsupportedModel, match=f"^{verifier}: lfm2: {SHORT_CONV};"):
        engine_for(tiny_llama, verifiers={"prm": {"kind": "math-shepherd", "path": str(verifier)}})


def meta_model(model_type: str, **fields):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_of(model_type, hidden_size=64, intermediate_size=64, **fields))


@pytest.mark.parametrize("model_type, fields, owners", [
    ("qwen3_5_text", {"num_hidden_layers": 4}, []),  # ponder holds its Gated DeltaNet layers' state
    ("lfm2", {"num_hidden_layers": 3, "full_attn_idxs": [2]}, ["Lfm2ShortConv"]),
    ("jamba", {"num_hidden_layers": 2}, ["JambaMambaMixer"]),
    ("llama", {"num_hidden_layers": 2}, []),
    ("gpt_oss", {"num_hidden_layers": 2}, []),
])
def test_the_loaded_modules_holding_a_causal_convolution_are_named(model_type, fields, owners):
    assert families.stateful_modules(meta_model(model_type, **fields)) == owners


def test_a_stateful_layer_the_config_does_not_announce_is_refused_once_loaded():
    """A family outside the tables (here an LFM2 whose config claims full attention everywhere, as a
    remote-code hybrid might) is caught by its modules."""
    model = meta_model("lfm2", num_hidden_layers=3, full_attn_idxs=[2])
    model.config.layer_types = ["full_attention"] * 3
    assert families.lacks(model.config) == []
    with pytest.raises(families.UnsupportedModel, match=r"^/m: lfm2: its Lfm2ShortConv layers keep a "
                                                        r"convolution state across tokens that ponder does not hold;"):
        families.check_loaded(model, "/m")
    families.check_loaded(meta_model("llama", num_hidden_layers=2), "/m")  # does not raise
