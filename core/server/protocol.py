"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

One rule for every number, as OpenAI has it: a number field takes a JSON number and nothing
else. Strings are refused, not coerced ("n": "1" is a 400, as is "temperature": "0.5"); an
integer field refuses 1.5, 1.0 and booleans; NaN and ±Infinity (which Python's JSON reader
accepts) are refused in every float field. Ranges are SamplingParams' own; every error names
the field the client sent.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from pkv.core.sample.sampling_params import SamplingParams
from pkv.core.server.errors import OpenAIError
from pkv.core.structured_output.params import StructuredOutputsParams
from pkv.core.tokenizer.chat_messages import (first_non_text_part, may_omit_content,
                                               template_message)
from pkv.core.tokenizer.tokenizer import lone_surrogate


# Strict types, finite floats: see the module docstring. Unknown fields are accepted and
# ignored, as OpenAI-compatible servers do: clients send vendor extras (e.g. `metadata`).
STRICT = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class RequestBody(BaseModel):
    """A request body whose fields read `null` as "not given", as OpenAI's and Anthropic's
    APIs do: their SDKs type such fields optional and send null for them (`store=None`), so a
    null takes the field's default instead of failing its type."""

    model_config = STRICT

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        _check_unicode(data)
        defaulted = {name for field_name, info in cls.model_fields.items()
                     if info.default is not None and not info.is_required()
                     for name in (field_name, info.alias) if name}
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}


def _check_unicode(body: dict[str, Any]) -> None:
    """A 400 naming the first string of `body` that is no Unicode text: a lone surrogate
    (JSON's "\\ud800" decodes to one), which no tokenizer, template or stream can encode."""
    stack: list[tuple[str, Any]] = [(key, value) for key, value in body.items()]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            at = lone_surrogate(value)
            if at is not None:
                raise PydanticCustomError(
                    "unicode", "{param}: not valid Unicode: a lone surrogate at character "
                    "{at}", {"param": where, "at": at})
        elif isinstance(value, dict):
            stack += [(f"{where}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage on every chunk


# vLLM fields that would change the answer and that pkv does not serve: each is refused by
# name (a client that sent one must not believe it was applied) unless it asks nothing.
_UNSERVED = {
    "guided_grammar": "grammars are not supported; use structured_outputs (json, regex, "
                      "choice) or response_format",
    "structural_tag": "structural tags are not supported; use structured_outputs or "
                      "response_format",
    "use_beam_search": "beam search is not supported: each choice is its own sample",
    "length_penalty": "length_penalty applies to beam search, which is not supported",
    "return_tokens_as_token_ids": "tokens come back as text only",
    "logits_processors": "logits processors are not supported",
    "priority": "priority scheduling is not enabled: requests run first come, first served",
}
_NO_OP = {"priority": 0, "length_penalty": 1}  # the numbers that ask nothing


def _asks_nothing(name: str, value: Any) -> bool:
    if value is None or value is False or value == [] or value == {}:
        return True
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and value == _NO_OP.get(name)


class _SamplingFields(RequestBody):
    """Fields shared by chat and completions (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI sends token ids as string keys
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True  # vLLM's extras, from here to bad_words
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: choices[i].prompt_logprobs
    guided_grammar: Any = None  # vLLM's, named only to be refused (see _UNSERVED)
    structural_tag: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    return_tokens_as_token_ids: Any = None
    logits_processors: Any = None
    priority: Any = None

    def check_supported(self) -> None:
        """A 400 for a field whose meaning pkv does not serve (ignoring it would answer
        another question)."""
        for name, why in _UNSERVED.items():
            if not _asks_nothing(name, getattr(self, name)):
                raise OpenAIError(400, f"{name}: {why}", name)

    def constraint_fields(self) -> list[str]:
        """The request fields that carry a structured-output constraint."""
        names = [n for n in ("structured_outputs", "guided_json", "guided_regex", "guided_choice")
                 if getattr(self, n) is not None]
        rf = self.response_format
        return (["response_format"] if rf is not None and rf.type != "text" else []) + names

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The one structured-output constraint of the request and the field that gave it."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ValueError("response_format: json_schema.schema is required")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            found.append(("structured_outputs", {"json": so.json_, "regex": so.regex,
                                                 "choice": so.choice}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice")):
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if not found:
            return None, None
        if len(found) > 1:
            raise ValueError("give one structured-output constraint, got "
                             f"{', '.join(name for name, _ in found)}")
        name, spec = found[0]
        return StructuredOutputsParams(**spec), name

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: StructuredOutputsParams | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Build SamplingParams; where a field is absent, the model's default (`defaults`:
        its generation_config's, as vLLM takes them), else OpenAI's. `structured` is this
        body's `structured()`, built once by the caller (it validates the schema)."""
        defaults = defaults or {}

        def pick(value: Any, name: str, default: Any) -> Any:
            return defaults.get(name, default) if value is None else value

        return SamplingParams(
            n=self.n, temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0), top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0), seed=self.seed,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            logit_bias=self._logit_bias(),
            presence_penalty=pick(self.presence_penalty, "presence_penalty", 0.0),
            frequency_penalty=pick(self.frequency_penalty, "frequency_penalty", 0.0),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            logprobs=logprobs,
            structured_outputs=structured, truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=self.asked_prompt_logprobs())

    def asked_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's logprobs carry (None: not asked)."""
        return self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise ValueError("logit_bias keys must be token ids") from None

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM's continuous_usage_stats)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None

    def missing_content(self) -> bool:
        """OpenAI: only an assistant message that calls tools may go without content."""
        return self.content is None and not may_omit_content(
            {**(self.model_extra or {}), "role": self.role})

    def first_bad_part(self) -> int | None:
        """The index of the first content part that is not OpenAI's text part."""
        return first_non_text_part(self.content) if isinstance(self.content, list) else None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (check_messages refused what they cannot)."""
        return template_message({**(self.model_extra or {}), "role": self.role,
                                 "content": self.content})


class FunctionDefinition(BaseModel):
    model_config = STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # A cap on the thinking block (with a reasoning parser): an effort or a token count.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    thinking_token_budget: int | None = None
    # Named only to be refused: a request-supplied template would run the caller's code.
    chat_template: str | None = None
    echo: Any = None  # vLLM's (the prefilled assistant text first), named only to be refused
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: render without a new assistant turn, ending inside the last message for the
    # model to go on writing it (a prefilled answer).
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo not in (None, False):
            raise OpenAIError(400, "echo: chat does not repeat the prompt; a prefilled "
                              "answer (continue_final_message) is in the request already",
                              "echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", "top_logprobs")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def asked_prompt_logprobs(self) -> int | None:
        """Echoed with logprobs, the prompt's tokens carry them too (OpenAI's scoring)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt back (with its logprobs), nothing made."""
        return self.echo and self.max_tokens == 0

    def check_supported(self) -> None:
        """The shared fields' refusals, then fill-in-the-middle and best_of above n."""
        super().check_supported()
        if self.suffix:
            raise OpenAIError(400, "suffix: fill-in-the-middle is not supported; send the "
                              "text before the gap as the prompt", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise OpenAIError(400, f"best_of: only best_of == n ({self.n}) is supported: "
                              "each choice is its own sample", "best_of")


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a prompt, or a conversation rendered as chat renders it (its tools,
    generation prompt, prefilled answer and template variables included)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt these messages are."""
        return ChatCompletionRequest(
            model=self.model, messages=self.messages or [], tools=self.tools,
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


FinishReason = Literal["stop", "length", "abort"]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = STRICT

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    model_config = STRICT

    lora_name: str = Field(min_length=1, max_length=256)


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings (OpenAI's body; `normalize` is vLLM's extra)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True  # vLLM's: a text's BOS / [CLS] and [SEP]
    user: str | None = None


class ClassificationRequest(RequestBody):
    """POST /classify (vLLM's body): a sequence classifier's label scores for each input."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankDocument(BaseModel):
    model_config = STRICT

    text: str


class RerankRequest(RequestBody):
    """POST /v1/rerank (Jina's and Cohere's body, as vLLM and llama.cpp accept it)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None  # vLLM's: each text's last N (embedding models)


class ScoreRequest(RequestBody):
    """POST /score (vLLM's body): text_1 against each text_2, or pair by pair."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None  # vLLM's: each text's last N (embedding models)
