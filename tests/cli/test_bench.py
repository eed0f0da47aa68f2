"""`pkv bench` code paths on the tiny model with tiny lengths (no speed is asserted)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pkv.cli.main import app

KEYS = ("output_throughput", "total_throughput", "request_throughput", "peak_rss_bytes",
        "kv_fragmentation_pct")


def _bench(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def test_offline_sweep_with_hf_baseline_writes_json_and_plot(tmp_path: Path,
                                                             tiny_llama_dir: Path):
    out, png = tmp_path / "bench.json", tmp_path / "sweep.png"
    result = _bench(str(tiny_llama_dir), "--batch", "2,4", "--num-prompts", "4",
                    "--input-len", "5", "--output-len", "3", "--warmup", "1",
                    "--kv-cache-memory", "8MiB", "--baseline", "hf", "--baseline-batch", "2",
                    "--json", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [run["batch"] for run in data["runs"]] == [2, 4]
    for run in data["runs"]:
        for key in KEYS:
            assert key in run and key in run["baseline"], key
        assert run["output_throughput"] > 0 and run["request_throughput"] > 0
        assert 0 <= run["kv_fragmentation_pct"] < 100
        assert run["baseline"]["ratio"] > 0
        # one process holds both models: neither side's peak RSS is its own, none is shown
        assert run["peak_rss_bytes"] == run["baseline"]["peak_rss_bytes"] == 0
        assert run["baseline"]["name"].startswith("hf")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "pkv / hf" in result.output


def test_rounds_alternate_pkv_and_its_baseline_and_keep_the_median_pair(tmp_path: Path,
                                                                        tiny_llama_dir: Path):
    out = tmp_path / "rounds.json"
    result = _bench(str(tiny_llama_dir), "--batch", "2", "--num-prompts", "2", "--input-len", "5",
                    "--output-len", "3", "--warmup", "1", "--kv-cache-memory", "8MiB",
                    "--baseline", "hf", "--baseline-batch", "2", "--rounds", "3",
                    "--json", str(out))
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("pkv bench --rounds: batch 2"):]
    rows = [line for line in table.splitlines() if re.match(r"\W*[123] ", line)]
    assert len(rows) == 3, table
    out_ratios = [float(re.findall(r"([0-9.]+)x", row)[-1]) for row in rows[:3]]
    median = float(re.findall(r"([0-9.]+)x", table[table.index("median"):])[-1])
    assert median == pytest.approx(sorted(out_ratios)[1], abs=0.006)
    # The run kept for the tables and the JSON is the median round, a whole pair.
    run = json.loads(out.read_text())["runs"][0]
    assert run["baseline"]["ratio"] == pytest.approx(sorted(out_ratios)[1], abs=0.006)


def test_rounds_alternate_which_engine_goes_first():
    from pkv.cli.bench.compare import alternate, median_round

    calls: list[str] = []

    class Run:
        def __init__(self, tps: float) -> None:
            self.output_tps = tps

    mine, theirs = iter([10.0, 30.0, 20.0]), iter([10.0, 10.0, 10.0])
    pairs = alternate(lambda: calls.append("pkv") or Run(next(mine)),
                      lambda: calls.append("base") or Run(next(theirs)), 3)
    assert calls == ["pkv", "base", "base", "pkv", "pkv", "base"]
    assert median_round(pairs)[0].output_tps == 20.0  # ratios 1, 3, 2: the median pair
    alone = alternate(lambda: Run(next(iter([5.0]))), None, 2)
    assert [other for _, other in alone] == [None, None]


def test_dataset_prompts(tmp_path: Path, tiny_llama_dir: Path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Hello there"}\n{"prompt": "Another prompt"}\n')
    result = _bench(str(tiny_llama_dir), "--batch", "2", "--num-prompts", "3", "--dataset",
                    str(data), "--output-len", "2", "--kv-cache-memory", "8MiB",
                    "--json", str(tmp_path / "d.json"))
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "d.json").read_text())["num_requests"] == 3


def test_sampled_requests(tmp_path: Path, tiny_llama_dir: Path):
    result = _bench(str(tiny_llama_dir), "--batch", "2", "--num-prompts", "2", "--input-len",
                    "5", "--output-len", "3", "--warmup", "0", "--kv-cache-memory", "8MiB",
                    "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
                    "--json", str(tmp_path / "s.json"))
    assert result.exit_code == 0, result.output
    assert "sampled at temperature 0.8, top-p 0.9, top-k 20" in " ".join(result.output.split())
    assert json.loads((tmp_path / "s.json").read_text())["runs"][0]["output_throughput"] > 0


@pytest.mark.parametrize("args,message", [
    (["--batch", "0"], "--batch must be >= 1"),
    (["--dataset", "/nonexistent/prompts.jsonl"], "does not exist"),
    (["--baseline", "openai", "--url", "http://127.0.0.1:9"], "cannot reach"),
    (["--baseline", "vllm"], "--baseline must be"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--top-p", "1.5"], "top_p must be in"),
    (["--num-prompts", "-1"], "Invalid value for '--num-prompts'"),
    (["--json", "/"], "is a directory"),
])
def test_bad_input_is_one_line_and_nonzero(tiny_llama_dir: Path, args: list[str], message: str):
    result = _bench(str(tiny_llama_dir), "--kv-cache-memory", "8MiB", *args)
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_empty_dataset(tmp_path: Path, tiny_llama_dir: Path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = _bench(str(tiny_llama_dir), "--kv-cache-memory", "8MiB", "--dataset", str(empty))
    assert result.exit_code == 2 and "has no prompts" in result.output
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"prompt": "fine"}\n{"prompt": 1}\n')
    result = _bench(str(tiny_llama_dir), "--kv-cache-memory", "8MiB", "--dataset", str(numbers))
    assert result.exit_code == 2 and "line 2: the prompt must be a non-empty string" in \
        result.output


def test_unreachable_server_for_bench_serve():
    result = _bench("serve", "--url", "http://127.0.0.1:9", "--concurrency", "1")
    assert result.exit_code == 2 and "cannot reach" in result.output
    tools = _bench("tools", "--url", "http://127.0.0.1:9")
    assert tools.exit_code == 2 and "cannot reach" in tools.output
    assert "Traceback" not in tools.output


def test_soak_short_run_on_a_real_server(tmp_path: Path, tiny_llama_dir: Path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    # Seconds, not minutes: the server is still warming up (~30 MiB/min in its first minute
    # here), so the bound is one a per-request leak would break, not the hour-long 1 MiB/min.
    # Its 3-second samples still climb by tens of MiB while new batch shapes meet oneDNN
    # (34 MiB over four samples on an Ice Lake Xeon): the plateau's band, like the slope
    # bound, is one a per-request leak would break.
    # A 3-second sample's p99 TTFT is its slowest few requests, which a shared 2-core machine
    # moves 2-7x between samples: the drift bound is for minutes of traffic, not this.
    result = _bench("soak", str(tiny_llama_dir), "--duration", "12", "--interval", "3",
                    "--warmup", "6", "--max-num-seqs", "4", "--max-model-len", "512",
                    "--max-slope", "240", "--plateau-band-mib", "120",
                    "--max-ttft-growth", "50", "--trace", "--json",
                    str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["served"] > 0 and data["problems"] == []
    assert len(data["samples"]) == 4 and data["plateau_sample"] is not None
    assert data["plateau_sample"] <= 2 and data["slope_mib_per_min"] <= 240
    assert 0 < data["warmup_mib"] <= 320 and data["before_load_mib"] > 0
    assert data["end"]["kv_blocks_free"] == data["end"]["kv_blocks_total"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "soak passed" in result.output
    last = data["memory_reports"][-1]
    assert last["python_heap_bytes"] > 0  # --trace: the server's heap is traced
    assert last["native_heap"]["in_use_bytes"] > 0 and last["threads"] >= 2
    assert "what the native heap holds" in result.output
    caches = last["caches"]
    for name in ("prefix-cache blocks", "outlines compiled grammars", "outlines token masks",
                 "stored responses"):
        assert 0 <= caches[name]["size"] <= caches[name]["bound"], name
    assert caches["outlines compiled grammars"]["size"] >= 1  # the mix's JSON schemas
    assert caches["stored responses"]["size"] >= 1  # the mix's Responses turns
    assert "caches (server idle)" in result.output


def test_soak_traffic_mix_covers_every_kind():
    import random

    from pkv.cli.bench.soak import continuable, request_body

    rng = random.Random(0)
    bodies = [request_body(rng, ["resp_a", "resp_b"]) for _ in range(2000)]
    by_path: dict[str, list[dict]] = {}
    for path, body in bodies:
        by_path.setdefault(path, []).append(body)
    shares = {path: len(group) / len(bodies) for path, group in by_path.items()}
    assert shares == pytest.approx({"/v1/completions": 0.3, "/v1/chat/completions": 0.3,
                                    "/v1/responses": 0.2, "/v1/messages": 0.2}, abs=0.05)
    openai_bodies = by_path["/v1/completions"] + by_path["/v1/chat/completions"]

    def share(group: list[dict], has) -> float:
        return sum(bool(has(b)) for b in group) / len(group)

    for key in ("n", "logprobs", "stop", "response_format"):
        assert 0.05 < share(openai_bodies, lambda b: key in b) < 0.15, key
    responses, messages = by_path["/v1/responses"], by_path["/v1/messages"]
    for has, expected in ((lambda b: "tools" in b, 0.15), (lambda b: "text" in b, 0.15),
                          (lambda b: "previous_response_id" in b, 0.15),
                          (lambda b: b.get("store") is False, 0.1),
                          (lambda b: "instructions" in b, 0.2)):
        assert abs(share(responses, has) - expected) < 0.05
    assert any(b.get("tool_choice") == "required" for b in responses)
    for key, expected in (("tools", 0.15), ("stop_sequences", 0.15), ("system", 0.2)):
        assert abs(share(messages, lambda b: key in b) - expected) < 0.05, key
    assert 0.6 < sum(b["stream"] for _, b in bodies) / len(bodies) < 0.8
    schemas = {json.dumps(b["response_format"]["json_schema"]["schema"]) for b in openai_bodies
               if "response_format" in b}
    assert len(schemas) == 3
    # a turn continues only a stored, short response that is no continuation itself
    turns = [b for b in responses if continuable("/v1/responses", b)]
    assert turns and all(b.get("store", True) and "previous_response_id" not in b
                         and b["max_output_tokens"] <= 48 for b in turns)
    assert not continuable("/v1/messages", messages[0])
    assert all("previous_response_id" not in b
               for _, b in (request_body(rng) for _ in range(200)))  # nothing stored yet


def test_soak_tells_an_error_event_from_text_that_says_error():
    from pkv.cli.bench.soak import is_error_event, is_token_event

    def data(payload: dict) -> str:
        return "data: " + json.dumps(payload)

    token = {"token": "error", "logprob": -0.1, "top_logprobs": [{"token": "error"}]}
    chunk = {"choices": [{"index": 0, "delta": {"content": '{"error": 1}'},
                          "logprobs": {"content": [token]}}]}
    created = {"type": "response.created", "response": {"id": "resp_1", "error": None}}
    text_delta = {"type": "response.output_text.delta", "delta": "error"}
    block_delta = {"type": "content_block_delta", "delta": {"type": "text_delta",
                                                             "text": "error"}}
    for line in (data(chunk), "data: [DONE]", data(created), data(text_delta),
                 data(block_delta), data({"type": "message_start", "message": {}})):
        assert not is_error_event(line), line
    for event in ({"error": {"message": "boom", "code": 500}},  # OpenAI's
                  {"type": "error", "code": "engine_unavailable", "message": "boom"},  # Responses'
                  {"type": "response.failed", "response": {"error": {"message": "boom"}}},
                  {"type": "error", "error": {"type": "overloaded_error", "message": "boom"}}):
        assert is_error_event(data(event)), event
    # the first token: an OpenAI chunk with text, a typed event's delta; not an opening
    # event, nor the role-only chunk a chat stream opens with
    assert is_token_event(data(chunk)) and is_token_event(data(text_delta))
    assert is_token_event(data(block_delta))
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    assert not is_token_event(data(role))
    assert not is_token_event(data(created)) and not is_token_event("data: [DONE]")
    assert not is_token_event(data({"type": "content_block_start", "index": 0}))


def test_memory_curve_tells_a_warm_up_from_a_leak():
    from pkv.cli.bench.soak_memory import MemoryCurve

    warm = MemoryCurve(1.0, [1100, 1173, 1205, 1252, 1298, 1288, 1291, 1288, 1289, 1290])
    assert warm.plateau_start() == 4 and warm.slope(4) < 1 and warm.problems() == []
    assert MemoryCurve(1.0, warm.samples_mib, band_mib=200).plateau_start() == 0
    assert warm.problems(max_peak=1250) == [
        "memory outside the KV pool peaked at 1298 MiB, above the bound of 1250 MiB"]
    slow_leak = MemoryCurve(1.0, [1000 + 2 * i for i in range(20)])
    assert "climbs 2.00 MiB/min" in " ".join(slow_leak.problems())
    fast_leak = MemoryCurve(1.0, [1000 + 10 * i for i in range(20)])
    assert "no plateau in the first half" in " ".join(fast_leak.problems())
    handed_back = MemoryCurve(1.0, [528, 532, 500])  # a fall at idle is no leak
    assert handed_back.plateau_start() == 0 and handed_back.problems() == []
    assert abs(MemoryCurve(0.5, [1000, 1001, 1000]).slope(0)) < 1e-9
    assert MemoryCurve(0.5, [1000, 1001, 1002]).slope(0) == pytest.approx(2.0)  # per minute
    warm.before_mib = 1000
    assert warm.warmup == 298 and warm.problems(max_warmup=320) == []
    assert warm.problems(max_warmup=250) == [
        "memory outside the KV pool rose 298 MiB above its idle 1000 MiB before load (bound 250)"]


def test_soak_verdict_names_each_problem():
    from pkv.cli.bench.soak import Minute, Snapshot, verdict
    from pkv.cli.bench.soak_memory import MemoryCurve

    start = Snapshot(1000 * 2**20, 10, 100, 100, 0, 50 * 2**20)
    fine = Snapshot(1200 * 2**20, 10, 100, 100, 0, 250 * 2**20)
    flat = MemoryCurve(1.0, [900, 950, 951, 950, 951, 950])
    minutes = [Minute(served=5, ttfts=[0.1]), Minute(served=5, ttfts=[0.1]),
               Minute(served=5, ttfts=[0.15])]
    assert verdict(minutes, start, fine, flat, 1.0, None) == []
    flat.before_mib = 600
    assert "rose 351 MiB above" in " ".join(verdict(minutes, start, fine, flat, 1.0, None, 320))
    bad = Snapshot(1300 * 2**20, 30, 90, 100, 1, 50 * 2**20)
    drift = minutes[:2] + [Minute(served=5, ttfts=[0.5], unexpected=["500: boom"])]
    leak = MemoryCurve(1.0, [900 + 3 * i for i in range(10)])
    problems = " | ".join(verdict(drift, start, bad, leak, 1.0, None))
    for words in ("1 unexpected errors, e.g. 500: boom", "KV blocks still held: 10",
                  "climbs 3.00 MiB/min after its plateau", "open files grew 10 -> 30",
                  "p99 TTFT drifted up: last minute over 2x the first"):
        assert words in problems
    assert "drifted" not in " ".join(verdict(drift, start, bad, leak, 1.0, None,
                                             max_ttft_growth=6))


def test_roofline_covers_prefill(tmp_path: Path, tiny_llama_dir: Path):
    out = tmp_path / "roof.json"
    result = _bench(str(tiny_llama_dir), "--batch", "1", "--num-prompts", "2", "--input-len",
                    "40", "--output-len", "1", "--warmup", "0", "--kv-cache-memory", "8MiB",
                    "--max-num-batched-tokens", "32", "--roofline", "--json", str(out))
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())
    assert run["prefill_throughput"] > 0 and run["prefill_roofline_tokens_per_s"] > 0
    assert run["prefill_roofline_pct"] == pytest.approx(
        100 * run["prefill_throughput"] / run["prefill_roofline_tokens_per_s"])
    assert "prefill tokens/s vs the float32 GEMM roofline" in result.output
    # the decode roofline's GEMMs against the CPU's own multiply-add peak
    assert run["fma_peak_gflops"] > 0 and run["roofline_gflops"] > 0
    assert run["gemm_peak_pct"] == pytest.approx(
        100 * run["roofline_gflops"] / run["fma_peak_gflops"])
    assert "multiply-add peak" in result.output


def test_fma_peak_bounds_a_gemm_measured_beside_it():
    import time

    import torch

    from pkv.csrc import cpp_build

    def gemm_gflops() -> float:
        a, b = torch.randn(256, 576), torch.randn(576, 1536)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        return 2 * 256 * 576 * 1536 / best / 1e9

    # the best flavour this CPU runs, as torch's GEMMs use it (not PKV_CPU_ISA's choice)
    ext = cpp_build.kernels(cpp_build.runnable_flavours()[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core each: a neighbour test cannot skew one side only
    try:
        # alternated, the best of each: a busy neighbour (the other worker, a sibling
        # hyperthread) slows both sides alike, not the peak's runs alone; seven rounds, as
        # three once left every peak run under the neighbour (98 GFLOP/s against the GEMM's
        # 154 on a two-vCPU Sapphire Rapids VM)
        peak = gemm = 0.0
        for _ in range(7):
            peak = max(peak, ext.fma_peak_gflops(2_000_000))
            gemm = max(gemm, gemm_gflops())
    finally:
        torch.set_num_threads(threads)
    assert gemm <= 1.25 * peak  # no float32 GEMM outruns the multiply-add peak
    assert peak <= 10 * gemm  # and the peak is this core's, in the same unit
    with pytest.raises(RuntimeError, match="iters must be positive"):
        ext.fma_peak_gflops(0)


def test_prefill_roofline_counts_linears_attention_and_head(tiny_llama_dir: Path):
    from pkv.cli.bench.roofline import attention_flops, gemm_shapes, measure_prefill
    from pkv.core.model_loader.loader import open_model

    cfg = open_model(str(tiny_llama_dir)).config
    roof = measure_prefill(cfg, [40, 25], chunk=32, repeat=1)
    per_row = sum(2.0 * s.in_features * s.out_features * s.count
                  for s in gemm_shapes(cfg) if s.name != "lm_head")
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    assert attention_flops(cfg, 3) == 4.0 * cfg.head_dim * cfg.num_attention_heads * 6 * \
        cfg.num_hidden_layers  # 1 + 2 + 3 keys seen
    expected = 65 * per_row + attention_flops(cfg, 40) + attention_flops(cfg, 25) + 2 * head
    assert roof.flops == pytest.approx(expected) and roof.tokens == 65
    assert roof.tokens_per_s > 0


def test_bench_spec_compares_with_and_without_speculation(tmp_path: Path, tiny_llama_dir: Path):
    out = tmp_path / "spec.json"
    result = _bench("spec", str(tiny_llama_dir), "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                    "--workload", "repeat,synthetic", "--batch", "1", "--num-prompts", "2",
                    "--output-len", "12", "--kv-cache-memory", "16MiB", "--json", str(out))
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["workload"] for r in runs] == ["repeat", "synthetic"]
    for run in runs:
        assert run["identical_outputs"] == run["num_requests"] == 2  # greedy: same texts
        assert run["speedup"] > 0
    assert any(r["speculative"]["spec_acceptance_rate"] is not None for r in runs)
    bad = _bench("spec", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}')
    assert bad.exit_code != 0 and "method must be one of" in bad.output
    assert "Traceback" not in bad.output
    bad = _bench("spec", "--shared-prefix-len", "-1")
    assert bad.exit_code != 0 and "--shared-prefix-len must be >= 0" in bad.output


def test_bench_spec_prompts_share_a_prefix(tmp_path: Path, tiny_llama_dir: Path):
    """A draft model on prompts that share a cached prefix: the same texts with and without
    speculation."""
    out = tmp_path / "spec.json"
    result = _bench("spec", str(tiny_llama_dir), "--speculative-config",
                    f'{{"model": "{tiny_llama_dir}", "num_speculative_tokens": 2}}',
                    "--workload", "synthetic", "--shared-prefix-len", "64", "--input-len", "4",
                    "--batch", "1", "--num-prompts", "3", "--output-len", "8",
                    "--kv-cache-memory", "16MiB", "--json", str(out))
    assert result.exit_code == 0, result.output
    [run] = json.loads(out.read_text())["runs"]
    assert run["identical_outputs"] == run["num_requests"] == 3
    assert run["plain"]["prefill_tokens"] < 3 * (64 + 4)  # the later ones hit the prefix


def test_bench_lora_measures_adapters_against_the_base(tmp_path: Path, tiny_llama_dir: Path):
    from pkv.tests.helpers import make_lora_adapter

    make_lora_adapter(tiny_llama_dir, tmp_path / "a", 4, ["q_proj", "down_proj"], seed=1)
    make_lora_adapter(tiny_llama_dir, tmp_path / "b", 8, ["v_proj"], seed=2)
    out = tmp_path / "lora.json"
    result = _bench("lora", str(tiny_llama_dir), "--lora-modules", f"a={tmp_path / 'a'}",
                    "--lora-modules", f"b={tmp_path / 'b'}", "--batch", "1,2",
                    "--num-prompts", "4", "--output-len", "4", "--rounds", "1",
                    "--kv-cache-memory", "16MiB", "--json", str(out))
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [(r["batch"], r["adapters_in_batch"]) for r in runs] == [(1, 1), (2, 2)]
    assert all(r["ratio_vs_base"] > 0 and r["with_adapters"]["output_throughput"] > 0
               for r in runs)
    assert "memory per loaded adapter" in result.output
    mixed = _bench(str(tiny_llama_dir), "--lora-modules", f"a={tmp_path / 'a'}",
                   "--lora-modules", f"b={tmp_path / 'b'}", "--lora-mix", "--batch", "2",
                   "--num-prompts", "4", "--input-len", "5", "--output-len", "3",
                   "--warmup", "1", "--kv-cache-memory", "16MiB")
    assert mixed.exit_code == 0, mixed.output


def test_bench_compare_reports_each_rounds_ratio(tmp_path: Path, tiny_llama_dir: Path,
                                                 tiny_qwen2_dir: Path):
    out = tmp_path / "compare.json"
    result = _bench("compare", str(tiny_qwen2_dir), "--baseline-model", str(tiny_llama_dir),
                    "--batch", "1,2", "--num-prompts", "2", "--output-len", "4",
                    "--rounds", "3", "--kv-cache-memory", "16MiB", "--json", str(out))
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["cpu"] and report["baseline"] != report["candidate"]
    assert [r["batch"] for r in report["runs"]] == [1, 2]
    for run in report["runs"]:
        a, b = run["baseline_output_throughput"], run["candidate_output_throughput"]
        assert len(a) == len(b) == 3 and min(a + b) > 0
        assert run["ratios"] == pytest.approx([y / x for x, y in zip(a, b)])
        assert run["median_ratio"] == pytest.approx(sorted(run["ratios"])[1])
    assert "B / A (median)" in result.output


def test_bench_compare_bad_input_is_one_line(tmp_path: Path, tiny_llama_dir: Path,
                                             smol_hf_dir: Path):
    from pkv.tests.helpers import build_tiny_model

    wider = build_tiny_model(tmp_path / "wider", smol_hf_dir, "llama", vocab_size=49280)
    cases = [(["--rounds", "0"], "--rounds must be >= 1"),
             (["--baseline-model", str(wider)], "must share a vocabulary"),
             (["--awq-activations", "int4"], "awq_activations must be one of")]
    for args, message in cases:
        bad = _bench("compare", str(tiny_llama_dir), *args, "--kv-cache-memory", "16MiB")
        assert bad.exit_code != 0 and message in bad.output, bad.output
        assert "Traceback" not in bad.output


def test_attention_bench_times_every_usable_backend():
    result = _bench("attention", "--batch", "3", "--context", "40", "--layers", "2",
                    "--repeat", "1", "--kv-cache-dtype", "float32,int8")
    assert result.exit_code == 0, result.output
    # (backend, KV dtype) -> (ms per step, vs torch, vs float32 KV); a tiny step may print 0.0
    rows = {(cells[0], cells[1]): (float(cells[2]), cells[3], cells[4])
            for line in result.output.splitlines()
            if len(cells := [c.strip() for c in line.strip("│").split("│")]) == 5
            and cells[2].replace(".", "", 1).isdigit()}
    assert {(b, kv) for b in ("cpu", "torch") for kv in ("float32", "int8")} <= rows.keys()
    assert rows["torch", "int8"][1] == rows["torch", "float32"][1] == "1.00x faster"
    assert rows["cpu", "float32"][2] == "1.00x faster"
    assert all(ms >= 0 for ms, _, _ in rows.values())
    assert all(re.fullmatch(r"\d+\.\d\dx faster", r) for _, *ratios in rows.values()
               for r in ratios)
    for args, says in ((["--layers", "0"], "every size must be >= 1"),
                       (["--block-size", "0"], "every size must be >= 1"),
                       (["--heads", "4", "--kv-heads", "3"], "must be a multiple of --kv-heads"),
                       (["--sliding-window", "0"], "--sliding-window must be >= 1")):
        bad = _bench("attention", *args)
        assert bad.exit_code == 2 and says in bad.output and "Traceback" not in bad.output


def test_baseline_figures_compare_like_with_like():
    # llama-batched-bench runs one prompt length, none shared: other workloads are refused
    for flags in (["--workload", "repeat"], ["--shared-prefix-len", "8"],
                  ["--long-prompt-len", "64"]):
        result = _bench("run", "--baseline", "llama.cpp", *flags)
        assert result.exit_code == 2 and "--baseline llama.cpp runs" in result.output, flags
    # an even count of rounds: the table's median is the round quoted, not an average
    from pkv.cli.bench.compare import median_round
    from pkv.cli.bench.report import lower_median, rounds_table
    from pkv.cli.bench.workload import BenchResult

    def result(name: str, tps: float) -> BenchResult:
        return BenchResult(name, 1, 1, 1.0, 1, int(tps))

    pairs = [(result("pkv", 120), result("llama.cpp", 100)),
             (result("pkv", 100), result("llama.cpp", 100))]
    mine, other = median_round(pairs)
    assert mine.output_tps / other.output_tps == lower_median([1.2, 1.0]) == 1.0
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(rounds_table(1, pairs))
    assert "1.00x" in console.export_text().splitlines()[-2]  # the median row
    assert "step ms" not in result("llama.cpp", 1).as_json() or \
        result("llama.cpp", 1).as_json()["mean_step_ms"] is None  # (no steps counted)
    window = _bench("window", "--output-len", "4", "--every", "4")
    assert window.exit_code == 2 and "output_len > every" in window.output
