"""The start-up cache (runtime.startup_cache): hits, misses, invalidation, damage, and a model loaded
from it that is the very model loaded from its GGUF, bit for bit."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from runtime import startup_cache
from runtime.model import cached_model
from runtime.kernels.cpu_kernels import q4_unavailable
from runtime.model.loader import ModelSource, load_tokenizer
from runtime.startup_cache import Entry, file_identity
from tests.gguf_model import write_tiny_gguf
from tests.runtime.engine_helpers import engine_for, hf_greedy, request, run

needs_kernel = pytest.mark.skipif(q4_unavailable() is not None, reason="int4 layers need ponder's CPU kernel")
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 20, 21], [1, 40]]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A cache of the test's own (the kernels are loaded from the real one first, once per process)."""
    q4_unavailable()
    root = tmp_path / "cache"
    monkeypatch.setattr(startup_cache, "cache_root", lambda: root)
    return root


@pytest.fixture
def gguf(tmp_path):
    return write_tiny_gguf(tmp_path)


def source_of(path) -> ModelSource:
    return ModelSource("tiny", str(path.parent), path.name)


def load(path):
    return cached_model.load_quantized_model(source_of(path), torch.device("cpu"), torch.float32, "eager", "auto")


def entries(root, kind):
    return sorted(p.name for p in (root / kind).iterdir() if not p.name.startswith(".")) if (root / kind).exists() else []


# --- entries -----------------------------------------------------------------------------------


def test_an_entry_is_read_back_under_its_key_only(tmp_path):
    entry = Entry("thing", {"a": 1}, root=tmp_path)
    assert entry.read(lambda d: "never") is None  # a miss
    assert entry.write(lambda d: (d / "x").write_text("hello"))
    assert entry.read(lambda d: (d / "x").read_text()) == "hello"  # a hit
    assert Entry("thing", {"a": 2}, root=tmp_path).read(lambda d: "other") is None  # another key misses
    assert json.loads((entry.path / "key.json").read_text())["environment"]["torch"] == torch.__version__


def test_a_changed_model_file_misses_and_its_old_entry_goes(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"one")
    old = Entry("int4", {"model": file_identity(model)}, root=tmp_path)
    assert old.write(lambda d: None)
    model.write_bytes(b"other")  # another size (and time)
    os.utime(model, ns=(1, 1))
    new = Entry("int4", {"model": file_identity(model)}, root=tmp_path)
    assert new.path != old.path and not new.is_present()
    assert new.write(lambda d: None)
    assert not old.is_present() and entries(tmp_path, "int4") == [new.path.name]  # replaced, not piled up


def test_an_unreadable_entry_is_removed_for_the_rebuild(tmp_path, caplog):
    entry = Entry("thing", {"a": 1}, root=tmp_path)
    entry.write(lambda d: (d / "x").write_bytes(b"\xff"))
    with caplog.at_level(logging.WARNING):
        assert entry.read(lambda d: (d / "x").read_text()) is None
    assert "cannot be read" in caplog.text and not entry.path.exists()
    (entry.path.parent / "junk").mkdir()  # no key file: a crashed writer's
    entry.write(lambda d: None)
    assert not (entry.path.parent / "junk").exists() or entry.key.get("model") is None


def test_a_read_only_cache_is_logged_and_skipped(tmp_path, caplog):
    if os.geteuid() == 0:
        pytest.skip("root writes through read-only modes")
    tmp_path.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING):
            assert not Entry("thing", {"a": 1}, root=tmp_path / "ponder").write(lambda d: None)
    finally:
        tmp_path.chmod(0o700)
    assert "starting without it" in caplog.text


def test_a_cache_path_that_cannot_be_a_directory_is_logged_and_skipped(tmp_path, caplog):
    blocker = tmp_path / "ponder"
    blocker.write_text("a file where the cache directory would be")  # fails for root too
    with caplog.at_level(logging.WARNING):
        assert not Entry("thing", {"a": 1}, root=blocker).write(lambda d: None)
    assert "starting without it" in caplog.text


# --- kernels -------------------------------------------------------------------------------------


@needs_kernel
def test_built_kernels_load_without_the_extension_builder():
    # The kernels were built by this process's q4_unavailable(); a new process must not call the builder.
    code = ("import torch.utils.cpp_extension as c\n"
            "def refuse(*a, **k): raise SystemExit('the extension builder was called')\n"
            "c.load = refuse\n"
            "from runtime.kernels import cpu_kernels\n"
            "assert cpu_kernels.q4_unavailable() is None, cpu_kernels.q4_unavailable()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


# --- the model -----------------------------------------------------------------------------------


def same_state(a, b):
    sa, sb = cached_model._tensors(a), cached_model._tensors(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@needs_kernel
@pytest.mark.parametrize("kinds", [None, {"ffn_up": "F16", "attn_output": "BF16", "ffn_down": "F32"}, "F16"],
                         ids=["int", "int-and-float", "float16"])
def test_the_cached_model_is_the_cold_model_bit_for_bit(tmp_path, kinds, cache_dir, monkeypatch):
    gguf = write_tiny_gguf(tmp_path, kinds=kinds) if kinds != "F16" else write_tiny_gguf(tmp_path, "F16", embedding="F16")
    cold, cold_quantized = load(gguf)
    assert cold_quantized.mode == ("float" if kinds == "F16" else "int4") and entries(cache_dir, "int4")

    def refuse(*args, **kwargs):
        raise AssertionError("a cache hit must not load the GGUF")

    monkeypatch.setattr(cached_model, "load_causal_lm", refuse)
    monkeypatch.setattr("runtime.model.gguf_load.load_gguf_blocks", refuse)
    warm, warm_quantized = load(gguf)
    assert warm_quantized == cold_quantized
    assert [type(m).__name__ for m in warm.modules()] == [type(m).__name__ for m in cold.modules()]
    assert warm.config.to_dict() == cold.config.to_dict()
    assert warm.generation_config.to_dict() == cold.generation_config.to_dict()
    same_state(cold, warm)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(cold(ids).logits, warm(ids).logits)
    for prompt in PROMPTS:
        assert hf_greedy(cold, prompt, 8) == hf_greedy(warm, prompt, 8)


@needs_kernel
def test_the_engine_serves_the_same_tokens_from_the_cache(gguf, cache_dir):
    requests = lambda: [request(str(i), p, max_tokens=10) for i, p in enumerate(PROMPTS)]  # noqa: E731
    cold = run(engine_for(gguf), requests())
    assert entries(cache_dir, "int4") and entries(cache_dir, "tokenizer")
    warm = run(engine_for(gguf), requests())
    assert {k: v["choices"] for k, v in warm.items()} == {k: v["choices"] for k, v in cold.items()}


@needs_kernel
def test_the_avx2_path_serves_the_same_tokens(gguf, cache_dir):
    """`model.cpu_isa = "avx2"` keeps the int4 kernel on the AVX2 path for the process: same tokens."""
    from runtime.kernels.cpu_kernels import describe_isa, use_isa

    requests = lambda: [request(str(i), p, max_tokens=10) for i, p in enumerate(PROMPTS)]  # noqa: E731
    best = describe_isa()
    auto = run(engine_for(gguf), requests())
    try:
        avx2 = run(engine_for(gguf, cpu_isa="avx2"), requests())
        assert describe_isa() == "AVX2"
    finally:
        use_isa("auto")
    assert describe_isa() == best
    assert {k: v["choices"] for k, v in avx2.items()} == {k: v["choices"] for k, v in auto.items()}


@needs_kernel
def test_a_corrupt_tensor_file_is_rebuilt_from_the_gguf(gguf, cache_dir, caplog):
    cold, _ = load(gguf)
    [name] = entries(cache_dir, "int4")
    tensors = cache_dir / "int4" / name / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:1000])  # truncated
    with caplog.at_level(logging.WARNING):
        rebuilt, quantized = load(gguf)
    assert "cannot be read" in caplog.text and quantized.mode == "int4"
    same_state(cold, rebuilt)
    assert cached_model.model_entry(source_of(gguf), torch.float32, "eager", "auto", False).is_present()


@needs_kernel
def test_an_entry_that_leaves_a_tensor_unloaded_is_refused_and_rebuilt(gguf, cache_dir, caplog):
    from safetensors.torch import load_file, save_file

    cold, _ = load(gguf)
    [name] = entries(cache_dir, "int4")
    path = cache_dir / "int4" / name / "tensors.safetensors"
    tensors = load_file(str(path))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path))
    with caplog.at_level(logging.WARNING):
        rebuilt, _ = load(gguf)
    assert "CacheMismatch" in caplog.text and "model.norm.weight" in caplog.text
    same_state(cold, rebuilt)


@needs_kernel
def test_a_changed_gguf_is_loaded_anew(gguf, cache_dir):
    first, _ = load(gguf)
    write_tiny_gguf(gguf.parent, seed=1)  # other weights at the same path
    second, _ = load(gguf)
    reference = cached_model.load_causal_lm(source_of(gguf), torch.device("cpu"), torch.float32, "eager")
    assert not torch.equal(first.model.norm.weight, second.model.norm.weight)
    assert torch.equal(second.model.norm.weight, reference.model.norm.weight)
    assert len(entries(cache_dir, "int4")) == 1


@needs_kernel
def test_a_changed_key_misses(gguf, cache_dir, monkeypatch):
    load(gguf)
    monkeypatch.setattr(cached_model, "_CODE", cached_model._CODE + ("bootstrap.py",))  # "another ponder version"
    entry = cached_model.model_entry(source_of(gguf), torch.float32, "eager", "auto", False)
    assert not entry.is_present()
    load(gguf)
    assert entry.is_present() and len(entries(cache_dir, "int4")) == 1


@needs_kernel
def test_start_up_goes_on_without_a_writable_cache(gguf, tmp_path, monkeypatch, caplog):
    q4_unavailable()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setattr(startup_cache, "cache_root", lambda: blocker)
    with caplog.at_level(logging.WARNING):
        engine = engine_for(gguf)
    assert engine.quantized.mode == "int4" and "starting without it" in caplog.text


# --- the tokenizer -------------------------------------------------------------------------------


def test_the_cached_tokenizer_is_the_converted_one(gguf, cache_dir):
    cold = load_tokenizer(source_of(gguf))
    assert entries(cache_dir, "tokenizer")
    warm = load_tokenizer(source_of(gguf))
    assert type(warm) is type(cold) and warm.get_vocab() == cold.get_vocab()
    assert warm.all_special_ids == cold.all_special_ids and warm.bos_token_id == cold.bos_token_id
    text = "<t5><t6> <t7>x<t95>"
    assert warm(text).input_ids == cold(text).input_ids


def test_the_embedded_model_s_cached_tokenizer_encodes_and_templates_as_the_converted_one(cache_dir):
    from runtime.model.loader import ModelNotFound, resolve_model

    try:
        source = resolve_model(None)
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    cold = load_tokenizer(source)
    warm = load_tokenizer(source)
    assert entries(cache_dir, "tokenizer") and warm.get_vocab() == cold.get_vocab()
    texts = ["Hello, world!", "  two  spaces\nand a newline\t", "ünïcödé 数学 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert warm(text).input_ids == cold(text).input_ids
        assert warm.decode(cold(text).input_ids) == cold.decode(cold(text).input_ids)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert warm.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        cold.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (warm.eos_token_id, warm.bos_token_id, warm.pad_token_id) == \
        (cold.eos_token_id, cold.bos_token_id, cold.pad_token_id)


# --- the config, for the settings check ------------------------------------------------------------


def test_the_cached_config_is_the_one_read_from_the_gguf(gguf, cache_dir):
    from transformers import AutoConfig

    reference = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert cached_model.gguf_config(source_of(gguf)).to_dict() == reference.to_dict()  # a miss: read, saved
    assert entries(cache_dir, "config")
    assert cached_model.gguf_config(source_of(gguf)).to_dict() == reference.to_dict()  # a hit


def test_an_entry_written_meanwhile_by_another_process_is_kept(tmp_path):
    entry = Entry("thing", {"a": 1}, root=tmp_path)

    def slow_writer(directory):
        (directory / "x").write_text("mine")
        Entry("thing", {"a": 1}, root=tmp_path).write(lambda d: (d / "x").write_text("theirs"))  # finishes first

    assert entry.write(slow_writer)
    assert entry.read(lambda d: (d / "x").read_text()) == "theirs"
    assert [p.name for p in (tmp_path / "thing").iterdir()] == [entry.path.name]  # no staging left behind
