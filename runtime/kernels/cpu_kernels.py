"""ponder's own CPU kernels (`runtime/kernels/csrc`), built with the machine's C++ compiler on first use.

`q4_linear` is the int4 layers' kernel (see `runtime/kernels/csrc/q4_linear.cpp`): 4-bit weights (GGUF's
blocks, laid out 8 output columns side by side by `runtime.model.quantize.pack_int4`) times activations
quantized per group of 32 to int8, exact integer inner products,
an optional RMS norm before and an optional residual after, each output computed from its own row
only. It needs an x86-64 CPU with AVX2, FMA and F16C (and runs AVX512-VNNI where there is one).

`decode_attention` is decode attention over the paged float32 cache (see
`runtime/kernels/csrc/decode_attention.cpp`): each query attends to exactly its own context, read from its
blocks where they lie, so nothing is gathered or padded and no query's result depends on the others.

`float_linear` is the float layers' kernel (see `runtime/kernels/csrc/float_linear.cpp`): float32 or
bfloat16 weights as nn.Linear holds them, each output's sum in one fixed order, whatever the batch.

`int4_layers` runs a whole int4 decoder stack (`runtime/kernels/csrc/int4_layers.cpp`) through those two
kernels in one call, operator for operator as runtime.model.decoder's int4 loop, so with the same bits;
a layer routed over experts (Qwen3-MoE's) as runtime.model.experts.RoutedMLP computes it (over int4
experts `routed_int4`, `runtime/kernels/csrc/routed_int4.cpp`, in ponder's own arithmetic, the op
RoutedMLP calls; over float ones `runtime/kernels/csrc/routed_experts.cpp`, RoutedMLP's ATen operators).

`gated_delta_steps` runs a step's sequences through a Gated DeltaNet layer past its projections in one
call (`runtime/kernels/csrc/gated_delta.cpp`): the causal convolution, the normalisations and the
recurrent state, each sequence's tokens one after the other, in a fixed order whatever else the step
holds; `gated_delta` one sequence's, by the same code.

`hybrid_layers` runs Qwen3.5's whole int4 layer stack (`runtime/kernels/csrc/hybrid_layers.cpp`): its
Gated DeltaNet and gated attention layers through those kernels in one call, operator for operator as
runtime.model.qwen35_layers' int4 loop, so with the same bits.

torch's extension builder compiles them once into ponder's start-up cache (runtime.startup_cache,
`~/.cache/ponder/kernels/`), keyed by the sources' contents, the flags, the torch version and the CPU's
vector unit, in about 15 s (minutes on a loaded machine); a later process loads the built library
directly, in milliseconds. (Loading through the extension builder every time re-ran ninja in one
shared build directory, and any other checkout or flag set rebuilt it there: 19 s a start.)
`q4_kernel()` returns the op, or raises `KernelUnavailable` saying why it cannot run here
(`q4_unavailable()` says the same without raising).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent / "csrc"
_FILES = ("q4_linear.cpp", "decode_attention.cpp", "int4_layers.cpp", "routed_experts.cpp", "float_linear.cpp",
          "gated_delta.cpp", "small_ops.cpp", "routed_int4.cpp", "hybrid_layers.cpp", "hybrid_ops.cpp")
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]  # no contraction: a row's arithmetic is as written
_NAME = "ponder_cpu_kernels"
_LIBRARY = f"{_NAME}.so"


class KernelUnavailable(RuntimeError):
    """ponder's CPU kernel cannot run on this machine; the message says why."""


@functools.cache
def _load() -> str | None:
    """None once the kernels are loaded, else why they cannot be."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it is written for x86-64 CPUs, and this one is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"it needs AVX2, and torch reports this CPU's vector unit as {torch.backends.cpu.get_cpu_capability()}"
    from runtime.startup_cache import Entry, runtime_sources, sources_hash

    sources = sorted(path for path in _SOURCES.iterdir() if path.suffix in (".cpp", ".h"))
    entry = Entry("kernels", {"sources": sources_hash(sources), "flags": _FLAGS,
                              "loader": sources_hash(runtime_sources("kernels/cpu_kernels.py"))})
    library = entry.path / _LIBRARY
    if entry.is_present():
        try:
            torch.ops.load_library(str(library))
        except OSError as exc:
            log.warning("ponder's built CPU kernels at %s do not load (%s); building them again", library, exc)
            entry.discard()
        else:
            log.info("ponder CPU kernels loaded from %s (%s)", entry.path, describe_isa())
            return None if torch.ops.ponder.q4_best_isa() >= 0 else "this CPU lacks AVX2, FMA or F16C"
    reason = _build(entry)
    if reason is not None:
        return reason
    if torch.ops.ponder.q4_best_isa() < 0:
        return "this CPU lacks AVX2, FMA or F16C"
    log.info("ponder CPU kernels built and loaded (%s)", describe_isa())
    return None


def _build(entry) -> str | None:
    """Compile the kernels into `entry` (or, where the cache cannot be written, a scratch directory) and
    load them; None once loaded, else why they could not be built."""
    from torch.utils import cpp_extension

    try:
        import ninja  # the pip package's binary, for a venv whose bin/ is not on PATH

        if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])
    except ImportError:
        pass  # a ninja on PATH, if any, does
    log.info("building ponder's CPU kernels (once per version and machine, about 15 s)")
    built: list[Path] = []

    def compile_into(directory: Path) -> None:
        cpp_extension.load(_NAME, [str(_SOURCES / name) for name in _FILES], extra_cflags=_FLAGS,
                           extra_ldflags=["-fopenmp"], extra_include_paths=[str(_SOURCES)],
                           build_directory=str(directory), is_python_module=False)
        built.append(directory)

    try:
        if not entry.write(compile_into):
            if not built:  # the cache cannot be written: build in a scratch directory for this process
                compile_into(Path(tempfile.mkdtemp(prefix="ponder-kernels-")))
            return None
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as exc:  # no compiler or ninja, a failed build
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return f"it could not be built ({last})"
    return None


def q4_kernel():
    """The `torch.ops.ponder.q4_linear` op; raises KernelUnavailable where it cannot run."""
    return _ops("int4 CPU kernel", "q4_linear")[0]


def float_kernel():
    """`torch.ops.ponder.float_linear` with the instruction set `model.cpu_isa` allows; raises
    KernelUnavailable where it cannot run."""
    op, = _ops("float CPU kernel", "float_linear")
    return lambda x, weight, bias=None: op(x, weight, bias, float_isa())


def float_isa() -> int:
    """The float kernel's instruction set argument `model.cpu_isa` allows: 0 AVX2, -1 the best there is."""
    return 0 if _isa_limit == "avx2" else -1


KERNEL_CACHE_DTYPES = (torch.float32, torch.bfloat16)  # the KV caches `attention_kernel` reads


def attention_kernel():
    """The `torch.ops.ponder.decode_attention` op; raises KernelUnavailable where it cannot run."""
    return _ops("decode attention kernel", "decode_attention")[0]


def layers_kernel():
    """The `torch.ops.ponder.int4_layers` op (an int4 or float decoder stack); raises KernelUnavailable
    where it cannot run."""
    return _ops("int4 decoder kernel", "int4_layers")[0]


def gated_delta_kernel():
    """The `torch.ops.ponder.gated_delta` op; raises KernelUnavailable where it cannot run."""
    return _ops("Gated DeltaNet kernel", "gated_delta")[0]


def hybrid_layers_kernel():
    """The `torch.ops.ponder.hybrid_layers` op (Qwen3.5's int4 layer stack); raises KernelUnavailable
    where it cannot run."""
    return _ops("hybrid decoder kernel", "hybrid_layers")[0]


def gated_delta_steps_kernel():
    """The `torch.ops.ponder.gated_delta_steps` op (every sequence of a step through a Gated DeltaNet layer
    in one call); raises KernelUnavailable where it cannot run."""
    return _ops("Gated DeltaNet kernel", "gated_delta_steps")[0]


def small_ops():
    """(`torch.ops.ponder.head_norms`, `torch.ops.ponder.silu_mul`): the int4 decoder's head norms and
    silu(gate) * up in ponder's own arithmetic (`runtime/kernels/csrc/small_ops.cpp`, the stack kernel's);
    raises KernelUnavailable where they cannot run."""
    return _ops("CPU kernels", "head_norms", "silu_mul")


def loaded_argmax():
    """`torch.ops.ponder.argmax_rows` (each row's torch.argmax, `runtime/kernels/csrc/small_ops.cpp`) where
    this process has loaded the kernels already (a model on the int or float kernels), else None: the
    greedy sampler never builds them for itself, and the index is the same either way."""
    if _load.cache_info().currsize == 0 or _load() is not None:
        return None
    return torch.ops.ponder.argmax_rows.default


def hybrid_ops():
    """(`torch.ops.ponder.gated_norm`, `qk_heads`, `sigmoid_gate`): Qwen3.5's int4 layers' small operators
    in ponder's own arithmetic (`runtime/kernels/csrc/hybrid_ops.cpp`, the hybrid stack kernel's); raises
    KernelUnavailable where they cannot run."""
    return _ops("CPU kernels", "gated_norm", "qk_heads", "sigmoid_gate")


def routed_ops():
    """(`torch.ops.ponder.routed_int4`, `route_rows`, `mix_int4`): a routed block over int4 experts, its
    routing and its experts' weighted sum in ponder's own arithmetic (`runtime/kernels/csrc/routed_int4.cpp`,
    the stack kernel's); raises KernelUnavailable where they cannot run."""
    return _ops("CPU kernels", "routed_int4", "route_rows", "mix_int4")


def _ops(what: str, *names: str) -> tuple:
    """The ops `torch.ops.ponder.<name>` once the kernels load; raises KernelUnavailable (ponder's `what`
    cannot run here, and why) where they cannot."""
    reason = _load()
    if reason is not None:
        raise KernelUnavailable(f"ponder's {what} cannot run here: {reason}")
    return tuple(getattr(torch.ops.ponder, name).default for name in names)


def q4_unavailable() -> str | None:
    """None where the int4 kernel runs, else why it cannot."""
    return _load()


def describe_isa() -> str:
    return {0: "AVX2", 1: "AVX512-VNNI"}.get(torch.ops.ponder.q4_best_isa(), "none")


ISAS = ("auto", "avx2")
_isa_limit = "auto"  # use_isa's: the float kernel reads it at each call, the int kernel keeps its own


def use_isa(name: str) -> str:
    """Keep the int4 and float kernels at or below instruction set `name` for this process (the
    `model.cpu_isa` setting): `auto` runs AVX512 (AVX512-VNNI for int4) where the CPU has it, `avx2`
    the AVX2 path most desktop CPUs run, to time it on a server CPU. The bits are the same either way.
    Returns the instruction set the int4 kernel now runs ("none" where it cannot run here)."""
    global _isa_limit
    if name not in ISAS:
        raise ValueError(f"model.cpu_isa = {name!r} is not one of {', '.join(ISAS)}")
    if _load() is not None:
        return "none"
    _isa_limit = name
    torch.ops.ponder.q4_limit_isa(0 if name == "avx2" else 1)
    return describe_isa()
