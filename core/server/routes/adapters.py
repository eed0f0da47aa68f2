"""LoRA adapters at runtime (vLLM's bodies), behind `--enable-runtime-lora`: loads and unloads
run on the engine thread, between steps."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from pkv.core.engine.async_engine import AsyncLLM
from pkv.core.server.errors import OpenAIError
from pkv.core.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


def check_lora_dir(path: str, lora_dir: str | None) -> None:
    """With `lora_dir` set, adapters load only from under it (links resolved first)."""
    if lora_dir is None:
        return
    root = Path(lora_dir).expanduser().resolve()
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_relative_to(root):
        raise ValueError(f"lora_path {path} is outside the allowed --lora-dir {root}")
    if not resolved.exists():  # (else an `org/name` would go on to the Hugging Face Hub)
        raise ValueError(f"lora_path {path} is not in --lora-dir {root}: with --lora-dir, "
                         "adapters load from that folder only")


def add_routes(app: FastAPI, async_llm: AsyncLLM, served_model_name: str, enabled: bool,
               lora_dir: str | None) -> None:
    """`enabled`: --enable-runtime-lora (the engine must have LoRA on too)."""
    def check_enabled() -> None:
        if not enabled or async_llm.engine.lora is None:
            raise OpenAIError(400, "loading LoRA adapters at runtime is off: start pkv serve "
                              "with --enable-lora --enable-runtime-lora", "lora_name")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        check_enabled()
        if body.lora_name == served_model_name:
            raise OpenAIError(400, "lora_name must differ from the base model's name",
                              "lora_name")
        try:
            check_lora_dir(body.lora_path, lora_dir)
            # On the engine thread, between steps: a worker thread of its own would start an
            # OpenMP pool of its own, and the engine's steps slow down (engine_thread.py).
            await async_llm.call_in_engine(lambda e: e.add_lora(body.lora_name, body.lora_path))
        except ValueError as exc:
            param = "lora_name" if "already loaded" in str(exc) else "lora_path"
            raise OpenAIError(400, str(exc), param) from None
        return PlainTextResponse(f"loaded LoRA adapter {body.lora_name}")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        check_enabled()
        try:  # on the engine thread, as loads: requests resolve adapters there
            await async_llm.call_in_engine(lambda e: e.remove_lora(body.lora_name))
        except ValueError as exc:
            raise OpenAIError(404, str(exc), "lora_name", "model_not_found") from None
        return PlainTextResponse(f"unloaded LoRA adapter {body.lora_name}")

