"""Commands that stay true: every shell and Python block of the README and docs/ is marked, and those
marked `<!-- run: live -->` run against a live `ponder serve` on a tiny model; every `ponder` command
named parses with the CLI's own parsers, every setting and route named exists, every TOML block is
valid settings. A renamed flag, key or route fails here."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess

import pytest

from tests import docs_blocks as docs
from tests.server.live import live_server

PAGES = {str(path.relative_to(docs.ROOT)): path.read_text() for path in docs.pages()}
BLOCKS = [block for page, text in PAGES.items() for block in docs.blocks(text, page)]
DOCUMENTED = "http://127.0.0.1:8000"


def prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)


def test_every_shell_and_python_block_is_run_live_or_says_why_not():
    assert docs.unmarked(BLOCKS) == []
    live = [block.where for block in BLOCKS if block.marker == docs.LIVE]
    assert "README.md:30" in live and "docs/search.md:7" in live and len(live) >= 5


def test_an_unmarked_block_or_a_reason_left_out_is_seen():
    text = "```sh\nponder serve\n```\n\n<!-- not run: -->\n```python\nx = 1\n```\n\n<!-- not run: a GPU -->\n```sh\nls\n```\n"
    assert docs.unmarked(docs.blocks(text, "page.md")) == ["page.md:1", "page.md:6"]


def test_every_ponder_command_named_parses():
    problems = []
    for page, text in PAGES.items():
        shell = [c for b in docs.blocks(text, page) if b.lang in ("sh", "bash") for c in docs.commands(b.code, True)]
        problems += [f"{page}: {p}" for c in shell + docs.commands(prose(text), False)
                     if (p := docs.command_problem(c)) is not None]
    assert problems == []


def test_a_renamed_flag_fails():
    assert docs.commands("```\n`ponder serve --quantise int4` and `ponder bench decode --tokens 8`", False) == [
        ["ponder", "serve", "--quantise", "int4"], ["ponder", "bench", "decode", "--tokens", "8"]]
    assert "unrecognized arguments: --quantise int4" in docs.command_problem(["ponder", "serve", "--quantise", "int4"])
    assert docs.command_problem(["ponder", "bench", "decode", "[--tokenz", "N]"]) == \
        "`ponder bench decode`: unknown flags ['--tokenz']"
    assert docs.command_problem(["python", "-m", "bench.decode", "--tokens", "64", "--repeats", "2"]) is None
    assert docs.command_problem(["ponder", "bench", "decoder"]) == "`ponder bench decoder`: no such benchmark"
    shell = "docker run --gpus all \\\n  -e A=b \\\n  ponder serve --host 0.0.0.0 --modle /m\n"
    assert docs.commands(shell, True) == [["ponder", "serve", "--host", "0.0.0.0", "--modle", "/m"]]


def test_every_setting_named_exists():
    assert {page: docs.key_problems(text) for page, text in PAGES.items() if docs.key_problems(text)} == {}
    assert all(docs.not_settings_are_read_somewhere().values())


def test_a_renamed_setting_fails():
    text = ("`PONDER_CACHE__NUM_BLOCKS`, `PONDER_VERIFIERS__PRM__PATH`, `[cache] block_size`, `scheduler.policy`, "
            "`search.n`, `search.max_timeout_s`, PONDER_SERVER__PORTT, `[cache] blocksize`, `ui.max_tree`")
    assert docs.key_problems(text) == ["PONDER_SERVER__PORTT: no such setting", "cache.blocksize: no such setting",
                                       "ui.max_tree: no such setting"]


def test_every_route_named_exists():
    assert {page: docs.route_problems(text) for page, text in PAGES.items() if docs.route_problems(text)} == {}


def test_a_renamed_route_fails():
    text = ("`GET /ui/searches/{id}/events`, `POST /tokenize`, base_url http://127.0.0.1:8000/v1, "
            "`GET /v1/modelz`, `GET /v1/completions`, curl http://localhost:8000/v1/chat/completion -d")
    assert docs.route_problems(text) == ["/v1/chat/completion: no such route", "GET /v1/completions: no such route",
                                         "GET /v1/modelz: no such route"]


def test_every_toml_block_is_valid_settings():
    tomls = [block for block in BLOCKS if block.lang == "toml"]
    assert tomls and {block.where: docs.toml_problem(block.code) for block in tomls} == {
        block.where: None for block in tomls}
    assert "validation error" in docs.toml_problem('[verifiers.prm]\nkind = "qwen-prm"\npathh = "/m"\n')


@pytest.fixture(scope="module")
def server(tiny_llama):
    # The tiny model under the embedded model's name, so the documented requests run as written.
    with live_server("--model", str(tiny_llama), "--device", "cpu",
                     env={"PONDER_MODEL__SERVED_NAME": "SmolLM2-135M-Instruct"}) as (base, _):
        yield base


@pytest.mark.parametrize("page", sorted({b.page for b in BLOCKS if b.marker == docs.LIVE}))
def test_the_live_blocks_run_against_a_live_server(server, page):
    namespace: dict = {}
    for block in (b for b in BLOCKS if b.page == page and b.marker == docs.LIVE):
        assert DOCUMENTED in block.code, f"{block.where}: a live block talks to {DOCUMENTED}"
        code = block.code.replace(DOCUMENTED, server)
        if block.lang == "python":
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, block.where, "exec"), namespace)  # noqa: S102 - the docs' own example
            response = namespace.get("resp")
            assert response is not None and response.choices, block.where
            continue
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{block.where}: {done.stderr}"
        body = json.loads(done.stdout)
        # The tiny model's text is noise (it may end at once); the answer's shape is what is checked.
        assert "error" not in body and body["object"] == "chat.completion", f"{block.where}: {done.stdout}"
        assert body["choices"][0]["finish_reason"] in ("stop", "length"), block.where
        if '"search"' in code:
            assert body["search"]["strategy"] == "beam" and body["choices"][0]["search"]["step_scores"], block.where


SHOWN = docs.shown_outputs(BLOCKS)


def test_the_outputs_shown_are_paired_with_their_requests():
    assert [(request.where, output.where) for request, output in SHOWN] == [
        ("README.md:30", "README.md:36"), ("README.md:52", "README.md:66")]
    shown = {"a": 1, "id": "x", "b": {"score": 0.9935, "seconds_generating": 0.29, "steps": [2, "s"]}}
    assert docs.output_differences(shown, {"a": 1, "id": "y", "b": {"score": 0.99352, "steps": [2, "s"],
                                                                     "seconds_generating": 5.7}}) == []
    assert docs.output_differences(shown, {"a": 1.0, "b": {"score": 0.99344, "steps": [3, "s"]}}) == [
        ".a: shown 1, the code gives 1.0", ".b.score: shown 0.9935, the code gives 0.99344",
        ".b.steps[0]: shown 2, the code gives 3"]
    assert docs.output_differences(shown, {"a": 1}) == [".b: not in the response"]


@pytest.fixture(scope="module")
def embedded():
    # The model the pages' outputs were taken on: the embedded one, default settings.
    with live_server("--device", "cpu", timeout=300) as (base, _):
        yield base


@pytest.mark.parametrize("pair", SHOWN, ids=[output.where for _, output in SHOWN])
def test_an_output_shown_is_what_the_code_gives(embedded, pair):
    """Greedy or seeded, the documented request answers what its page shows, field for field (seconds,
    the id and the time aside), on the instruction set the page names (another one's rounding may pick
    another token)."""
    from bench.report import kernel_isa

    request, output = pair
    isa = output.marker.rsplit("ISA ", 1)[-1]
    if kernel_isa() != isa:
        pytest.skip(f"{output.where} was taken with the {isa} kernel; this machine runs {kernel_isa()}")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", request.code.replace(DOCUMENTED, embedded)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{request.where}: {done.stderr}"
    assert docs.output_differences(json.loads(output.code), json.loads(done.stdout), output.where) == []
