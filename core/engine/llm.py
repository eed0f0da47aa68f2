"""LLM: the offline API (vLLM's names). Generate for many prompts at once, batched."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypedDict

import torch

from pkv.core.config.engine import EngineConfig
from pkv.core.engine.llm_engine import LLMEngine
from pkv.core.engine.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pkv.core.lora.adapter import LoRARequest
from pkv.core.pooling.params import PoolingParams
from pkv.core.pooling.scoring import cosine, score_pairs
from pkv.core.progress import make_progress
from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.tokenizer.chat_messages import (check_template_kwargs, message_problem,
                                               template_message)


class _Salted(TypedDict, total=False):
    cache_salt: str  # keeps this prompt's prefix-cache blocks apart from other salts'


class TextPrompt(_Salted):
    """vLLM's text prompt: `{"prompt": "..."}`, optionally with its own `cache_salt`."""

    prompt: str


class TokensPrompt(_Salted):
    """vLLM's token prompt: `{"prompt_token_ids": [...]}`, optionally with a `cache_salt`."""

    prompt_token_ids: list[int]


Prompt = str | list[int] | TextPrompt | TokensPrompt
Conversation = list[dict[str, Any]]

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


def resolve_prompt(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """(text or token ids, cache salt) of a prompt in any of the forms `generate` takes."""
    if isinstance(prompt, (str, list, tuple)):  # (the engine checks text, ids or a pair)
        return prompt, None
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt is a string, a list of token ids or a prompt dict, not "
                         f"{type(prompt).__name__} {str(prompt)[:40]!r}")
    unknown = sorted(set(prompt) - _PROMPT_KEYS)
    if unknown:
        raise ValueError(f"prompt dicts take prompt or prompt_token_ids (and cache_salt); "
                         f"not {', '.join(unknown)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of prompt and prompt_token_ids")
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise ValueError("prompt must be a string (token ids go in prompt_token_ids)")
    body = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if "prompt_token_ids" in prompt and not isinstance(body, list):
        raise ValueError("prompt_token_ids must be a list of token ids")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError("cache_salt must be a string")
    return body, salt


class LLM:
    """Load a model once, then `generate` or `chat` over many prompts with continuous batching.

    >>> llm = LLM()  # the bundled SmolLM2-135M-Instruct
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str | None = None, dtype: str = "auto", block_size: int = 16,
                 kv_cache_memory: int | str | None = None, memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, seed: int = 0, show_progress: bool = True,
                 **kwargs: Any) -> None:
        config = EngineConfig.from_dict(dict(
            model=model, dtype=dtype, block_size=block_size, kv_cache_memory=kv_cache_memory,
            memory_utilization=memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            seed=seed, **kwargs))
        self.show_progress = show_progress
        self.llm_engine = LLMEngine(config, show_progress=show_progress)

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes now (they also stop when the LLM is
        garbage-collected or the interpreter exits)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):  # noqa: ANN201 - returns pkv.core.tokenizer.tokenizer.Tokenizer
        return self.llm_engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or vLLM's `{"prompt": text}` /
        `{"prompt_token_ids": ids}`); outputs come back in prompt order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        prompts = self._as_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = self._params_per_prompt(sampling_params, len(prompts))
        loras = self._per_prompt(lora_request, len(prompts), "LoRA requests")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                body, salt = resolve_prompt(prompt)
                ids.append(engine.add_request(None, body, p, cache_salt=salt, lora_request=lora,
                                              cap_max_tokens=True))
        except Exception:
            engine.abort_request(ids)  # all or nothing: a bad prompt leaves the engine as it was
            raise
        show = self.show_progress if use_tqdm is None else use_tqdm
        finals = self._run(ids, sum(p.n * (p.max_tokens or 0) for p in params), show)
        return [finals[i] for i in ids]  # type: ignore[misc]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Render conversations through the model's chat template (or `chat_template`, a
        Jinja template given instead), then generate (vLLM's arguments): `tools` (OpenAI
        function tools) go to the template as `tools`, `continue_final_message` has the model
        go on writing the last (assistant) message, `chat_template_kwargs` go to the template
        (e.g. Qwen3's `enable_thinking`; its add_generation_prompt and
        continue_final_message win over the arguments, as vLLM merges them). Each output's
        `prompt` is the rendered text. The arguments after `lora_request` are keywords only
        (vLLM's 5th positional argument is another)."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError("chat_template_kwargs must be a dict")
        kwargs = dict(chat_template_kwargs or {})
        add_generation_prompt = kwargs.pop("add_generation_prompt", add_generation_prompt)
        continue_final_message = kwargs.pop("continue_final_message", continue_final_message)
        check_template_kwargs(kwargs)
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError("chat_template must be a Jinja template (a string)")
        tokenizer = self.llm_engine.tokenizer
        kwargs.update({"tools": tools} if tools else {})
        texts = [tokenizer.apply_chat_template(conversation, add_generation_prompt,
                                               continue_final_message, chat_template, **kwargs)
                 for conversation in _conversations(messages)]
        prompts: list[Prompt] = [tokenizer.encode(text, add_special_tokens=False)
                                 for text in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm, lora_request)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), in prompt order; an embedding
        model's (task=embed). `pooling_params`: one for every prompt, or one per prompt.
        `lora_request`: one adapter for every prompt, or one (or None)
        per prompt (a decoder embedding model's). `truncate_prompt_tokens` (vLLM's keyword):
        each prompt's last N tokens, for pooling params that say nothing of it."""
        if self.llm_engine.task == "classify":  # (its score would come back as a "vector")
            raise ValueError("embed needs an embedding model (task=embed); this model is a "
                             "classifier (task=classify): use score or classify")
        bodies = [resolve_prompt(p) for p in self._as_list(prompts)]
        params = self._params_per_prompt(pooling_params, len(bodies), PoolingParams)
        params = [_truncated(p, truncate_prompt_tokens) for p in params]
        loras = self._per_prompt(lora_request, len(bodies), "LoRA requests")
        return self._pool(bodies, params, use_tqdm, loras)

    def classify(self, prompts: Prompt | Sequence[Prompt],
                 use_tqdm: bool | None = None) -> list[PoolingRequestOutput]:
        """A classifier's scores per label (`outputs.probs`) for each prompt."""
        task = self.llm_engine.task
        if task != "classify":  # (an embedding model would hand back its vectors)
            raise ValueError(f"classify needs a classifier (task=classify); this model serves "
                             f"task={task}")
        bodies = [resolve_prompt(p) for p in self._as_list(prompts)]
        return self._pool(bodies, [PoolingParams()] * len(bodies), use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              use_tqdm: bool | None = None, *, pooling_params: PoolingParams | None = None,
              lora_request: LoRARequest | None = None,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """`outputs.score` of each pair: one text_1 against every text_2, or pair by pair.
        A cross-encoder reads each pair whole; an embedding model scores the cosine of the
        two texts' embeddings (each text cut to `truncate_prompt_tokens`, as vLLM's; a pair
        refuses it). `lora_request`: the adapter every pair runs under."""
        pairs = score_pairs(text_1, text_2)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise TypeError(f"score's pooling_params is one PoolingParams for every pair, not "
                            f"{_type_names(pooling_params)}")
        params = _truncated(pooling_params or PoolingParams(), truncate_prompt_tokens)
        if self.llm_engine.task == "classify":
            return self._pool([(pair, None) for pair in pairs], [params] * len(pairs), use_tqdm,
                              [lora_request] * len(pairs))
        texts = sorted({t for pair in pairs for t in pair})
        vectors = dict(zip(texts, self.embed(texts, params, use_tqdm, lora_request)))
        outputs = []
        for i, (a, b) in enumerate(pairs):
            va, vb = vectors[a], vectors[b]
            score = torch.tensor([cosine(va.outputs.data, vb.outputs.data)])
            outputs.append(PoolingRequestOutput(
                str(i), None, va.prompt_token_ids + vb.prompt_token_ids, PoolingOutput(score)))
        return outputs

    def _pool(self, bodies: list[tuple[str | list[int] | tuple[str, str], str | None]],
              params: list[PoolingParams], use_tqdm: bool | None,
              loras: list[LoRARequest | None] | None = None) -> list[PoolingRequestOutput]:
        """Pool each (prompt, cache salt) of `bodies`."""
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for (body, salt), p, lora in zip(bodies, params, loras or [None] * len(bodies)):
                ids.append(engine.add_request(None, body, p, cache_salt=salt, lora_request=lora))
        except Exception:
            engine.abort_request(ids)
            raise
        show = self.show_progress if use_tqdm is None else use_tqdm
        finals = self._run(ids, 0, show)
        return [finals[i] for i in ids]  # type: ignore[misc]

    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if prompts is None or isinstance(prompts, (int, float, bytes, bytearray)):
            raise ValueError(f"prompts are a string, token ids, a prompt dict or a list of "
                             f"them, not {type(prompts).__name__}")
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            return [prompts]  # one prompt given as token ids
        return prompts

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() sample with when given no SamplingParams: the
        model's generation_config.json settings (EngineConfig.generation_config auto), else
        SamplingParams' own defaults (vLLM's method of the same name)."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    @staticmethod
    def _params_per_prompt(params: Any, n: int, kind: type = SamplingParams) -> list[Any]:
        """`params` (a `kind`, or None for its defaults) for each of n prompts, or a list of
        them, one per prompt."""
        if params is None or isinstance(params, kind):
            return [params or kind()] * n
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, kind) for p in params):
            raise TypeError(f"{_snake(kind.__name__)} takes a {kind.__name__} or a list of "
                            f"them, one per prompt, not {_type_names(params)}")
        if len(params) != n:
            raise ValueError(f"got {len(params)} {_snake(kind.__name__)} for {n} prompts")
        return list(params)

    @staticmethod
    def _per_prompt(value: Any, n: int, what: str) -> list[Any]:
        if value is None or not isinstance(value, (list, tuple)):
            return [value] * n
        if len(value) != n:
            raise ValueError(f"got {len(value)} {what} for {n} prompts")
        return list(value)

    def _run(self, ids: list[str], expected_tokens: int, show: bool
             ) -> dict[str, RequestOutput | PoolingRequestOutput]:
        engine = self.llm_engine
        finals: dict[str, RequestOutput | PoolingRequestOutput] = {}
        # (disabled, not only hidden: a hidden bar still draws a blank line per call)
        with make_progress(transient=True, disable=not show) as progress:
            task = progress.add_task("Generating", total=len(ids), info="", visible=show)
            generated = 0
            try:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished:
                            finals[output.request_id] = output
                            progress.advance(task)
                    generated = sum(len(c.token_ids) for o in finals.values()
                                    if isinstance(o, RequestOutput) for c in o.outputs)
                    progress.update(task, info=f"{generated}/{expected_tokens or '?'} tokens")
            except BaseException:  # Ctrl-C or a failed step: the call's requests end with it
                engine.abort_request([i for i in ids if i not in finals])
                raise
        return finals


def _snake(name: str) -> str:
    """SamplingParams -> sampling_params, as the argument is called."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def _type_names(value: Any) -> str:
    """`value`'s type, or a list's element types: what a wrong argument was."""
    if isinstance(value, (list, tuple)):
        inner = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(inner)}" if inner else "an empty list"
    return f"a {type(value).__name__}"


def _conversations(messages: Any) -> list[Conversation]:
    """One conversation or several, each checked and as chat templates read it (a message
    with a problem is a ValueError naming it, not a template's TypeError)."""
    shape = "chat takes a conversation (a list of {'role', 'content'} dicts) or a list of them"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{shape}, got {type(messages).__name__ if messages else 'nothing'}")
    several = not isinstance(messages[0], dict)
    conversations = list(messages) if several else [messages]
    out = []
    for i, conversation in enumerate(conversations):
        where = f"conversation {i}" if several else "the conversation"
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"{shape}; {where} is {type(conversation).__name__}")
        for j, message in enumerate(conversation):
            problem = message_problem(message)
            if problem is not None:
                raise ValueError(f"{where}, message {j}: {problem}")
        out.append([template_message(m) for m in conversation])
    return out


def _truncated(params: PoolingParams, truncate_prompt_tokens: int | None) -> PoolingParams:
    """`params` with the keyword's truncation where they set none of their own."""
    if truncate_prompt_tokens is None or params.truncate_prompt_tokens is not None:
        return params
    return dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
