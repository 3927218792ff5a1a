"""Outputs the pages show that no live request gives (an error line, a refusal, a start-up line, a message):
each such block is marked `<!-- checked: what the code gives (tests/test_docs_outputs.py) -->` and compared
here, text for text, with what the code writes for the case the page describes. Every other block that
shows text (`text`, `json` or no language) says why it is not compared (`<!-- not run: REASON -->`), and
the outputs of live requests are compared in tests/test_docs_blocks.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests import docs_blocks as docs

CHECKED = "checked: what the code gives"
OUTPUT_LANGS = {"text", "json", ""}
BLOCKS = [block for path in docs.pages() for block in docs.blocks(path.read_text(), str(path.relative_to(docs.ROOT)))]


def key(block: docs.Block) -> tuple[str, str]:
    """A checked block's name that survives edits above it: its page and its first line."""
    return block.page, block.code.splitlines()[0]


def cuda_error() -> str:
    """`ponder serve --device cuda` where torch sees no GPU: the command and its one line."""
    if torch.cuda.is_available() or torch.__version__ != "2.13.0+cpu":
        pytest.skip("the page shows torch 2.13.0+cpu on a machine without CUDA")
    done = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--device", "cuda", "--port", "0"],
                          capture_output=True, text=True, timeout=300, cwd=docs.ROOT)
    assert done.returncode == 2
    return "$ ponder serve --device cuda\n" + done.stderr


def falcon_refusal() -> str:
    from transformers import AutoConfig

    from runtime.model.families import refusal

    return f"ponder: refusing the model {refusal(AutoConfig.for_model('falcon_h1'), '/models/Falcon-H1-1.5B')}\n"


def paths_line() -> str:
    from runtime.model.paths import describe

    return "paths: " + describe({"family": "gpt_oss", "layers": "lean", "linear": "float_kernel",
                                 "attention": "cpu_kernel"}) + "\n"


def gguf_quantize_lines() -> str:
    """Two start-up lines of `quantize = auto` on GGUF files: one whose IQ2_XXS layers keep float weights,
    one whose F16 layers all run in the float kernel; the page wraps each at its width."""
    from runtime.model.quantize import Quantized, blocks_detail

    blocks = Quantized("auto", "int4", 13, blocks_detail({"Q4_1": 12, "Q8_0": 1}, 2,
                                                         "linear tensors in the file: 2 IQ2_XXS, 12 Q4_1, 1 Q8_0"))
    floats = Quantized("auto", "float", 211, blocks_detail({}, 0, "linear tensors in the file: 211 F16", {"F16": 211}))
    return blocks.describe() + "\n" + floats.describe() + "\n"


def thinking_message() -> dict:
    """A thinking model's answer, "2 and 2 make 4." then the closing tag and "4", as the chat route gives it."""
    from server.reasoning_output import Thinking, chat_message

    thinking = Thinking("deepseek")
    thinking.start([True], 1)  # the generation prompt left the thinking block open
    message, _ = chat_message(0, "2 and 2 make 4.\n</think>\n\n4", "stop", thinking, None)
    return message


COMPARED = {
    ("docs/getting-started.md", "$ ponder serve --device cuda"): cuda_error,
    ("docs/models.md", "ponder: refusing the model /models/Falcon-H1-1.5B: falcon_h1: 'hybrid' layers, which "
                       "ponder's paged attention does not run; Mamba-2 layers keep a recurrent state ponder does "
                       "not hold; ponder refuses it rather than serve wrong tokens"): falcon_refusal,
    ("docs/models.md", "paths: family gpt_oss: layers lean, linear float_kernel, attention cpu_kernel"):
        paths_line,
    ("docs/gguf-types.md", "model.quantize = auto: int4 (13 layers keep the GGUF's blocks (12 Q4_1, 1 Q8_0), 2 keep "
                           "float weights"): gguf_quantize_lines,
    ("docs/reasoning.md", '{"role": "assistant", "reasoning_content": "2 and 2 make 4.\\n", "reasoning": '
                          '"2 and 2 make 4.\\n",'): thinking_message,
}


def test_every_block_of_text_is_compared_or_says_why_not():
    assert [b.where for b in BLOCKS if b.lang in OUTPUT_LANGS and b.marker is None] == []


def test_every_block_checked_here_has_its_comparison():
    assert sorted(key(b) for b in BLOCKS if b.marker is not None and b.marker.startswith(CHECKED)) == sorted(COMPARED)


@pytest.mark.parametrize("name", list(COMPARED), ids=[page for page, _ in COMPARED])
def test_an_output_shown_is_what_the_code_gives(name):
    (block,) = [b for b in BLOCKS if key(b) == name]
    given = COMPARED[name]()
    if block.lang == "json":
        assert json.loads(block.code) == given, block.where
    else:  # word for word: the page wraps a long line at its width
        assert block.code.split() == given.split(), block.where
