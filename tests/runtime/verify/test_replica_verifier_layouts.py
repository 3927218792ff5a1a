"""Verifier checkpoints laid out as the published ones are (tests/replicas): their files have the
published layout, and ponder's `load_verifier(kind, directory).score(...)` gives what each model
card's own usage code gives on them (written out here, adapted only to the replica)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, Qwen2Model

from runtime.verify.verifiers.registry import load_verifier
from tests.replicas.generators import HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS
from tests.replicas.tokenizers import token_ids
from tests.replicas.verifiers import VERIFIER_KINDS, write_verifier

QUESTION = "Janet's ducks lay 16 eggs per day. She eats 3 and bakes with 4. How many are left?"
STEPS = ["Janet's ducks lay 16 eggs per day.", "She uses 3 + 4 = 7 of them.",
         "So 16 - 7 = 9 are left. The answer is \\boxed{9}."]
ATOL = 1e-4
HEAD_DIM = HIDDEN // NUM_HEADS

HEADS = {  # the tensors each published checkpoint holds beside its decoder body, with their shapes
    "qwen-prm": {"score.0.weight": [HIDDEN, HIDDEN], "score.0.bias": [HIDDEN], "score.2.weight": [2, HIDDEN],
                 "score.2.bias": [2]},
    "math-shepherd": {"lm_head.weight": None},
    "rlhflow": {"lm_head.weight": None},
    "skywork": {"v_head.summary.weight": [1, HIDDEN], "v_head.summary.bias": [1]},
    "orm": {"score.weight": [1, HIDDEN]},
}
QKV_BIAS = {"qwen-prm", "skywork"}
SHARDED = {"qwen-prm", "math-shepherd", "rlhflow", "orm"}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("verifiers")
    return {kind: write_verifier(kind, root / kind) for kind in VERIFIER_KINDS}


def tensors_of(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


def body_shapes(kind: str, vocab: int) -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [vocab, HIDDEN], "model.norm.weight": [HIDDEN]}
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": [q, HIDDEN], p + "self_attn.k_proj.weight": [kv, HIDDEN],
                       p + "self_attn.v_proj.weight": [kv, HIDDEN], p + "self_attn.o_proj.weight": [HIDDEN, q],
                       p + "mlp.gate_proj.weight": [INTERMEDIATE, HIDDEN],
                       p + "mlp.up_proj.weight": [INTERMEDIATE, HIDDEN],
                       p + "mlp.down_proj.weight": [HIDDEN, INTERMEDIATE],
                       p + "input_layernorm.weight": [HIDDEN], p + "post_attention_layernorm.weight": [HIDDEN]})
        if kind in QKV_BIAS:
            shapes.update({p + "self_attn.q_proj.bias": [q], p + "self_attn.k_proj.bias": [kv],
                           p + "self_attn.v_proj.bias": [kv]})
    return shapes


# ---------------------------------------------------------------------------------------------
# Layout


@pytest.mark.parametrize("kind", VERIFIER_KINDS)
def test_tensor_names_shapes_and_shards_are_the_published_ones(replicas, kind):
    directory = replicas[kind]
    config = json.loads((directory / "config.json").read_text())
    tensors = tensors_of(directory)
    expected = body_shapes(kind, config["vocab_size"])
    expected.update({name: shape or [config["vocab_size"], HIDDEN] for name, shape in HEADS[kind].items()})
    assert {k: list(t.shape) for k, t in tensors.items()} == expected
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    index_path = directory / "model.safetensors.index.json"
    if kind in SHARDED:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        assert set(weight_map) == set(tensors)
        assert sorted(set(weight_map.values())) == ["model-00001-of-00002.safetensors",
                                                    "model-00002-of-00002.safetensors"]
    else:
        assert not index_path.exists()
        assert [p.name for p in directory.glob("*.safetensors")] == ["model.safetensors"]


def test_config_fields_are_the_published_ones(replicas):
    configs = {kind: json.loads((d / "config.json").read_text()) for kind, d in replicas.items()}
    assert configs["qwen-prm"]["architectures"] == ["Qwen2ForProcessRewardModel"]
    assert configs["qwen-prm"]["auto_map"] == {"AutoConfig": "configuration_qwen2_rm.Qwen2RMConfig",
                                               "AutoModel": "modeling_qwen2_rm.Qwen2ForProcessRewardModel"}
    assert configs["math-shepherd"]["architectures"] == ["MistralForCausalLM"]
    assert configs["math-shepherd"]["sliding_window"] == 4096
    assert configs["rlhflow"]["architectures"] == ["LlamaForCausalLM"]
    assert configs["rlhflow"]["rope_scaling"]["rope_type"] == "llama3"
    assert configs["skywork"]["architectures"] == ["Qwen2ForPrmModel"]
    assert configs["orm"]["architectures"] == ["LlamaForSequenceClassification"]
    assert configs["orm"]["id2label"] == {"0": "LABEL_0"}
    assert configs["orm"]["pad_token_id"] == token_ids(replicas["orm"])["[PAD]"]
    assert {k: c["tie_word_embeddings"] for k, c in configs.items()} == {
        "qwen-prm": False, "math-shepherd": False, "rlhflow": False, "skywork": True, "orm": False}
    assert {c["torch_dtype"] for c in configs.values()} == {"bfloat16"}
    assert {k: c["model_type"] for k, c in configs.items()} == {
        "qwen-prm": "qwen2", "math-shepherd": "mistral", "rlhflow": "llama", "skywork": "qwen2", "orm": "llama"}


def test_special_tokens_sit_where_the_published_ones_do(replicas):
    qwen = token_ids(replicas["qwen-prm"])
    # Published: <|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645, <extra_0> 151651.
    assert [qwen[t] - qwen["<|endoftext|>"] for t in ("<|im_start|>", "<|im_end|>", "<extra_0>")] == [1, 2, 8]
    assert "<|quad_end|>" not in qwen
    shepherd = AutoTokenizer.from_pretrained(replicas["math-shepherd"])
    assert [shepherd.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "<0x0A>")] == [0, 1, 2, 13]
    assert shepherd.convert_ids_to_tokens(shepherd.encode("+ -")) == ["<s>", "▁+", "▁-"]
    assert shepherd.convert_ids_to_tokens(shepherd.encode("ки")) == ["<s>", "▁ки"]
    assert shepherd.chat_template is None and shepherd.pad_token is None
    for kind in ("rlhflow", "orm"):  # Llama 3.1: <|begin_of_text|> 128000 ... <|eot_id|> 128009
        llama = token_ids(replicas[kind])
        offsets = [llama[t] - llama["<|begin_of_text|>"] for t in ("<|start_header_id|>", "<|end_header_id|>",
                                                                   "<|eot_id|>")]
        assert offsets == [6, 7, 9]
    assert AutoTokenizer.from_pretrained(replicas["skywork"]).bos_token == "<|endoftext|>"


# ---------------------------------------------------------------------------------------------
# Scores: each model card's usage code against ponder


def ponder_scores(directory, kind) -> list[float]:
    verifier = load_verifier(kind, directory, dtype=torch.float32)
    return verifier.score(QUESTION, [STEPS])[0]


QWEN_SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."


def qwen_prm_card_scores(directory, question: str, steps: list[str]) -> list[float]:
    """Qwen/Qwen2.5-Math-PRM-7B README: steps joined and ended by <extra_0> in the assistant turn,
    `make_step_rewards(outputs[0], input_ids == step_sep_id)`. The published model is remote code; its
    head (score.0 -> ReLU -> score.2) is computed here from the checkpoint's tensors."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    body = Qwen2Model.from_pretrained(directory, dtype=torch.float32).eval()
    t = {k: v.float() for k, v in tensors_of(directory).items()}

    def make_step_rewards(logits, token_masks):
        probabilities = F.softmax(logits, dim=-1)
        probabilities = probabilities * token_masks.unsqueeze(-1)
        all_scores_res = []
        for i in range(probabilities.size(0)):
            sample = probabilities[i]
            positive_probs = sample[sample != 0].view(-1, 2)[:, 1]
            all_scores_res.append(positive_probs.cpu().tolist())
        return all_scores_res

    messages = [{"role": "system", "content": QWEN_SYSTEM},
                {"role": "user", "content": question},
                {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"}]
    conversation_str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    input_ids = tokenizer.encode(conversation_str, return_tensors="pt")
    with torch.no_grad():
        hidden = body(input_ids=input_ids).last_hidden_state
        logits = F.relu(hidden @ t["score.0.weight"].T + t["score.0.bias"]) @ t["score.2.weight"].T + t["score.2.bias"]
    step_sep_id = tokenizer.encode("<extra_0>")[0]
    return make_step_rewards(logits, input_ids == step_sep_id)[0]


def test_qwen_prm_matches_the_model_card(replicas):
    directory = replicas["qwen-prm"]
    expected = qwen_prm_card_scores(directory, QUESTION, STEPS)
    assert len(expected) == len(STEPS)
    assert ponder_scores(directory, "qwen-prm") == pytest.approx(expected, abs=ATOL)


def test_math_shepherd_matches_the_model_card(replicas):
    """peiyi9979/math-shepherd-mistral-7b-prm card: `f"{question} {output}"` with " ки" ending each step
    and "\\n" between steps; `logits[:, :, candidate_tokens].softmax(-1)[:, :, 0]` at the tag tokens."""
    directory = replicas["math-shepherd"]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    good_token, bad_token, step_tag = "+", "-", "ки"
    candidate_tokens = tokenizer.encode(f"{good_token} {bad_token}")[1:]
    step_tag_id = tokenizer.encode(f"{step_tag}")[-1]
    output = "\n".join(f"{step} {step_tag}" for step in STEPS)
    input_id = torch.tensor([tokenizer.encode(f"{QUESTION} {output}")])
    with torch.no_grad():
        logits = model(input_id).logits[:, :, candidate_tokens]
        scores = logits.softmax(dim=-1)[:, :, 0]
        step_scores = scores[input_id == step_tag_id].tolist()
    assert len(step_scores) == len(STEPS)
    assert ponder_scores(directory, "math-shepherd") == pytest.approx(step_scores, abs=ATOL)


def test_rlhflow_matches_the_model_card(replicas):
    """RLHFlow/Llama3.1-8B-PRM-Deepseek-Data card: per step, the conversation so far (user = step, the
    first prefixed by the question; assistant = "+") through the chat template, and
    `logits[:, -3, candidate_tokens].softmax(-1)[:, 0]`."""
    directory = replicas["rlhflow"]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    candidate_tokens = [tokenizer.encode("+")[-1], tokenizer.encode("-")[-1]]
    conversation, expected = [], []
    for k, step in enumerate(STEPS):
        conversation.append({"content": f"{QUESTION} {step}" if k == 0 else step, "role": "user"})
        conversation.append({"content": "+", "role": "assistant"})
        # apply_chat_template(conversation, return_tensors="pt"), spelled out: render, then encode the
        # rendering without adding special tokens (the template holds the BOS).
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(input_ids).logits[:, -3, candidate_tokens]
        expected.append(logits.softmax(dim=-1)[:, 0][0].item())
    assert ponder_scores(directory, "rlhflow") == pytest.approx(expected, abs=ATOL)


def test_skywork_matches_the_reference_inference_code(replicas):
    """SkyworkAI/skywork-o1-prm-inference: `prepare_input(problem, response, tokenizer, step_token="\\n")`,
    the value head on the last hidden state, `return_probs=True` (sigmoid), read at the reward flags."""
    directory = replicas["skywork"]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    t = {k: v.float() for k, v in tensors_of(directory).items()}

    def prepare_input(problem, response, tokenizer, step_token):
        prompt_ids = tokenizer.encode(tokenizer.bos_token + problem + "\n")
        response_ids, reward_flags = [], [0] * len(prompt_ids)
        step_token_id = tokenizer.encode(step_token)[-1]
        for step in response.split(step_token):
            step_ids = tokenizer.encode(step) if step != "" else []
            step_ids += [step_token_id]
            flag = [0] * len(step_ids)
            flag[-1] = 1
            response_ids.extend(step_ids)
            reward_flags.extend(flag)
        return prompt_ids + response_ids, reward_flags

    input_ids, reward_flags = prepare_input(QUESTION, "\n".join(STEPS), tokenizer, step_token="\n")
    with torch.no_grad():
        hidden = model(torch.tensor([input_ids]), output_hidden_states=True).hidden_states[-1]
        rewards = torch.sigmoid((hidden @ t["v_head.summary.weight"].T + t["v_head.summary.bias"]).squeeze(-1))
    expected = [rewards[0, i].item() for i, flag in enumerate(reward_flags) if flag == 1]
    assert len(expected) == len(STEPS)
    assert ponder_scores(directory, "skywork") == pytest.approx(expected, abs=ATOL)


def test_outcome_reward_model_matches_the_model_card(replicas):
    """Skywork/Skywork-Reward-Llama-3.1-8B-v0.2 card: the conversation through the chat template, the
    duplicate BOS stripped, then `rm(**tokenized).logits[0][0]`; ponder reports sigmoid(logit)."""
    directory = replicas["orm"]
    rm_tokenizer = AutoTokenizer.from_pretrained(directory)
    rm = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32, num_labels=1).eval()
    conv = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "\n\n".join(STEPS)}]
    conv_formatted = rm_tokenizer.apply_chat_template(conv, tokenize=False)
    if rm_tokenizer.bos_token is not None and conv_formatted.startswith(rm_tokenizer.bos_token):
        conv_formatted = conv_formatted[len(rm_tokenizer.bos_token):]
    conv_tokenized = rm_tokenizer(conv_formatted, return_tensors="pt")
    with torch.no_grad():
        score = rm(**conv_tokenized).logits[0][0].item()
    assert ponder_scores(directory, "orm") == pytest.approx([torch.sigmoid(torch.tensor(score)).item()], abs=ATOL)
