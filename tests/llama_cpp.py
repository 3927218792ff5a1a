"""llama.cpp's own converter over a replica directory, for the tests that read its files (skipped where the
converter is not at LLAMA_CPP: CI has none)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LLAMA_CPP = Path("/work/tools/llama_cpp_python-0.3.36/vendor/llama.cpp")
# The converter as it is, but for its vocabulary check: it knows published tokenizers by a hash of their
# output, and a replica's tokenizer is not one; `pre` names the pre-tokenizer it has.
_CONVERT = """
import runpy, sys
root, pre = sys.argv[1], sys.argv[2]
sys.path[:0] = [root + "/gguf-py", root]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv = [root + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert_with_llama_cpp(directory: Path, path: Path, pre: str, *flags: str) -> Path:
    """`directory` through llama.cpp's convert_hf_to_gguf.py as F32 at `path` (`flags` added: `--no-mtp`)."""
    subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP), pre, str(directory), "--outtype", "f32", *flags,
                    "--outfile", str(path)], check=True, capture_output=True)
    return path
