"""`pkv bench [run]`: offline throughput of pkv on one workload over a sweep of batch sizes.

Baselines (transformers, an OpenAI-compatible server, llama.cpp's llama-batched-bench) run
back to back with pkv, `--rounds` times alternately, so ratios survive a noisy machine. The
prompts and each engine's run of them: pkv.cli.bench.workload; the tables:
pkv.cli.bench.report.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from pkv.cli.bench.console import console, int_list
from pkv.cli.bench.engines import add_adapters, decoder_path, lora_options
from pkv.cli.errors import output_file, user_errors
from pkv.cli.http import auth_headers, base_url


def run(
    model: Annotated[Optional[str], typer.Argument(help="HF folder, .gguf or Hub id (ORG/NAME); default: bundled")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit of a Hub id.")] = None,
    gguf_file: Annotated[Optional[str], typer.Option(help="The .gguf to load from a Hub id or folder.")] = None,
    batch: Annotated[str, typer.Option(help="Concurrent sequences; a list (1,16,64) sweeps.")] = "256",
    num_prompts: Annotated[Optional[int], typer.Option(min=1, help="Requests (default 2 x batch).")] = None,
    input_len: Annotated[int, typer.Option(help="Prompt tokens (synthetic prompts).")] = 32,
    output_len: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    temperature: Annotated[float, typer.Option(help="Every request's sampling temperature (0: greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Every request's top-p (1: off).")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Every request's top-k (0: off).")] = 0,
    shared_prefix_len: Annotated[int, typer.Option(help="Tokens all synthetic prompts share first.")] = 0,
    long_prompt_len: Annotated[int, typer.Option(help="Add one prompt this long once decoding runs (0: none).")] = 0,
    dataset: Annotated[Optional[Path], typer.Option(dir_okay=False, help="JSONL file of prompts.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for synthetic prompts.")] = 0,
    warmup: Annotated[int, typer.Option(min=0, help="Warm-up requests before timing.")] = 4,
    baseline: Annotated[Optional[str], typer.Option(help="Also run: hf, openai or llama.cpp (a GGUF).")] = None,
    llama_cpp: Annotated[Optional[str], typer.Option(help="Folder of a llama.cpp build's llama-batched-bench (default: PATH).")] = None,
    baseline_batch: Annotated[int, typer.Option(help="Static batch of the hf baseline.")] = 16,
    url: Annotated[Optional[str], typer.Option(help="Server for --baseline openai.")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="PKV_API_KEY", help="Key for --url.")] = None,
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16, float16.")] = "auto",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    kv_cache_memory: Annotated[Optional[str], typer.Option(help="KV pool size, e.g. 2GiB.")] = None,
    kv_cache_dtype: Annotated[str, typer.Option(help="KV cache storage: auto, float32, bfloat16, float16, int8, fp8_e4m3.")] = "auto",
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(help="Token budget per step.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Longest sequence.")] = None,
    enable_prefix_caching: Annotated[bool, typer.Option(help="Prefix caching.")] = True,
    attention_backend: Annotated[str, typer.Option(help="auto or a name from `pkv plugins`.")] = "auto",
    quantization: Annotated[str, typer.Option(help="auto, none, awq, fp8, gguf.")] = "auto",
    lm_head_quantization: Annotated[str, typer.Option(help="auto, none, int8.")] = "auto",
    awq_activations: Annotated[str, typer.Option(help="AWQ / GGUF decode activations: float32, int16 or int8.")] = "float32",
    tensor_parallel_size: Annotated[int, typer.Option(help="Ranks to split the model over.")] = 1,
    pipeline_parallel_size: Annotated[int, typer.Option(help="Pipeline stages (ranks holding a run of layers each).")] = 1,
    pp_layer_partition: Annotated[Optional[str], typer.Option(help="Layers per pipeline stage, e.g. 10,20.")] = None,
    speculative_config: Annotated[Optional[str], typer.Option(help='Speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4}.')] = None,
    workload: Annotated[str, typer.Option(help="synthetic (random-token prompts) or repeat (copy a ~300-token passage: where prompt lookup shines).")] = "synthetic",
    lora_modules: Annotated[Optional[list[str]], typer.Option(help="NAME=PATH of a LoRA adapter (repeat the flag); requests use the first, or all with --lora-mix.")] = None,
    lora_mix: Annotated[bool, typer.Option(help="Spread requests evenly over the --lora-modules adapters.")] = False,
    profile: Annotated[bool, typer.Option(help="Time each phase of every step (overhead vs forward).")] = False,
    roofline: Annotated[bool, typer.Option(help="Also measure the float32 GEMM roofline of a step.")] = False,
    rounds: Annotated[int, typer.Option(help="Runs of pkv and the baseline, alternating, per batch size: each round's ratio and their median.")] = 1,
    json_path: Annotated[Optional[Path], typer.Option("--json", dir_okay=False, callback=output_file, help="Write every figure here.")] = None,
    plot: Annotated[Optional[Path], typer.Option(dir_okay=False, callback=output_file, help="PNG of throughput/latency over a sweep.")] = None,
) -> None:
    """Offline throughput of pkv on one workload, with an optional baseline, same process."""
    from pkv.cli.bench.workload import WORKLOADS

    with user_errors():
        batches = int_list(batch, "--batch")
        if baseline not in (None, "hf", "openai", "llama.cpp"):
            raise ValueError(f"--baseline must be hf, openai or llama.cpp, got {baseline!r}")
        if baseline == "openai" and not url:
            raise ValueError("--baseline openai needs --url")
        if input_len < 1 or output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if shared_prefix_len < 0 or long_prompt_len < 0:
            raise ValueError("--shared-prefix-len and --long-prompt-len must be >= 0")
        if rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {rounds}")
        if workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
        # llama-batched-bench runs prompts of one length, none shared: another workload's
        # ratio would compare two different runs
        shaped = [flag for flag, on in (("--workload repeat", workload != "synthetic"),
                                        ("--dataset", dataset is not None),
                                        ("--shared-prefix-len", shared_prefix_len > 0),
                                        ("--long-prompt-len", long_prompt_len > 0)) if on]
        if baseline == "llama.cpp" and shaped:
            raise ValueError(f"--baseline llama.cpp runs --input-len-token prompts, none "
                             f"shared; not with {', '.join(shaped)}")
        sampling = sampling_options(temperature, top_p, top_k)
        _run_offline(locals() | {"batches": batches, "sampling": sampling})


def sampling_line(sampling: dict[str, float]) -> str:
    """How the requests pick their tokens, for the batch line."""
    if sampling["temperature"] == 0:
        return "greedy"
    return "sampled at temperature {temperature:g}, top-p {top_p:g}, top-k {top_k}".format(
        **sampling)


def sampling_options(temperature: float, top_p: float, top_k: int) -> dict[str, float]:
    """The requests' sampling settings, checked as a request's would be (ValueError)."""
    from pkv.core.sample.sampling_params import SamplingParams

    options = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    try:
        SamplingParams(**options)
    except ValueError as exc:
        raise ValueError(f"--temperature / --top-p / --top-k: {exc}") from None
    return options


def _run_offline(o: dict[str, Any]) -> None:
    import resource

    import psutil

    from pkv.cli.bench import report
    from pkv.cli.bench import workload as off
    from pkv.cli.bench.compare import alternate, median_round
    from pkv.cli.bench.serve import check_server
    from pkv.core.config.engine import EngineConfig
    from pkv.core.engine.llm_engine import LLMEngine
    from pkv.core.sample.sampling_params import SamplingParams

    headers = auth_headers(o["api_key"])
    url = base_url(o["url"]) if o["url"] else ""
    remote_model = check_server(url, headers) if o["baseline"] == "openai" else None
    llama_cpp = None
    if o["baseline"] == "llama.cpp":  # found before the model loads
        from pkv.cli.bench import llama_cpp as lcpp

        llama_cpp = (lcpp.find_batched_bench(o["llama_cpp"]), _gguf_path(o))
    engine = LLMEngine(EngineConfig(
        model=o["model"], revision=o["revision"], gguf_file=o["gguf_file"], dtype=o["dtype"],
        block_size=o["block_size"],
        kv_cache_memory=o["kv_cache_memory"], kv_cache_dtype=o["kv_cache_dtype"],
        max_num_seqs=max(o["batches"]),
        max_num_batched_tokens=o["max_num_batched_tokens"], max_model_len=o["max_model_len"],
        seed=o["seed"], enable_prefix_caching=o["enable_prefix_caching"],
        attention_backend=o["attention_backend"], quantization=o["quantization"],
        lm_head_quantization=o["lm_head_quantization"], awq_activations=o["awq_activations"],
        tensor_parallel_size=o["tensor_parallel_size"],
        pipeline_parallel_size=o["pipeline_parallel_size"],
        pp_layer_partition=o["pp_layer_partition"],
        speculative_config=o["speculative_config"], **lora_options(o["lora_modules"])))
    lora_requests = add_adapters(engine, o["lora_modules"])
    if not o["lora_mix"]:
        lora_requests = lora_requests[:1]
    tok = engine.tokenizer
    vocab_ids = [i for i in range(tok.vocab_size) if i not in tok.special_token_ids]
    for prompt in off.make_prompts(vocab_ids, o["warmup"], 8, o["seed"] + 1, None, tok.encode):
        engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=4))
    engine.generate_until_done()
    hf_model = None
    if o["baseline"] == "hf":
        from pkv.core.model_loader.hub import resolve_model
        from pkv.core.model_loader.loader import bundled_model_path

        with console.status("loading the model in transformers"):
            path = (resolve_model(o["model"], o["revision"], o["gguf_file"]) if o["model"]
                    else bundled_model_path())
            hf_model = off.load_hf_model(path, engine.runner.dtype)
    rooflines, peak = {}, None
    if o["roofline"]:
        from pkv.cli.bench.roofline import fma_peak_gflops, measure, measure_prefill

        rooflines = measure(engine.model_config, o["batches"])
        peak = fma_peak_gflops()
    from pkv.cli.bench.cpu_info import print_cpu_line

    print_cpu_line(console)
    runs = []
    for b in o["batches"]:
        prompts = off.workload_prompts(engine, o["workload"], o["num_prompts"] or 2 * b, o)
        long_prompt = (off.make_prompts(vocab_ids, 1, o["long_prompt_len"], o["seed"] + 2, None,
                                        tok.encode)[0] if o["long_prompt_len"] else None)
        console.print(f"[bold]batch {b}[/]: {len(prompts)} prompts, ~{o['input_len']} tokens "
                      f"in, {o['output_len']} out, {sampling_line(o['sampling'])}, "
                      f"{engine.runner.dtype}, attention "
                      f"{engine.attention_backend}, {engine.runner.num_blocks} KV blocks "
                      f"({engine.runner.kv_format.name}), "
                      f"weights {engine.quantization or 'float'} "
                      f"{engine.runner.weight_bytes / 2**20:.0f} MiB ({weight_types(engine)}), "
                      f"process RSS "
                      f"{psutil.Process().memory_info().rss / 2**20:.0f} MiB, peak "
                      f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB "
                      f"(loading included)")
        loras = ([lora_requests[i % len(lora_requests)] for i in range(len(prompts))]
                 if lora_requests else None)
        def ours() -> Any:
            return off.run_pkv(engine, prompts, o["output_len"], b, long_prompt, o["profile"],
                               loras, o["sampling"])

        theirs = None
        if hf_model is not None:
            def theirs() -> Any:
                return off.run_hf(hf_model, prompts, o["output_len"], o["baseline_batch"])
        elif remote_model is not None:
            def theirs() -> Any:
                return off.run_openai(url, remote_model, headers, prompts, o["output_len"], b)
        elif llama_cpp is not None:
            kv_type = lcpp.cache_type(engine.runner.kv_format.name)
            console.print(f"llama.cpp: KV cache {kv_type} (pkv's: "
                          f"{engine.runner.kv_format.name})")

            def theirs() -> Any:
                with console.status(f"llama.cpp, batch {b}, KV cache {kv_type}"):
                    # (as many sequences at once as pkv's: fewer prompts than the batch)
                    return lcpp.run_batched_bench(*llama_cpp, min(b, len(prompts)),
                                                  o["input_len"], o["output_len"],
                                                  engine_threads(engine), kv_type)
        pairs = alternate(ours, theirs, o["rounds"])
        if len(pairs) > 1:
            console.print(report.rounds_table(b, pairs))
        result, other = median_round(pairs)
        if hf_model is not None:  # one process holds both models: neither's RSS is its own
            result.peak_rss_bytes = other.peak_rss_bytes = 0
        if b in rooflines:
            result.roofline_tps = rooflines[b].tokens_per_s
            result.roofline_gflops = rooflines[b].gflops_per_s
            result.fma_peak_gflops = peak
            chunk = engine.max_num_batched_tokens
            result.prefill_roofline_tps = measure_prefill(
                engine.model_config, [len(p) for p in prompts], chunk).tokens_per_s
        runs.append((result, other))
        console.print(report.offline_table([result] + ([other] if other else [])))
        if result.spec_acceptance_rate is not None:
            console.print(f"speculation: {result.spec_acceptance_rate:.1%} of drafts accepted, "
                          f"{result.spec_mean_accepted_len:.2f} tokens per verify")
        if other is not None:
            console.print(f"[bold]pkv / {other.name}: {result.output_tps / other.output_tps:.2f}x"
                          "[/] output tokens/s")
    if len(runs) > 1:
        console.print(report.offline_table([r for run in runs for r in run if r is not None]))
    if o["profile"]:
        console.print(report.profile_table([r for r, _ in runs]))
        console.print(f"decoder path: {decoder_path(engine)}")
    if rooflines:
        console.print(report.roofline_table([r for r, _ in runs]))
        console.print(report.prefill_roofline_table([r for r, _ in runs]))
    if engine.workers is not None:
        ranks = [os.getpid(), *engine.workers.pids]
        whole = sum(engine.runner.rank_weight_bytes)
        console.print("per-rank weights and peak RSS: " + ", ".join(
            f"rank {i} {w / 2**20:.0f} MiB of weights ({w / whole:.2f}x the sum), peak RSS "
            f"{off.peak_rss(pid) / 2**20:.0f} MiB"
            for i, (pid, w) in enumerate(zip(ranks, engine.runner.rank_weight_bytes))))
        engine.shutdown()
    if o["json_path"]:
        report.write_json(o["json_path"], report.offline_json(runs), console)
    if o["plot"]:
        series = {"pkv": [r.output_tps for r, _ in runs]}
        latency = {"pkv": [1000 * r.elapsed_s / max(r.num_steps, 1) for r, _ in runs]}
        if all(other is not None for _, other in runs):
            series[runs[0][1].name] = [other.output_tps for _, other in runs]
        report.plot_sweep(o["plot"], o["batches"], series, "mean step time (ms)", latency,
                          "batch (concurrent sequences)", console)


def weight_types(engine: Any) -> str:
    """The weights' MiB by storage type: "Q5_0 290, Q8_0 130, float32 1"."""
    return ", ".join(f"{name} {size / 2**20:.0f}"
                     for name, size in engine.runner.weight_bytes_by_type.items())


def _gguf_path(o: dict[str, Any]) -> Path:
    """The GGUF the benchmark runs (the bundled one by default), for llama.cpp to run too."""
    from pkv.core.model_loader.hub import resolve_model
    from pkv.core.model_loader.loader import bundled_model_path

    path = (resolve_model(o["model"], o["revision"], o["gguf_file"]) if o["model"]
            else bundled_model_path())
    if path.suffix != ".gguf":
        raise ValueError(f"--baseline llama.cpp runs GGUF files; {path} is not one")
    return path


def engine_threads(engine: Any) -> int:
    """The threads pkv computes with: the driver's, or under tensor or pipeline parallelism
    all its ranks' (each takes a share of the cores), as a baseline's -t should be."""
    import torch

    workers = engine.workers
    return workers.threads_before if workers is not None else torch.get_num_threads()
