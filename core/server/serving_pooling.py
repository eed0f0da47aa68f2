"""The pooling endpoints: `POST /v1/embeddings` (OpenAI), `POST /v1/rerank` (Jina / Cohere),
`POST /score` and `POST /classify` (vLLM).

Every input is one engine request (PoolingParams), all of a body's inputs queued at once so
that the scheduler packs them into as few steps as the token budget allows. A cross-encoder
(task=classify) reads each (query, document) pair whole; an embedding model scores a pair
by the cosine of the two embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any

import numpy as np
import orjson
from fastapi import Request

from pkv.core.engine.input_processor import ContextLengthError, PreparedRequest
from pkv.core.engine.outputs import PoolingRequestOutput
from pkv.core.lora.adapter import LoRARequest
from pkv.core.pooling.params import PoolingParams
from pkv.core.pooling.scoring import cosine, score_pairs
from pkv.core.server.errors import OpenAIError
from pkv.core.server.middleware import request_tenant
from pkv.core.server.protocol import (ClassificationRequest, EmbeddingRequest, RerankRequest,
                                      ScoreRequest)
from pkv.core.server.serving_engine import OpenAIServing

PoolingInput = str | list[int] | tuple[str, str]


class OpenAIServingPooling(OpenAIServing):
    """Embeddings, rerank and score on a pooling model (pkv serve --task embed / classify)."""

    async def embeddings(self, body: EmbeddingRequest, raw: Request) -> dict[str, Any]:
        """The OpenAI body; float vectors as float32 arrays, for `json_body` to write."""
        lora = self._check_model(body.model, "embed")
        params = _params(dimensions=body.dimensions, normalize=body.normalize,
                         truncate_prompt_tokens=body.truncate_prompt_tokens)
        inputs = _inputs(body.input)
        if not body.add_special_tokens:  # texts as ids without them (ids stay as sent)
            encode = self.llm.engine.tokenizer.encode
            inputs = await asyncio.to_thread(
                lambda: [encode(t, add_special_tokens=False) if isinstance(t, str) and t else t
                         for t in inputs])
        finals = await self._run(inputs, params, "input", raw, lora)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode(f.outputs.data, body.encoding_format)}
                for i, f in enumerate(finals)]
        return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.served_name(body.model), "data": data, "usage": _usage(finals)}

    async def classify(self, body: ClassificationRequest, raw: Request) -> dict[str, Any]:
        """vLLM's body: each input's scores per label (the classifier's activation applied)
        and the label that scores highest."""
        lora = self._check_model(body.model, "classify")
        params = _params(truncate_prompt_tokens=body.truncate_prompt_tokens)
        finals = await self._run(_inputs(body.input), params, "input", raw, lora)
        names = self.llm.engine.model_config.hf.get("id2label") or {}
        data = []
        for i, final in enumerate(finals):
            probs = final.outputs.probs
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": names.get(str(best), f"LABEL_{best}"),
                         "probs": probs, "num_classes": len(probs)})
        return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": self.served_name(body.model),
                "data": data, "usage": _usage(finals)}

    async def rerank(self, body: RerankRequest, raw: Request) -> dict[str, Any]:
        lora = self._check_model(body.model, None)
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        if not documents:
            raise OpenAIError(400, "documents must not be empty", "documents")
        if body.top_n is not None and body.top_n < 0:
            raise OpenAIError(400, "top_n must be >= 0 (0 or none: every document)", "top_n")
        scores, finals = await self._scores(
            [(body.query, d) for d in documents],
            [("query", f"documents[{i}]") for i in range(len(documents))], "documents", raw,
            lora, _params(truncate_prompt_tokens=body.truncate_prompt_tokens))
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[:body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": documents[i]}} if body.return_documents else {})}
                   for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": self.served_name(body.model),
                "usage": {"total_tokens": _usage(finals)["total_tokens"]}, "results": results}

    async def score(self, body: ScoreRequest, raw: Request) -> dict[str, Any]:
        lora = self._check_model(body.model, None)
        try:
            pairs = score_pairs(body.text_1, body.text_2)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "text_2" if "text_2" in str(exc) else "text_1"
                              ) from None
        truncate = _params(truncate_prompt_tokens=body.truncate_prompt_tokens)
        scores, finals = await self._scores(pairs, _score_names(body.text_1, body.text_2),
                                            "text_2", raw, lora, truncate)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                "model": self.served_name(body.model), "data": data, "usage": _usage(finals)}

    # --- shared ---------------------------------------------------------------------------

    def _check_model(self, model: str | None, task: str | None) -> LoRARequest | None:
        """The adapter `model` names (None: the base model); 404 for a name nobody serves,
        400 where this model cannot serve the endpoint (`task`: the one it needs; None:
        embed or classify)."""
        lora = self._lora_request(model)
        served = self.llm.engine.task
        if served == "generate" or (task is not None and served != task):
            needs = {"embed": "an embedding model (--task embed)", None: "a pooling model",
                     "classify": "a sequence classifier (--task classify)"}[task]
            raise OpenAIError(400, f"this endpoint needs {needs}; {self.model_name!r} serves "
                              f"task={served}", "model")
        return lora

    async def _scores(self, pairs: list[tuple[str, str]], names: list[tuple[str, str]],
                      param: str, raw: Request, lora: LoRARequest | None,
                      params: PoolingParams) -> tuple[list[float], list[PoolingRequestOutput]]:
        """Each pair's score: a cross-encoder's, or the cosine of the texts' embeddings.
        `names` holds each pair's two fields, for errors."""
        if self.llm.engine.task == "classify":
            finals = await self._run(list(pairs), params, param, raw, lora, list(names))
            return [_one_score(f) for f in finals], finals
        named: dict[str, str] = {}  # each text once, named by the first field it is in
        for pair, pair_names in zip(pairs, names):
            for text, name in zip(pair, pair_names):
                named.setdefault(text, name)
        texts = sorted(named)
        finals = await self._run(list(texts), params, param, raw, lora,
                                 [named[t] for t in texts])
        vectors = {t: f.outputs.data for t, f in zip(texts, finals)}
        return [cosine(vectors[a], vectors[b]) for a, b in pairs], finals

    async def _run(self, inputs: list[PoolingInput], params: PoolingParams, param: str,
                   raw: Request, lora: LoRARequest | None,
                   names: list[str] | list[tuple[str, str]] | None = None
                   ) -> list[PoolingRequestOutput]:
        """Every input as one engine request. For errors: `param` is the field that holds
        them all, `names` each one's field (a pair's two; default `param[i]`)."""
        if not inputs:
            raise OpenAIError(400, f"{param} must not be empty", param)
        if len(inputs) > self.limits.max_pooling_inputs:
            raise OpenAIError(400, f"at most {self.limits.max_pooling_inputs} inputs per "
                              "request", param)
        base_id = f"pool-{uuid.uuid4().hex}"
        # Tenants (API keys) never share prefix-cache blocks (a decoder pooling its last
        # token takes hits): their name salts every hash, as for generation.
        tenant = request_tenant(raw.scope)
        salt = None if tenant is None else f"{tenant}:"
        names = names or [f"{param}[{i}]" for i in range(len(inputs))]
        prepared = await asyncio.to_thread(self._prepare_all, base_id, inputs, params, param,
                                           names, lora, salt)
        return await self.collect_all(self.llm.submit(prepared), raw)

    def _prepare_all(self, base_id: str, inputs: list[PoolingInput], params: PoolingParams,
                     param: str, names: list[str] | list[tuple[str, str]],
                     lora: LoRARequest | None, salt: str | None) -> list[PreparedRequest]:
        engine = self.llm.engine
        prepared = []
        for i, item in enumerate(inputs):
            try:
                prepared.append(engine.prepare_request(f"{base_id}-{i}", item, params, salt,
                                                       lora_request=lora))
            except ContextLengthError as exc:
                name = names[i]
                if isinstance(name, tuple):  # a pair: blame its query if that alone is long
                    name = name[0] if self._too_long(item[0], params, lora) else name[1]
                raise OpenAIError(400, f"{name}: {exc}", _field(name),
                                  "context_length_exceeded") from None
            except ValueError as exc:
                field = next((f for f in ("dimensions", "truncate_prompt_tokens")
                              if str(exc).startswith(f)), None)
                if field is None and isinstance(names[i], str):  # this input's own fault
                    raise OpenAIError(400, f"{names[i]}: {exc}", _field(names[i])) from None
                raise OpenAIError(400, str(exc), field or param) from None
        return prepared

    def _too_long(self, text: PoolingInput, params: PoolingParams,
                  lora: LoRARequest | None) -> bool:
        try:
            self.llm.engine.prepare_request("pool-length", text, params, lora_request=lora)
        except ContextLengthError:
            return True
        return False


def _params(**fields: Any) -> PoolingParams:
    try:
        return PoolingParams(**fields)
    except ValueError as exc:  # the message opens with the field's name
        raise OpenAIError(400, str(exc), str(exc).split(" ", 1)[0]) from None


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[PoolingInput]:
    """One text, texts, one prompt's token ids, or several prompts' ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


def _field(name: str) -> str:
    """The request field an input's name is in: `documents` of `documents[3]`."""
    return name.split("[", 1)[0]


def _score_names(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """Each /score pair's two fields (score_pairs' 1 x N or N x N)."""
    second = ["text_2"] if isinstance(text_2, str) else \
        [f"text_2[{i}]" for i in range(len(text_2))]
    first = ["text_1"] if isinstance(text_1, str) else \
        [f"text_1[{i}]" for i in range(len(text_1))]
    return list(zip(first * len(second) if len(first) == 1 else first, second))


def _encode(vector: Any, encoding_format: str) -> np.ndarray | str:
    """base64 of little-endian float32 (as OpenAI sends it), or the float32 array itself,
    which `json_body` writes as JSON numbers."""
    values = vector.numpy().astype("<f4")
    if encoding_format == "base64":
        return base64.b64encode(values.tobytes()).decode()
    return values


def json_body(payload: dict[str, Any]) -> bytes:
    """`payload` as JSON, its float32 arrays as each value's shortest digits that read back
    as the same float32 (orjson). Python's json writes 64 x 384 floats in ~7 ms (a float's
    repr each); orjson in ~0.5 ms, and a third fewer bytes than a float64's 17 digits."""
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _one_score(final: PoolingRequestOutput) -> float:
    data = final.outputs.data
    if data.numel() != 1:
        raise OpenAIError(400, f"this classifier has {data.numel()} labels; rerank and score "
                          "need one relevance score per pair", "model")
    return float(data.item())


def _usage(finals: list[PoolingRequestOutput]) -> dict[str, int]:
    tokens = sum(len(f.prompt_token_ids) for f in finals)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
