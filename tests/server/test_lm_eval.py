"""lm-evaluation-harness against a live `ponder serve`: its `local-completions` model (echo + logprobs on
/v1/completions for loglikelihood, plain completions with stop strings for generate_until) gives, item
for item, what lm-eval's own `hf` model computes on the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.live import live_server

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (make install: the `clients` extra)")

TOL = 1e-4
TASKS = ["ponder_mc", "ponder_gen"]


def greedy_next(model_dir: Path, text: str) -> str:
    """The tiny model's most likely next word after `text`, so one choice is greedy (is_greedy True)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tok(text)["input_ids"]])).logits[0, -1]
    return tok.convert_ids_to_tokens(int(logits.argmax()))


def write_tasks(directory: Path, model_dir: Path) -> None:
    """Two local tasks over JSONL written here: multiple choice (single- and multi-token choices, one
    greedy) and generate_until with a stop string."""
    mc = [
        {"q": "w1 w2 w3", "choices": ["w4", "w5", greedy_next(model_dir, "w1 w2 w3")], "label": 0},
        {"q": "w10 w11", "choices": ["w12 w13", "w20", "Yes"], "label": 1},
        {"q": "w30 w31 w32 w33", "choices": ["No", "w34 w35 w36"], "label": 1},
    ]
    gen = [{"q": "w1 w2 w3", "a": "w4"}, {"q": "w40 w41", "a": "w42"}, {"q": "w7", "a": "w8"}]
    for name, rows in [("mc", mc), ("gen", gen)]:
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ntest_split: test\ndoc_to_text: \"{{{{q}}}}\"\ntarget_delimiter: \" \"\n")
    (directory / "ponder_mc.yaml").write_text(
        f"task: ponder_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    (directory / "ponder_gen.yaml").write_text(
        f"task: ponder_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: \"{{a}}\"\n"
        "generation_kwargs:\n  until: [\"w53\", \"Yes\"]\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")


def evaluate(model: str, model_args: str, task_dir: Path) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
                                   task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)


@pytest.fixture(scope="module")
def task_dir(tiny_llama, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    write_tasks(directory, tiny_llama)
    return directory


@pytest.fixture(scope="module")
def hf_results(tiny_llama, task_dir) -> dict:
    return evaluate("hf", f"pretrained={tiny_llama},dtype=float32,device=cpu", task_dir)


@pytest.fixture(scope="module")
def base(tiny_llama):
    with live_server("--model", str(tiny_llama), "--device", "cpu",
                     env={"PONDER_CACHE__NUM_BLOCKS": "512", "PONDER_CACHE__BLOCK_SIZE": "4"}) as (url, _):
        yield url


@pytest.mark.parametrize("batch_size", [1, 4])
def test_local_completions_matches_lm_eval_hf_item_for_item(base, tiny_llama, task_dir, hf_results, batch_size):
    """batch_size 4 sends several token-id prompts in one /v1/completions request."""
    served = evaluate("local-completions",
                      f"base_url={base}/v1/completions,model={tiny_llama.name},tokenizer_backend=huggingface,"
                      f"tokenizer={tiny_llama},batch_size={batch_size},num_concurrent=1,max_retries=1", task_dir)
    mc_api, mc_hf = served["samples"]["ponder_mc"], hf_results["samples"]["ponder_mc"]
    assert [s["doc_id"] for s in mc_api] == [s["doc_id"] for s in mc_hf] == [0, 1, 2]
    greedy = []
    for a, h in zip(mc_api, mc_hf):
        assert a["arguments"] == h["arguments"]
        assert len(a["resps"]) == len(h["resps"]) == len(a["doc"]["choices"])
        for [(ll_api, greedy_api)], [(ll_hf, greedy_hf)] in zip(a["resps"], h["resps"]):
            assert abs(ll_api - ll_hf) < TOL, (a["doc"], ll_api, ll_hf)
            assert greedy_api == greedy_hf
            greedy.append(greedy_api)
        assert [ll for ll, _ in a["filtered_resps"]] == pytest.approx([ll for ll, _ in h["filtered_resps"]], abs=TOL)
        assert a["acc"] == h["acc"]
    assert greedy[2] is True and greedy.count(True) >= 1  # the greedy choice of item 0 is recognised as such
    gen_api, gen_hf = served["samples"]["ponder_gen"], hf_results["samples"]["ponder_gen"]
    assert len(gen_api) == len(gen_hf) == 3
    for a, h in zip(gen_api, gen_hf):
        assert a["resps"] == h["resps"] and a["filtered_resps"] == h["filtered_resps"], a["doc"]
        assert a["exact_match"] == h["exact_match"]
    assert served["results"]["ponder_mc"]["acc,none"] == hf_results["results"]["ponder_mc"]["acc,none"]
