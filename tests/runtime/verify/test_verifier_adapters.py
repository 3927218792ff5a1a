"""Each adapter against a straightforward computation written from the model card's recipe: the
same model run on one unpadded sequence, positions located by hand from the token ids."""

import pytest
import torch

from runtime.verify.verifiers import (
    ConfidenceVerifier,
    JudgeVerifier,
    MathShepherdVerifier,
    OutcomeVerifier,
    QwenPRMVerifier,
    RLHFlowVerifier,
    ScoringInput,
    SkyworkPRMVerifier,
    build_verifier,
    confidence_from_logprobs,
    load_value_head,
    load_verifier,
    tokenize_marked,
    verifier_class,
)

QUESTION = "Janet has 3 ducks and they lay 16 eggs. How many eggs are left?"
PATHS = [
    ["She eats 4 eggs", "16 - 4 = 12", "The answer is \\boxed{12}"],
    ["Step 1: add 5 and 7 to get 12"],
    ["Is 2 + 3 correct?", "so the result is 5 ки really"],  # a "+" and a "ки" inside step text
]
TOL = dict(rtol=0, atol=2e-5)


def assert_scores(actual, expected):
    assert [len(a) for a in actual] == [len(e) for e in expected]
    for a, e in zip(actual, expected):
        assert torch.allclose(torch.tensor(a), torch.tensor(e, dtype=torch.float32), **TOL), (a, e)
        assert all(0.0 <= s <= 1.0 for s in a)


def assert_not_close(actual, other):
    """The read position matters: the same read-out one token off gives other numbers."""
    flat_a = torch.tensor([s for path in actual for s in path])
    flat_o = torch.tensor([s for path in other for s in path])
    assert (flat_a - flat_o).abs().max() > 1e-3


def ids_of(tokenizer, text: str) -> int:
    """The id of the single token `text` is in this tokenizer."""
    (token_id,) = tokenizer.encode(text, add_special_tokens=False)
    return token_id


@pytest.fixture(scope="module")
def causal_lm(causal_lm_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(causal_lm_dir).eval()


# ---------------------------------------------------------------------------------------------
# Math-Shepherd


def test_math_shepherd(causal_lm_dir, causal_lm, tokenizer):
    verifier = load_verifier("math-shepherd", causal_lm_dir, dtype=torch.float32)
    tag, plus, minus = ids_of(tokenizer, " ки"), ids_of(tokenizer, " +"), ids_of(tokenizer, " -")
    assert verifier.label_token_ids == (plus, minus)

    expected, shifted = [], []
    for steps in PATHS:
        text = QUESTION + " " + "\n".join(step + " ки" for step in steps)  # the model card's layout
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id
        tag_positions = [i for i, t in enumerate(ids) if t == tag]
        # the path whose step says "ки" has an extra tag token; ours are the last of each step
        if "ки really" in steps[-1]:
            tag_positions = [tag_positions[0], tag_positions[2]]
        with torch.no_grad():
            probs = causal_lm(torch.tensor([ids])).logits[0][:, [plus, minus]].softmax(-1)[:, 0]
        expected.append([probs[p].item() for p in tag_positions])
        shifted.append([probs[p - 1].item() for p in tag_positions])

    scores = verifier.score(QUESTION, PATHS)
    assert_scores(scores, expected)
    assert_not_close(scores, shifted)


def test_math_shepherd_inputs_separate_tokenising_from_running(causal_lm, tokenizer):
    verifier = MathShepherdVerifier(causal_lm, tokenizer)
    (single,) = verifier.build_inputs(QUESTION, ["a", "b"])
    assert isinstance(single, ScoringInput)
    assert [single.token_ids[p] for p in single.read_positions] == [ids_of(tokenizer, " ки")] * 2
    assert single.read_positions[-1] == len(single.token_ids) - 1
    assert verifier.build_inputs(QUESTION, []) == []
    assert verifier.score(QUESTION, [[], ["a"]])[0] == []


# ---------------------------------------------------------------------------------------------
# RLHFlow


def test_rlhflow(causal_lm_dir, causal_lm, tokenizer):
    verifier = load_verifier("rlhflow", causal_lm_dir)
    plus, minus = ids_of(tokenizer, "+"), ids_of(tokenizer, "-")
    assistant, newline = tokenizer.encode("assistant", add_special_tokens=False), ids_of(tokenizer, "\n")

    expected, shifted = [], []
    for steps in PATHS:
        conversation = []
        for k, step in enumerate(steps):
            conversation.append({"role": "user", "content": QUESTION + " " + step if k == 0 else step})
            conversation.append({"role": "assistant", "content": "+"})
        ids = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False),
                        add_special_tokens=False)["input_ids"]
        # an assistant "+" is the token right after "<|im_start|>assistant\n"
        head = [ids_of(tokenizer, "<|im_start|>")] + assistant + [newline]
        labels = [i for i in range(len(ids)) if ids[i] == plus and ids[i - len(head):i] == head]
        assert len(labels) == len(steps)
        with torch.no_grad():
            probs = causal_lm(torch.tensor([ids])).logits[0][:, [plus, minus]].softmax(-1)[:, 0]
        expected.append([probs[i - 1].item() for i in labels])
        shifted.append([probs[i].item() for i in labels])

    scores = verifier.score(QUESTION, PATHS)
    assert_scores(scores, expected)
    assert_not_close(scores, shifted)


# ---------------------------------------------------------------------------------------------
# Qwen2.5-Math-PRM


def test_qwen_prm(qwen_prm_dir):
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    verifier = load_verifier("qwen-prm", qwen_prm_dir)
    # A qwen2 checkpoint's tokenizer loads as Qwen2Tokenizer (digits split one by one): use that one.
    tokenizer = AutoTokenizer.from_pretrained(qwen_prm_dir)
    model = AutoModelForTokenClassification.from_pretrained(qwen_prm_dir).eval()
    step_id = ids_of(tokenizer, "<extra_0>")

    expected, shifted = [], []
    for steps in PATHS:
        messages = [{"role": "system", "content": verifier.system_prompt},
                    {"role": "user", "content": QUESTION},
                    {"role": "assistant", "content": "<extra_0>".join(steps) + "<extra_0>"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]  # the model card's outputs[0]
        assert logits.shape[-1] == 2
        probs = logits.softmax(-1)[:, 1]
        positions = [i for i, t in enumerate(ids) if t == step_id]
        expected.append([probs[p].item() for p in positions])
        shifted.append([probs[p - 1].item() for p in positions])

    scores = verifier.score(QUESTION, PATHS)
    assert_scores(scores, expected)
    assert_not_close(scores, shifted)


# ---------------------------------------------------------------------------------------------
# Skywork-o1-Open-PRM


def test_skywork_value_head_loads_from_the_checkpoint_directory(skywork_dir):
    from safetensors import safe_open

    head = load_value_head(skywork_dir)
    with safe_open(str(skywork_dir / "value_head.safetensors"), framework="pt") as f:
        assert torch.equal(head.weight, f.get_tensor("v_head.summary.weight"))
        assert torch.equal(head.bias, f.get_tensor("v_head.summary.bias"))


def test_skywork(skywork_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    verifier = load_verifier("skywork", skywork_dir)
    tokenizer = AutoTokenizer.from_pretrained(skywork_dir)
    model = AutoModelForCausalLM.from_pretrained(skywork_dir).eval()
    head = load_value_head(skywork_dir)
    step_token_id = tokenizer.encode("\n", add_special_tokens=False)[-1]

    expected, shifted = [], []
    for steps in PATHS:
        # the reference `prepare_input`: bos + problem + "\n", then each step's ids and the step token
        ids = tokenizer.encode(tokenizer.bos_token + QUESTION + "\n", add_special_tokens=False)
        flags = [0] * len(ids)
        for step in steps:
            step_ids = tokenizer.encode(step, add_special_tokens=False) + [step_token_id]
            ids += step_ids
            flags += [0] * (len(step_ids) - 1) + [1]
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            values = torch.sigmoid(head(hidden).squeeze(-1))
        positions = [i for i, f in enumerate(flags) if f]
        expected.append([values[p].item() for p in positions])
        shifted.append([values[p - 1].item() for p in positions])

    scores = verifier.score(QUESTION, PATHS)
    assert_scores(scores, expected)
    assert_not_close(scores, shifted)


def test_skywork_without_a_value_head_is_refused(causal_lm_dir):
    with pytest.raises(FileNotFoundError, match="value head"):
        load_verifier("skywork", causal_lm_dir)


# ---------------------------------------------------------------------------------------------
# Outcome reward model


def test_outcome_reward_model_gives_one_score_per_path(orm_dir, tokenizer):
    from transformers import AutoModelForSequenceClassification

    verifier = load_verifier("orm", orm_dir, batch_size=8)
    model = AutoModelForSequenceClassification.from_pretrained(orm_dir).eval()
    expected, at_second_last = [], []
    for steps in PATHS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION},
                                              {"role": "assistant", "content": "\n\n".join(steps)}],
                                             tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():  # one unpadded sequence: the classifier pools its last token
            expected.append([torch.sigmoid(model(torch.tensor([ids])).logits[0, 0]).item()])
            at_second_last.append([torch.sigmoid(model(torch.tensor([ids[:-1]])).logits[0, 0]).item()])

    scores = verifier.score(QUESTION, PATHS)  # three lengths in one right-padded batch
    assert verifier.is_outcome
    assert_scores(scores, expected)
    assert_not_close(scores, at_second_last)
    assert verifier.score(QUESTION, [[]]) == [[]]


def test_outcome_reward_model_with_two_labels(two_label_orm, tokenizer):
    model = two_label_orm
    verifier = build_verifier("orm", model, tokenizer)
    (single,) = verifier.build_inputs(QUESTION, PATHS[0])
    with torch.no_grad():
        expected = model(torch.tensor([single.token_ids])).logits[0].softmax(-1)[1].item()
    assert verifier.score(QUESTION, [PATHS[0]]) == [[pytest.approx(expected, abs=2e-5)]]


# ---------------------------------------------------------------------------------------------
# LLM as judge


def test_judge_scores_each_step_with_its_own_question(causal_lm, tokenizer):
    verifier = build_verifier("judge", causal_lm, tokenizer)
    yes = [ids_of(tokenizer, "Yes"), ids_of(tokenizer, " Yes")]
    no = [ids_of(tokenizer, "No"), ids_of(tokenizer, " No")]
    assert (verifier.yes_token_ids, verifier.no_token_ids) == (tuple(sorted(yes)), tuple(sorted(no)))

    expected, one_back = [], []
    for steps in PATHS:
        inputs = verifier.build_inputs(QUESTION, steps)
        assert len(inputs) == len(steps)  # one question per step
        path_expected, path_back = [], []
        for k in range(1, len(steps) + 1):
            text = verifier.build_text(QUESTION, steps, k)
            assert f"Step {k}: {steps[k - 1]}" in text and f"Step {k + 1}:" not in text
            assert text.endswith("<|im_start|>assistant\n")
            ids = tokenizer.encode(text, add_special_tokens=False)
            # the question about step k alone is the k-th of the path's questions
            assert verifier.build_input(QUESTION, steps, k) == inputs[k - 1]
            assert inputs[k - 1].token_ids == tuple(ids) and inputs[k - 1].read_positions == (len(ids) - 1,)
            with torch.no_grad():
                probs = causal_lm(torch.tensor([ids])).logits[0].softmax(-1)
            p_yes, p_no = probs[-1, yes].sum(), probs[-1, no].sum()
            path_expected.append((p_yes / (p_yes + p_no)).item())
            p_yes, p_no = probs[-2, yes].sum(), probs[-2, no].sum()
            path_back.append((p_yes / (p_yes + p_no)).item())
        expected.append(path_expected)
        one_back.append(path_back)

    scores = verifier.score(QUESTION, PATHS)
    assert_scores(scores, expected)
    assert_not_close(scores, one_back)


def test_judge_without_chat_template(causal_lm, plain_tokenizer):
    plain = plain_tokenizer
    verifier = JudgeVerifier(causal_lm, plain)
    (single,) = verifier.build_inputs(QUESTION, ["one step"])
    assert single.token_ids[0] == plain.bos_token_id
    assert plain.decode(single.token_ids).endswith("Answer with Yes or No only.\nAnswer:")


# ---------------------------------------------------------------------------------------------
# Self-confidence


def test_confidence_is_the_geometric_mean_token_probability(causal_lm, tokenizer):
    verifier = build_verifier("confidence", causal_lm, tokenizer)
    expected = []
    for steps in PATHS:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                               add_generation_prompt=True)
        ids = tokenizer.encode(prompt + "\n\n".join(steps), add_special_tokens=False)
        with torch.no_grad():
            logprobs = causal_lm(torch.tensor([ids])).logits[0].log_softmax(-1)
        path_expected = []
        for k in range(len(steps)):
            # the step's tokens: those that tokenising the step added to the text before it
            before = prompt + "\n\n".join(steps[:k]) + ("\n\n" if k else "")
            start = len(tokenizer.encode(before, add_special_tokens=False))
            end = len(tokenizer.encode(before + steps[k], add_special_tokens=False))
            assert ids[:end] == tokenizer.encode(before + steps[k], add_special_tokens=False)
            token_logprobs = [logprobs[i - 1, ids[i]].item() for i in range(start, end)]
            path_expected.append(torch.tensor(token_logprobs).mean().exp().item())
        expected.append(path_expected)

    assert_scores(verifier.score(QUESTION, PATHS), expected)


def test_confidence_edge_cases(causal_lm, tokenizer):
    verifier = ConfidenceVerifier(causal_lm, tokenizer)
    assert confidence_from_logprobs([]) == 1.0
    assert confidence_from_logprobs([-1.0, -3.0]) == pytest.approx(torch.tensor(-2.0).exp().item())
    scores = verifier.score(QUESTION, [["", "some step"], [""]])
    assert scores[0][0] == 1.0 and 0.0 < scores[0][1] < 1.0
    assert scores[1] == [1.0]


# ---------------------------------------------------------------------------------------------
# Shared machinery and registry


def test_marked_positions_refuse_a_tag_merged_with_its_neighbours(tokenizer):
    text = "eggs ки\nmore"
    start = text.index(" ки")
    ids, (position,) = tokenize_marked(tokenizer, text, [(start, start + 3)], add_special_tokens=True)
    assert ids[position] == ids_of(tokenizer, " ки")
    with pytest.raises(ValueError, match="merged"):
        tokenize_marked(tokenizer, " eggs", [(4, 5)], add_special_tokens=False)  # "s" inside " eggs"


def test_padding_does_not_change_scores(causal_lm, tokenizer):
    one_at_a_time = MathShepherdVerifier(causal_lm, tokenizer, batch_size=1)
    batched = MathShepherdVerifier(causal_lm, tokenizer, batch_size=3)
    assert_scores(batched.score(QUESTION, PATHS), one_at_a_time.score(QUESTION, PATHS))


def test_registry(causal_lm, tokenizer):
    assert verifier_class("Math_Shepherd") is MathShepherdVerifier
    assert verifier_class("rlhflow") is RLHFlowVerifier
    assert verifier_class("qwen-prm") is QwenPRMVerifier
    assert verifier_class("skywork") is SkyworkPRMVerifier
    assert verifier_class("orm") is OutcomeVerifier
    built = build_verifier("confidence", causal_lm, tokenizer, step_separator="\n")
    assert isinstance(built, ConfidenceVerifier) and built.step_separator == "\n"
    with pytest.raises(ValueError, match="unknown verifier"):
        build_verifier("oracle", causal_lm, tokenizer)
