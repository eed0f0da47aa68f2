"""`pkv bench`: every benchmark of the command line.

    app.py        the Typer app: `pkv bench [MODEL]` means `pkv bench run`; the subcommands
    commands/     one module per subcommand: its options, input checks and printing; each
                  imports the machinery below only when it runs, so `pkv --help` stays light

The machinery, one module per subcommand:

    workload.py   run (offline): the prompts, one engine's run of them (run_pkv: spec, lora,
                  compare and families time with it too) and the baselines' (transformers,
                  an OpenAI-compatible server)
    spec.py       spec: with and without speculative decoding, back to back
    lora.py       lora: multi-LoRA against the base model, memory per adapter
    compare.py    compare: two models on the same prompts, round after round
    moe.py        moe: one sparse MoE layer against a dense MLP of the same active size
    kernels.py    kernels: the 4-bit AWQ layer and int8 LM head against float32, per ISA
    guided.py     guided: structured outputs per guided decoding backend
    serve.py      serve: streaming requests against a running server, percentiles, goodput
    families.py   families: decode speed of every model family at one shape
    window.py     window: KV blocks held over time, with a sliding window and without
    soak.py       soak: a server at capacity under a hostile mix (soak_memory.py: the curve)
    burst.py      burst: every client at once against a server with small limits
    tools.py      tools: forced tool calls checked against their schemas
    (attention has no machinery of its own: the backends' layouts are the plugins')

Shared: console.py (where commands print; comma-separated sizes), cpu_info.py (the CPU line
printed beside every figure), engines.py (LoRA options, warm-up, which decoder path ran),
report.py (tables, JSON, plots), roofline.py (`run --roofline`), timing.py (interleaved
medians of the micro-benchmarks).

Nothing is imported here: importing one module (a test of the soak's memory curve, say) does
not import every command.
"""
