"""Strict loading: a checkpoint that leaves a parameter at random, or holds a tensor nothing reads,
is refused for generators and verifiers alike, at start-up with one line and again when it loads.

The checkpoints here are written tensor by tensor with safetensors (not saved from the class the
loader uses), then damaged the way real downloads are: a tensor dropped, a tensor renamed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runtime.model.loader import CheckpointMismatch, Ignorable, check_loading, load_causal_lm, resolve_model
from runtime.verify.verifiers.registry import check_verifier, load_verifier
from tests.conftest import build_model

ROOT = Path(__file__).resolve().parents[3]
# With CI set, transformers hands its load report to the root logger: the one line must hold there too.
LOUD = {**os.environ, "CI": "true"}


def edit_tensors(directory: Path, edit) -> Path:
    """Rewrite `directory`'s single safetensors file through `edit(dict) -> dict`."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})
    return directory


def renamed(key: str, new_key: str):
    def edit(tensors: dict) -> dict:
        tensors[new_key] = tensors.pop(key)
        return tensors
    return edit


def dropped(key: str):
    def edit(tensors: dict) -> dict:
        del tensors[key]
        return tensors
    return edit


def added(extra: dict):
    def edit(tensors: dict) -> dict:
        return {**tensors, **extra}
    return edit


@pytest.fixture
def generator_dir(tmp_path) -> Path:
    return build_model(tmp_path / "generator", "llama", seed=5)


def load(directory: Path):
    return load_causal_lm(resolve_model(str(directory)), torch.device("cpu"), torch.float32, "sdpa")


# -- the message -----------------------------------------------------------------------------------
def test_the_message_is_one_line_naming_the_path_and_the_first_keys():
    info = {"missing_keys": {f"model.layers.{i}.mlp.up_proj.weight" for i in range(5)},
            "unexpected_keys": {"model.layers.0.mlp.upp_proj.weight"}, "mismatched_keys": set()}
    with pytest.raises(CheckpointMismatch) as caught:
        check_loading("/models/m", info)
    assert str(caught.value) == (
        "/models/m: 5 model parameter(s) missing from the checkpoint (model.layers.0.mlp.up_proj.weight, "
        "model.layers.1.mlp.up_proj.weight, model.layers.2.mlp.up_proj.weight, ... 2 more); "
        "1 checkpoint tensor(s) no parameter reads (model.layers.0.mlp.upp_proj.weight); ponder serves no "
        "weight left at random (check that the checkpoint is complete and matches its config's architecture)")
    assert "\n" not in str(caught.value)


def test_exemptions_apply_only_to_their_side():
    rule = Ignorable("unexpected", r"^lm_head\.weight$", "unused")
    check_loading("m", {"missing_keys": set(), "unexpected_keys": {"lm_head.weight"}}, [rule])
    check_loading("m", {"unexpected_keys": {"model.layers.1.self_attn.rotary_emb.inv_freq"}})
    with pytest.raises(CheckpointMismatch, match="1 model parameter"):
        check_loading("m", {"missing_keys": {"lm_head.weight"}, "unexpected_keys": set()}, [rule])


# -- generators ------------------------------------------------------------------------------------
def test_a_complete_generator_loads(generator_dir):
    model = load(generator_dir)
    from safetensors.torch import load_file

    on_disk = load_file(generator_dir / "model.safetensors")
    assert torch.equal(model.state_dict()["model.layers.1.mlp.up_proj.weight"],
                       on_disk["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("damage, named", [
    (dropped("model.layers.1.mlp.down_proj.weight"), "1 model parameter(s) missing from the checkpoint "
                                                     "(model.layers.1.mlp.down_proj.weight)"),
    (renamed("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.query.weight"),
     "1 checkpoint tensor(s) no parameter reads (model.layers.0.self_attn.query.weight)"),
])
def test_a_damaged_generator_is_refused_when_checked_and_when_loaded(generator_dir, damage, named):
    edit_tensors(generator_dir, damage)
    from runtime.model.loader import check_causal_lm

    with pytest.raises(CheckpointMismatch, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_causal_lm(resolve_model(str(generator_dir)))
    with pytest.raises(CheckpointMismatch, match=str(generator_dir)):
        load(generator_dir)


def test_serve_stops_at_start_up_with_one_line_for_a_damaged_generator(generator_dir):
    edit_tensors(generator_dir, dropped("model.norm.weight"))
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(generator_dir),
                          "--port", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=LOUD)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"ponder: refusing the checkpoint {generator_dir}: 1 model parameter(s) "
                                 "missing from the checkpoint (model.norm.weight);")


def test_serve_stops_at_start_up_with_one_line_for_a_damaged_verifier(generator_dir, tmp_path):
    verifier = build_model(tmp_path / "prm", "llama", seed=6)
    edit_tensors(verifier, renamed("lm_head.weight", "lm_head.weights"))
    config = tmp_path / "ponder.toml"
    config.write_text(f'[verifiers.shepherd]\nkind = "math-shepherd"\npath = "{verifier}"\n')
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--model", str(generator_dir),
                          "--config", str(config), "--port", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, env=LOUD)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"ponder: refusing the checkpoint {verifier}: 1 model parameter(s) missing "
                                 "from the checkpoint (lm_head.weight); 1 checkpoint tensor(s) no parameter "
                                 "reads (lm_head.weights);")


# -- verifiers -------------------------------------------------------------------------------------
def test_a_damaged_verifier_is_refused(tmp_path):
    directory = edit_tensors(build_model(tmp_path / "prm", "llama", seed=7),
                             dropped("model.layers.0.input_layernorm.weight"))
    with pytest.raises(CheckpointMismatch, match=r"model.layers.0.input_layernorm.weight"):
        check_verifier("math-shepherd", directory)
    with pytest.raises(CheckpointMismatch, match=str(directory)):
        load_verifier("math-shepherd", directory)


def test_a_value_head_beside_the_body_is_read_not_refused(tmp_path):
    """Skywork keeps `v_head.summary.*` in the body's own file; the skywork kind reads it itself."""
    head = {"v_head.summary.weight": torch.randn(1, 64), "v_head.summary.bias": torch.randn(1)}
    directory = edit_tensors(build_model(tmp_path / "skywork", "qwen2", seed=8), added(head))
    verifier = load_verifier("skywork", directory, step_token="+")  # this word-level vocabulary has no newline
    assert torch.equal(verifier.value_head.weight, head["v_head.summary.weight"])
    # The same file is refused where no verifier reads the head.
    with pytest.raises(CheckpointMismatch, match=r"2 checkpoint tensor\(s\) no parameter reads \(v_head"):
        load_verifier("math-shepherd", directory)


# -- the Qwen PRM's published layout -----------------------------------------------------------------
def write_qwen_prm(directory: Path, *, drop: str | None = None) -> dict[str, torch.Tensor]:
    """A tiny checkpoint in Qwen2.5-Math-PRM-7B's layout: `architectures: [Qwen2ForProcessRewardModel]`,
    a Qwen2 body under `model.*`, the head as `score.0.*` [h, h] and `score.2.*` [2, h], no LM head."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model

    from tests.conftest import build_tokenizer

    config = Qwen2Config(vocab_size=78, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(9)
    tensors = {f"model.{key}": value for key, value in Qwen2Model(config).state_dict().items()
               if not key.endswith("inv_freq")}
    tensors |= {"score.0.weight": torch.randn(64, 64) * 0.2, "score.0.bias": torch.randn(64) * 0.2,
                "score.2.weight": torch.randn(2, 64) * 0.2, "score.2.bias": torch.randn(2) * 0.2}
    if drop:
        del tensors[drop]
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    fields = config.to_dict() | {"architectures": ["Qwen2ForProcessRewardModel"], "model_type": "qwen2",
                                 "auto_map": {"AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"}}
    (directory / "config.json").write_text(json.dumps(fields))
    build_tokenizer(directory)
    return tensors


def test_the_qwen_prm_loads_its_two_layer_head_without_remote_code(tmp_path):
    tensors = write_qwen_prm(tmp_path / "qwen-prm")
    verifier = load_verifier("qwen-prm", tmp_path / "qwen-prm")
    head = verifier.head
    assert isinstance(head, torch.nn.Sequential) and len(head) == 3
    for index in (0, 2):
        assert torch.equal(head[index].weight, tensors[f"score.{index}.weight"])
        assert torch.equal(head[index].bias, tensors[f"score.{index}.bias"])
    hidden = torch.randn(3, 64)
    expected = (torch.relu(hidden @ tensors["score.0.weight"].T + tensors["score.0.bias"])
                @ tensors["score.2.weight"].T + tensors["score.2.bias"]).softmax(-1)[:, 1]
    assert torch.allclose(verifier.read_scores(hidden), expected, atol=1e-6)


def test_a_qwen_prm_without_its_head_is_refused(tmp_path):
    write_qwen_prm(tmp_path / "qwen-prm", drop="score.2.weight")
    with pytest.raises(CheckpointMismatch, match=r"\(score.2.weight\)"):
        load_verifier("qwen-prm", tmp_path / "qwen-prm")
