"""`pkv run-batch`: OpenAI Batch API lines answered by the engine, in input order, each bad
line its own error while the others run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pkv import LLM, SamplingParams
from pkv.cli.main import app

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.fixture(scope="module")
def answered(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
             ) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("batch")
    # One sequence at a time and one waiting, four requests sent at once: the full queue
    # turns requests away (503), and the batch waits and sends them again. The config's API
    # key is the one the batch's requests carry.
    (folder / "serve.yaml").write_text("kv-cache-memory: 16MiB\nmax-model-len: 256\n"
                                       "max-num-seqs: 1\nmax-waiting-requests: 1\n"
                                       "api-key: sk-first,sk-second\n")
    lines = [_line("chat", "/v1/chat/completions",
                   {"messages": ASK, "max_tokens": 6, "temperature": 0}),
             *(_line(f"text{i}", "/v1/completions",
                     {"prompt": f"Once upon a time {i}", "max_tokens": 5, "temperature": 0})
               for i in range(6)),
             "{not json",
             _line("bad", "/v1/completions", {"prompt": "x", "max_tokens": -1}),
             _line("nowhere", "/v1/nope", {}),
             _line("chat", "/v1/completions", {"prompt": "x"}),
             _line("streamed", "/v1/completions", {"prompt": "x", "stream": True}),
             # what over HTTP is a 400 each: a NaN, a lone surrogate (json.dumps escapes it)
             '{"custom_id": "nan", "url": "/v1/completions", "body": {"prompt": "x", '
             '"temperature": NaN}}',
             _line("surrogate", "/v1/completions", {"prompt": "x\ud800"}),
             # and lines that are no request: too deep for a JSON reader, in the background
             '{"custom_id": "deep", "url": "/v1/completions", "body": {"prompt": '
             + "[" * 100_000 + "]" * 100_000 + "}}",
             _line("later", "/v1/responses", {"input": "x", "background": True}),
             ""]
    # and a line that is not UTF-8
    (folder / "in.jsonl").write_bytes("\n".join(lines).encode() + b'\n{"custom_id": "b", '
                                      b'"url": "/v1/completions", "body": {"prompt": "\xff"}}')
    result = CliRunner().invoke(app, [
        "run-batch", str(tiny_llama_dir), "-i", str(folder / "in.jsonl"),
        "-o", str(folder / "out.jsonl"), "--config", str(folder / "serve.yaml"),
        "--max-concurrency", "4"])
    assert result.exit_code == 0, result.output
    assert "17 requests" in result.stderr and "7 answered, 10 failed" in result.stderr
    rows = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["chat", *(f"text{i}" for i in range(6)), None,
                                              "bad", "nowhere", "chat", "streamed", "nan",
                                              "surrogate", None, "later", None]
    return {"rows": rows, "model": tiny_llama_dir}


def test_answers_equal_the_engines_own(answered: dict[str, Any]) -> None:
    rows = answered["rows"]
    llm = LLM(str(answered["model"]), kv_cache_memory="16MiB", max_model_len=256,
              show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=5)
    texts = [o.outputs[0].text
             for o in llm.generate([f"Once upon a time {i}" for i in range(6)], greedy)]
    assert {r["response"]["status_code"] for r in rows[:7]} == {200}  # none lost to the queue
    assert [r["response"]["body"]["choices"][0]["text"] for r in rows[1:7]] == texts
    chat = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    first = rows[0]["response"]
    assert first["status_code"] == 200 and first["body"]["choices"][0]["message"]["content"] == \
        chat
    # (the id the server's access log names, as OpenAI's request_id is its request's)
    assert first["request_id"].startswith("req_") and rows[0]["error"] is None
    assert len({r["id"] for r in rows}) == len(rows)


def test_each_bad_line_is_its_own_error(answered: dict[str, Any]) -> None:
    by_line = answered["rows"][7:]
    assert by_line[0]["error"]["message"].startswith("line 8 is not JSON")
    assert by_line[1]["response"]["status_code"] == 400
    assert by_line[1]["response"]["body"]["error"]["param"] == "max_tokens"
    assert by_line[2]["response"]["status_code"] == 404
    assert "custom_id 'chat' is used twice" in by_line[3]["error"]["message"]
    assert "cannot stream" in by_line[4]["error"]["message"]
    assert all(r["response"] is None for r in (by_line[0], by_line[3], by_line[4]))
    nan, surrogate, deep, later, not_utf8 = by_line[5:]
    assert [r["response"]["body"]["error"]["param"] for r in (nan, surrogate)] == [
        "temperature", "prompt"]
    assert deep["error"]["message"].startswith("line 15 is not JSON")
    assert "cannot run in the background" in later["error"]["message"]
    assert not_utf8["error"]["message"].startswith("line 18 is not UTF-8")


def test_bad_files_are_one_line_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    result = CliRunner().invoke(app, ["run-batch", "-i", str(empty),
                                      "-o", str(tmp_path / "out.jsonl")])
    assert result.exit_code == 2 and "holds no requests" in result.stderr
    result = CliRunner().invoke(app, ["run-batch", "-i", str(empty),
                                      "-o", str(tmp_path / "no" / "out.jsonl")])
    shown = " ".join(result.stderr.replace("│", " ").split())  # (the box wraps long paths)
    assert result.exit_code == 2 and "does not exist" in shown
    assert not (tmp_path / "out.jsonl").exists()
