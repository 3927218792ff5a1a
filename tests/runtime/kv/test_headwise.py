"""Head-wise offloading of one long sequence: exact tokens, the budget held, exact bytes, disk tier.

The models are tiny llama and qwen2 models with 8 layers and 4 KV heads (32 slices): a slice's
context must fit a staging buffer, so a compute tier of 1/8 of the KV needs more than the shared
fixtures' 4 slices. Each sequence runs through the runner with a head-wise residency over a plan and a
tier chain of the test's own. (The engine's use of it, `kv_granularity = "head"`, is tested in
test_streamed.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from runtime.model import attention
from runtime.kv.head_pieces import HeadwiseStore, NoFit, PiecePlan, plan_pieces
from runtime.kv.headwise import HeadwiseResidency, attend
from runtime.model.loader import ModelSource, load_causal_lm
from runtime.model.model_runner import ModelRunner
from scheduler.scheduler import ScheduledSequence
from scheduler.sequence import Sequence
from storage.kv_cache import KVCache, kv_shape_of
from storage.disk_tier import DiskTier
from storage.host_tier import HostTier
from storage.tiers import TierChain

LAYERS, KV_HEADS, HEADS, HEAD_DIM = 8, 4, 8, 8
BLOCK = 8
PROMPT_LEN, NEW = 300, 8
CHUNK = 64
MAX_TOKENS = PROMPT_LEN + NEW - 1  # the last token is sampled, never fed back
STAGING = -(-MAX_TOKENS // BLOCK)  # 39 pieces: one slice's whole context
TOTAL_PIECES = LAYERS * KV_HEADS * STAGING  # 1248
BUDGET = TOTAL_PIECES // 8  # 156
PIECE_BYTES = 2 * BLOCK * HEAD_DIM * 4  # one KV head, float32


def build(directory, arch: str, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=HEADS * HEAD_DIM, intermediate_size=128,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, max_position_embeddings=1024, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else \
        Qwen2ForCausalLM(Qwen2Config(**common))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear greedy winners
    model.save_pretrained(directory, safe_serialization=True)
    return load_causal_lm(ModelSource(arch, str(directory)), torch.device("cpu"), torch.float32,
                          attention.register())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {arch: build(tmp_path_factory.mktemp(f"hw-{arch}"), arch, seed)
            for arch, seed in (("llama", 0), ("qwen2", 1))}


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 96, (PROMPT_LEN,), generator=g).tolist()


@dataclass
class Report:
    tokens: list[int]
    store: HeadwiseStore
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def bytes_moved(self) -> dict[str, int]:
        return self.store.pipeline.chain.bytes_moved


def generate_headwise(model, prompt, new, *, budget_pieces=BUDGET, group_heads=1, prefetch=True,
                      host_bytes=None, disk_dir=None, disk_bytes=0, temperature=0.0, seed=0) -> Report:
    """Prefill in chunks of CHUNK, then decode `new` tokens (greedy, or seeded sampling)."""
    plan = plan_pieces(num_layers=LAYERS, num_kv_heads=KV_HEADS, group_heads=group_heads, head_dim=HEAD_DIM,
                       block_size=BLOCK, max_tokens=len(prompt) + new - 1, budget_pieces=budget_pieces,
                       prefetch=prefetch)
    piece = (2, group_heads, BLOCK, HEAD_DIM)
    host_bytes = plan.total_pieces * PIECE_BYTES * group_heads if host_bytes is None else host_bytes
    host = HostTier(piece, torch.float32, host_bytes, name="host") if host_bytes else None
    disk = DiskTier(disk_dir, "headwise-test", disk_bytes, name="disk") if disk_dir else None
    chain = TierChain(host, disk, compute_name="compute", promote_disk_hits=False)
    # The compute tier the residency borrows whole: the budget's pieces, in blocks of every slice.
    cache = KVCache(kv_shape_of(model.config, BLOCK), -(-budget_pieces * group_heads // (LAYERS * KV_HEADS)),
                    torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, cache)
    config = SimpleNamespace(max_model_len=len(prompt) + new, num_blocks=cache.num_blocks, max_num_batched_tokens=CHUNK)
    residency = HeadwiseResidency(SimpleNamespace(cache=cache, runner=runner), config, b"test")
    runner.use_residency(residency)
    seq = Sequence(prompt)
    residency.stream(seq, plan, chain)

    def forward(num_tokens: int) -> torch.Tensor:
        logits = runner.execute([ScheduledSequence(seq, num_tokens)], [], [0])[0]
        seq.num_computed_tokens += num_tokens
        return logits

    generator = torch.Generator().manual_seed(seed)
    report = Report([], residency.store)
    try:
        for c in range(0, len(prompt), CHUNK):
            logits = forward(len(prompt[c:c + CHUNK]))
        for i in range(new):
            if i:
                seq.append_token(report.tokens[-1])
                logits = forward(1)
            report.logits.append(logits)
            if temperature <= 0:
                report.tokens.append(int(torch.argmax(logits)))
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                report.tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    finally:
        report.store.pipeline.close()
    report.store.check_integrity()
    chain.check_integrity()
    return report


def hf_greedy(model, prompt, implementation: str) -> list[int]:
    previous = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    finally:
        model.set_attn_implementation(previous)
    return out[0, len(prompt):].tolist()


def expected_loads(budget: int, start: int) -> int:
    """Pieces a forward starting at `start` loads: every full piece not resident. The compute
    tier keeps one tail piece per slice and two staging buffers; what is left is resident, whole
    slices first (`whole` of them), then `part` blocks of the next."""
    slices, full_max = LAYERS * KV_HEADS, MAX_TOKENS // BLOCK
    whole, part = divmod(budget - slices - 2 * STAGING, full_max)
    full = start // BLOCK
    return slices * full - whole * full - min(part, full)


FORWARD_STARTS = list(range(0, PROMPT_LEN, CHUNK)) + list(range(PROMPT_LEN, MAX_TOKENS))


def test_attention_per_group_is_full_attention_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for t, ctx in ((1, 300), (64, 320)):
        q = torch.randn(1, HEADS, t, HEAD_DIM, generator=g)
        k, v = (torch.randn(1, KV_HEADS, ctx, HEAD_DIM, generator=g) for _ in range(2))
        mask = None if t == 1 else \
            torch.arange(ctx)[None, :] <= torch.arange(ctx - t, ctx)[:, None]
        full = attend(q, k, v, mask, None)
        rep = HEADS // KV_HEADS
        parts = torch.cat([attend(q[:, h * rep:(h + 1) * rep], k[:, h:h + 1], v[:, h:h + 1], mask,
                                  None) for h in range(KV_HEADS)], dim=1)
        assert torch.equal(parts, full)
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(full, reference)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_equal_generate_within_an_eighth_of_the_kv(models, prompt, arch):
    model = models[arch]
    report = generate_headwise(model, prompt, NEW)
    assert report.tokens == hf_greedy(model, prompt, "sdpa") == hf_greedy(model, prompt, "eager")
    plan = report.store.plan
    assert plan.total_pieces == TOTAL_PIECES and plan.budget_pieces * 8 <= TOTAL_PIECES
    # The compute tier's KV tensors: resident pieces, one tail per slice, two staging buffers.
    assert plan.resident_pieces == BUDGET - LAYERS * KV_HEADS - 2 * STAGING == 46
    assert report.store.compute_bytes == BUDGET * PIECE_BYTES
    assert model.config._attn_implementation == attention.ATTENTION_NAME  # restored


def test_bytes_are_the_pieces_the_budget_leaves_out(models, prompt):
    report = generate_headwise(models["llama"], prompt, NEW)
    loads = [expected_loads(BUDGET, s) for s in FORWARD_STARTS]
    assert report.store.loads_per_forward == loads
    # A decoded token reads the 37 (then 38) full blocks of 32 slices less the resident ones:
    # slice 0 wholly (37, then 38) and 8 blocks of slice 1.
    assert loads[len(range(0, PROMPT_LEN, CHUNK)):] == [32 * 37 - 37 - 8] * 4 + [32 * 38 - 46] * 3
    full_pieces = LAYERS * KV_HEADS * (MAX_TOKENS // BLOCK)
    assert report.store.num_loaded == sum(loads)
    assert report.store.num_written == full_pieces - 46
    assert {k: v for k, v in report.bytes_moved.items() if v} == {
        "host/compute": sum(loads) * PIECE_BYTES,
        "compute/host": (full_pieces - 46) * PIECE_BYTES}


def test_logits_do_not_depend_on_budget_group_size_or_prefetch(models, prompt):
    model = models["qwen2"]
    small = generate_headwise(model, prompt, NEW)
    whole = generate_headwise(model, prompt, NEW, budget_pieces=10 * TOTAL_PIECES // KV_HEADS,
                              group_heads=KV_HEADS, prefetch=False)
    assert whole.store.num_loaded == 0 and whole.bytes_moved["host/compute"] == 0
    assert all(torch.equal(a, b) for a, b in zip(small.logits, whole.logits, strict=True))


def test_seeded_sampling_is_the_same_over_any_budget(models, prompt):
    model = models["llama"]
    runs = [generate_headwise(model, prompt, NEW, budget_pieces=b, temperature=1.0, seed=5)
            for b in (BUDGET, 4 * BUDGET)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].store.num_loaded > runs[1].store.num_loaded


def test_a_budget_below_one_slice_of_staging_is_a_no_fit_saying_why():
    def plan(budget_pieces: int):
        return plan_pieces(num_layers=LAYERS, num_kv_heads=KV_HEADS, group_heads=1, head_dim=HEAD_DIM,
                           block_size=BLOCK, max_tokens=MAX_TOKENS, budget_pieces=budget_pieces, prefetch=True)

    least = LAYERS * KV_HEADS + 2 * STAGING  # a write buffer per slice, two staging buffers
    assert plan(least - 1) == NoFit(
        f"a compute tier of {least - 1} pieces cannot hold 32 write buffers and 2 staging buffers of 39 pieces "
        f"(one slice's context of 307 tokens); raise the budget or use fewer KV heads per group")
    fits = plan(least)
    assert isinstance(fits, PiecePlan) and fits.working_pieces == least and fits.quotas == (0,) * 32


def test_disk_tier_carries_what_the_host_tier_cannot(models, prompt, tmp_path):
    model = models["llama"]
    host_pieces = 64
    report = generate_headwise(model, prompt, NEW, host_bytes=host_pieces * PIECE_BYTES,
                               disk_dir=str(tmp_path), disk_bytes=1 << 26)
    assert report.tokens == hf_greedy(model, prompt, "sdpa")
    moved = report.bytes_moved
    loaded = sum(expected_loads(BUDGET, s) for s in FORWARD_STARTS)
    assert moved["host/compute"] + moved["disk/compute"] == loaded * PIECE_BYTES
    assert moved["disk/compute"] > moved["host/compute"] > 0
    written = report.store.num_written
    assert moved["compute/host"] == written * PIECE_BYTES
    # Everything the host tier evicted went to disk, once: all but what it still holds.
    assert moved["host/disk"] == (written - host_pieces) * PIECE_BYTES
    assert moved["disk/host"] == 0  # disk hits are not promoted
