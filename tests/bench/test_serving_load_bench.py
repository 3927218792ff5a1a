"""The serving-load benchmark on a tiny model: ponder through HTTP at each client count, the
in-process stream beside it, an anchor skipped with its reason where it cannot run; and, with no
anchor installed, which anchor a model gets, vLLM's command line, its ratios and its process group."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path

import pytest

from bench import serving_load


def test_streams_reach_every_client_and_compare_with_the_engine_in_process(tiny_llama, tmp_path):
    binaries, skipped = serving_load.anchors(tiny_llama, None, str(tmp_path / "no-vllm"))
    assert binaries == {}
    results = serving_load.run(tiny_llama, [1, 3], requests=2, max_tokens=6, threads=1, binaries=binaries,
                               skipped=skipped, dtype="float32")
    one, three = results["systems"]["ponder"]
    assert (one["clients"], one["requests"], three["clients"], three["requests"]) == (1, 2, 3, 6)
    assert one["tokens"] == 2 * 6 and three["tokens"] == 6 * 6  # ignore_eos: every stream runs to max_tokens
    assert one["tokens_per_s"] > 0 and one["ttft_p50_s"] > 0 and one["stream_tokens_per_s_p50"] > 0
    assert results["in_process_tokens_per_s_1"] > 0
    assert one["vs_in_process"] == round(one["stream_tokens_per_s_p50"] / results["in_process_tokens_per_s_1"], 2)
    assert "vs_in_process" not in three and "vs_llama_server" not in one and "vs_vllm" not in one
    assert list(results["systems"]) == ["ponder"] and results["dtype"] == "float32"
    assert results["llama_server_skipped"] == "the model is not a GGUF file"
    assert results["vllm_skipped"] == f"{tmp_path / 'no-vllm'} is not an executable file"
    text = serving_load.table(results)
    assert text.splitlines()[0].startswith(f"serving-load: {tiny_llama.name}, float32, 1 threads, 6 tokens")
    assert "llama-server skipped: the model is not a GGUF file" in text
    assert f"vllm skipped: {tmp_path / 'no-vllm'} is not an executable file" in text


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_a_directory_model_gets_vllm_and_skips_llama_server(tmp_path, monkeypatch):
    model = tmp_path / "smollm2-hf"
    model.mkdir()
    vllm = _executable(tmp_path / "bin" / "vllm")
    not_gguf = {"llama-server": "the model is not a GGUF file"}
    # The --llama-server flag does not matter: a directory is no file llama-server reads.
    assert serving_load.anchors(model, str(_executable(tmp_path / "llama-server")), str(vllm)) == (
        {"vllm": str(vllm)}, not_gguf)
    assert serving_load.anchors(model, None, str(tmp_path / "bin" / "missing")) == (
        {}, {**not_gguf, "vllm": f"{tmp_path / 'bin' / 'missing'} is not an executable file"})
    monkeypatch.setenv("PATH", str(vllm.parent))
    assert serving_load.anchors(model, None, None) == ({"vllm": str(vllm)}, not_gguf)
    monkeypatch.setenv("PATH", str(model))
    assert serving_load.anchors(model, None, None) == (
        {}, {**not_gguf, "vllm": "no vllm on PATH (vLLM's CPU build; pass --vllm PATH)"})


def test_a_gguf_model_gets_llama_server_and_skips_vllm(tmp_path, monkeypatch):
    model = tmp_path / "smollm2-Q8_0.gguf"
    llama = _executable(tmp_path / "bin" / "llama-server")
    is_gguf = {"vllm": "the model is a GGUF file (vLLM serves a Hugging Face directory)"}
    assert serving_load.anchors(model, str(llama), str(_executable(tmp_path / "vllm"))) == (
        {"llama-server": str(llama)}, is_gguf)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert serving_load.anchors(model, None, None) == (
        {}, {**is_gguf, "llama-server": "no llama-server on PATH (llama.cpp's server; pass --llama-server PATH)"})


def test_main_hands_the_flags_to_run_and_prints_the_skips(tmp_path, monkeypatch, capsys):
    model = tmp_path / "smollm2-hf"
    model.mkdir()
    calls = []

    def fake_run(*args):
        calls.append(args)
        results = {"model": str(model), "dtype": args[7], "threads": args[4], "max_tokens": args[3],
                   "systems": {"ponder": []}, "in_process_tokens_per_s_1": 1.0,
                   **{f"{serving_load.ANCHORS[name]}_skipped": reason for name, reason in args[6].items()}}
        return results

    monkeypatch.setattr(serving_load, "run", fake_run)
    missing = str(tmp_path / "missing-vllm")
    assert serving_load.main(["--model", str(model), "--clients", "1,16", "--requests", "3", "--max-tokens", "32",
                              "--threads", "2", "--dtype", "bfloat16", "--vllm", missing]) == 0
    assert calls == [(model, [1, 16], 3, 32, 2, {}, {"llama-server": "the model is not a GGUF file",
                                                     "vllm": f"{missing} is not an executable file"}, "bfloat16", 1)]
    out = capsys.readouterr().out
    assert "smollm2-hf, bfloat16, 2 threads, 32 tokens a request" in out
    assert f"vllm skipped: {missing} is not an executable file" in out
    with pytest.raises(SystemExit):
        serving_load.main(["--model", str(model), "--dtype", "float64"])
    assert len(calls) == 1


def _row(clients: int, tokens_per_s: float, stream: float) -> dict:
    return {"clients": clients, "requests": 2 * clients, "seconds": 1.0, "tokens": 128 * clients,
            "tokens_per_s": tokens_per_s, "stream_tokens_per_s_p50": stream, "ttft_p50_s": 0.1}


def test_ponder_rows_get_their_ratio_to_vllm_in_the_json_and_the_table():
    results = {"model": "/models/smollm2-hf", "dtype": "float32", "threads": 2, "max_tokens": 64,
               "systems": {"ponder": [_row(1, 12.0, 11.0), _row(16, 140.0, 9.0)],
                           "vllm": [_row(1, 24.0, 23.5), _row(16, 200.0, 12.0)]},
               "llama_server_skipped": "the model is not a GGUF file", "in_process_tokens_per_s_1": 12.5}
    serving_load._ratios(results)
    one, sixteen = results["systems"]["ponder"]
    assert (one["vs_vllm"], sixteen["vs_vllm"], one["vs_in_process"]) == (0.5, 0.7, 0.88)
    assert "vs_llama_server" not in one and "vs_in_process" not in sixteen
    assert all(not any(k.startswith("vs_") for k in row) for row in results["systems"]["vllm"])
    lines = serving_load.table(results).splitlines()
    assert lines[0].startswith("serving-load: smollm2-hf, float32, 2 threads, 64 tokens a request")
    assert "vs vLLM" in lines[1]
    assert [line.split() for line in lines[2:6]] == [
        ["ponder", "1", "12.0", "11.0", "0.1", "-", "0.50x", "0.88x"],
        ["ponder", "16", "140.0", "9.0", "0.1", "-", "0.70x", "-"],
        ["vllm", "1", "24.0", "23.5", "0.1", "-", "-", "-"],
        ["vllm", "16", "200.0", "12.0", "0.1", "-", "-", "-"]]
    assert lines[6:] == ["llama-server skipped: the model is not a GGUF file"]


def test_vllm_command_binds_the_threads_and_serves_every_client_at_once():
    argv, env = serving_load.vllm_command("/opt/vllm-venv/bin/vllm", Path("/models/smollm2-hf-bf16"), port=8123,
                                          threads=4, dtype="bfloat16", max_num_seqs=16, max_model_len=2048)
    assert argv == ["/opt/vllm-venv/bin/vllm", "serve", "/models/smollm2-hf-bf16", "--host", "127.0.0.1",
                    "--port", "8123", "--dtype", "bfloat16", "--enforce-eager", "--max-num-seqs", "16",
                    "--max-model-len", "2048", "--served-model-name", "smollm2-hf-bf16"]
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-3", "HF_HUB_OFFLINE": "1",
                   "VLLM_NO_USAGE_STATS": "1"}
    _, env = serving_load.vllm_command("vllm", Path("m"), 1, threads=1, dtype="float32", max_num_seqs=1,
                                       max_model_len=2048)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-0"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_stop_group_ends_the_children_too():
    # As vLLM's server does, the leader starts a child; stopping the leader alone would leave it running.
    proc = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    with proc.stdout:
        child = int(proc.stdout.readline())
    assert _alive(child)
    serving_load.stop_group(proc, timeout_s=5)
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.returncode is not None and not _alive(child)


def test_rounds_alternate_the_servers_and_report_each_median_round(monkeypatch, tmp_path):
    turns, rates = [], iter([10.0, 30.0, 70.0, 20.0, 40.0, 60.0, 50.0, 90.0, 80.0, 100.0, 5.0, 200.0])

    @contextlib.contextmanager
    def fake_server(name):
        turns.append(name)
        yield name

    async def fake_clients(base, clients, requests, max_tokens):
        return _row(clients, next(rates), 1.0) | {"server": base}

    monkeypatch.setattr(serving_load, "serve", lambda *a, **k: fake_server("ponder"))
    monkeypatch.setattr(serving_load, "llama_server", lambda *a, **k: fake_server("llama-server"))
    monkeypatch.setattr(serving_load, "_clients", fake_clients)
    monkeypatch.setattr(serving_load, "in_process_rate", lambda *a: 100.0)
    results = serving_load.run(tmp_path / "m.gguf", [1, 16], 2, 64, 2, {"llama-server": "/bin/llama-server"}, {},
                               rounds=3)
    assert turns == ["ponder", "llama-server", "llama-server", "ponder", "ponder", "llama-server"]
    # the turns' rates in order: ponder (10, 30), llama-server (70, 20) | llama-server (40, 60), ponder (50, 90) |
    # ponder (80, 100), llama-server (5, 200)
    assert results["rounds"] == {"ponder": [[10.0, 50.0, 80.0], [30.0, 90.0, 100.0]],
                                 "llama-server": [[70.0, 40.0, 5.0], [20.0, 60.0, 200.0]]}
    ponder, llama = results["systems"]["ponder"], results["systems"]["llama-server"]
    assert [r["tokens_per_s"] for r in ponder] == [50.0, 90.0] and [r["tokens_per_s"] for r in llama] == [40.0, 60.0]
    assert (ponder[0]["vs_llama_server"], ponder[1]["vs_llama_server"]) == (1.25, 1.5)
    lines = serving_load.table(results).splitlines()
    assert lines[-4:] == ["ponder rounds, tok/s at 1 clients: 10.0 50.0 80.0",
                          "ponder rounds, tok/s at 16 clients: 30.0 90.0 100.0",
                          "llama-server rounds, tok/s at 1 clients: 70.0 40.0 5.0",
                          "llama-server rounds, tok/s at 16 clients: 20.0 60.0 200.0"]
    assert serving_load.median_rows([[{"tokens_per_s": 2}], [{"tokens_per_s": 1}]]) == [{"tokens_per_s": 1}]
