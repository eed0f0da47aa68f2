"""Tokenizer: a `tokenizers.Tokenizer` plus special tokens and the chat template.

Built from a Hugging Face folder (tokenizer.json) or from GGUF metadata (see plugins/weights/gguf.py).
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

# End-of-turn markers of common chat templates: generation stops on them too.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


# Marks where the final message's text ends in a rendered conversation (transformers' tag).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which templates do not expect
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # Granite's, SmolLM3's, Mistral's date lines
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks the assistant's
    text for training masks: rendered, it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    """Where chat templates render: sandboxed, with the globals, filters and tags that
    transformers gives them."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


def _compile(template: str, whose: str) -> jinja2.Template:
    """`template` compiled; a ValueError saying where it does not parse."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{whose} does not compile (line {exc.lineno}: {exc.message}); chat "
                         "requests are refused until it is fixed") from None


class Tokenizer:
    """Encodes text, decodes ids, and renders chat messages through the model's template."""

    def __init__(self, backend: HFTokenizer, *, bos_token_id: int | None,
                 eos_token_ids: set[int], add_bos_token: bool,
                 chat_template: str | None, appended_eos_id: int | None = None,
                 own_eos_id: int | None = None, tool_template: str | None = None) -> None:
        """`appended_eos_id`: a token `encode` ends a text with where special tokens are
        added (a GGUF's add_eos_token: last-token-pooled embedding models pool on it); a
        tokenizer.json's post-processor does this for a model folder. `own_eos_id`: the
        tokenizer's own EOS (tokenizer_config's eos_token), the template's `eos_token` (the
        EOS set also holds the configs' and the template's end-of-turn tokens).
        `tool_template`: a checkpoint's template named "tool_use", which transformers
        renders a conversation with tools through (Hermes-2-Pro's)."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.appended_eos_id = appended_eos_id
        self.own_eos_id = own_eos_id
        self.chat_template = chat_template
        self.tool_template = tool_template
        # End-of-turn tokens the template uses count as EOS (SmolLM2's <|im_end|>, ...).
        self.eos_token_ids = set(eos_token_ids)
        for tok in _END_OF_TURN:
            tid = backend.token_to_id(tok)
            if tid is not None and chat_template and tok in chat_template:
                self.eos_token_ids.add(tid)
        self.special_token_ids = {
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self._templates: dict[str, jinja2.Template] = {}  # compiled, by source
        self._variables: frozenset[str] | None = None
        for source in (chat_template, tool_template):
            try:
                if source:
                    self._compiled(source)
            except ValueError as exc:  # the model still completes text; chat is refused
                logging.getLogger("pkv.tokenizer").warning("%s", exc)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for: its vocabulary entry's length
        bounds it (a byte-level or byte-fallback entry spells more than it covers)."""
        return max((len(token) for token in self.backend.get_vocab(with_added_tokens=True)),
                   default=1)

    @property
    def eos_token_id(self) -> int | None:
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # (the tokenizers library's word for a lone surrogate)
            check_unicode(text)
            raise
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id, *ids]
        if (add_special_tokens and self.appended_eos_id is not None
                and (not ids or ids[-1] != self.appended_eos_id)):
            ids = [*ids, self.appended_eos_id]
        return ids

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], list[int]]:
        """A cross-encoder's input: the pair's ids as the tokenizer joins them (BERT:
        [CLS] a [SEP] b [SEP]) and each token's segment (0: `text`, 1: `pair`)."""
        encoding = self.backend.encode(text, pair)
        return encoding.ids, encoding.type_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template: str | None = None, *, tokenize: bool = False,
                            **kwargs: Any) -> Any:
        """Render a conversation to the prompt text the model was trained on (or through
        `chat_template`, a Jinja template given instead); `continue_final_message`: end the
        text inside the last message (no end of turn), for the model to go on writing it, as
        transformers does. `tokenize`: the text's token ids instead (transformers' keyword).
        Other keywords go to the template."""
        if tokenize:
            text = self.apply_chat_template(messages, add_generation_prompt,
                                            continue_final_message, chat_template, **kwargs)
            return self.encode(text, add_special_tokens=False)
        if continue_final_message:
            return self._continuing(messages, add_generation_prompt,
                                    {**kwargs, "chat_template": chat_template})
        own = self.template_for(bool(kwargs.get("tools")))
        if not (chat_template or own):
            raise ValueError("this model has no chat template; use generate() with a prompt")
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos_id = self.own_eos_id if self.own_eos_id is not None else self.eos_token_id
        eos = self.id_to_token(eos_id) if eos_id is not None else ""
        template = (self._compiled(own) if chat_template is None
                    else _compile(chat_template, "the chat template given"))
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=bos, eos_token=eos, **kwargs)
        except jinja2.TemplateError as exc:  # raise_exception's own message, or jinja's
            raise ValueError(f"the chat template refused these messages: {exc}") from None

    def template_for(self, tools: bool) -> str:
        """The model's template for a conversation with `tools` or without (transformers
        takes the "tool_use" one where a checkpoint names it)."""
        return (self.tool_template if tools and self.tool_template else self.chat_template) or ""

    def template_variables(self) -> frozenset[str]:
        """The variables the model's chat templates read and do not set themselves."""
        if self._variables is None:
            found: set[str] = set()
            for source in (self.chat_template, self.tool_template):
                try:
                    parsed = _environment().parse(source or "")
                except jinja2.TemplateSyntaxError:
                    continue
                found |= jinja2.meta.find_undeclared_variables(parsed)
            self._variables = frozenset(found)
        return self._variables

    def _compiled(self, source: str) -> jinja2.Template:
        """One of the model's chat templates, compiled once."""
        if source not in self._templates:
            self._templates[source] = _compile(source, "the model's chat template")
        return self._templates[source]

    def _continuing(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    kwargs: dict[str, Any]) -> str:
        """The conversation rendered with a tag after the last message's text, cut there."""
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "set: the model continues the last message, it opens no new one")
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a final message whose content is "
                             "text")
        last = {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}
        text = self.apply_chat_template([*messages[:-1], last], False, **kwargs)
        where = text.rfind(_CONTINUE_TAG.strip())
        if where < 0:
            raise ValueError("the chat template drops the final message's text, so it cannot "
                             "be continued")
        # A template that trims the message also trimmed the tag's space: trim the text too.
        tagged = text[where:where + len(_CONTINUE_TAG)] == _CONTINUE_TAG
        return text[:where] if tagged else text[:where].rstrip()

    def save(self, folder: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json so `from_folder` (and transformers)
        read the same tokenizer back."""
        name = self.id_to_token
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "add_bos_token": self.add_bos_token}
        if self.bos_token_id is not None:
            config["bos_token"] = name(self.bos_token_id)
        eos_id = self.own_eos_id if self.own_eos_id is not None else self.eos_token_id
        if eos_id is not None:
            config["eos_token"] = name(eos_id)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        self.backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template of an HF folder."""
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (a fast tokenizer is needed)")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot read
            raise ValueError(f"{path} is not a tokenizer the tokenizers library reads: "
                             f"{exc}") from None
        # A file's own truncation and padding (all-MiniLM-L6-v2's cuts at 128 tokens) are not
        # the model's: transformers turns them off unless a call asks, and so does pkv.
        backend.no_truncation()
        backend.no_padding()
        cfg_path = folder / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        except ValueError as exc:
            raise ValueError(f"{cfg_path} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path} must hold a JSON object")
        jinja_path = folder / "chat_template.jinja"  # first, as transformers reads them
        template = jinja_path.read_text() if jinja_path.is_file() else \
            _named_template(cfg.get("chat_template"), "default")
        tool_path = folder / "additional_chat_templates" / "tool_use.jinja"
        tool_template = tool_path.read_text() if tool_path.is_file() else \
            _named_template(cfg.get("chat_template"), "tool_use")

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if tok else None

        eos = set(eos_token_ids)
        if (eos_id := token_id("eos_token")) is not None:
            eos.add(eos_id)
        # tokenizer.json's post-processor adds BOS where the model wants it; a tokenizer.json
        # without one (pkv's own, written from a GGUF) relies on add_bos_token instead.
        add_bos = bool(cfg.get("add_bos_token")) and backend.post_processor is None
        return cls(backend, bos_token_id=token_id("bos_token"), eos_token_ids=eos,
                   add_bos_token=add_bos, chat_template=template, own_eos_id=eos_id,
                   tool_template=tool_template)


def _named_template(value: Any, name: str) -> str | None:
    """tokenizer_config's chat_template called `name`: a list of named templates holds
    several; a string is the one "default" template."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get(name)
    return value if isinstance(value, str) and name == "default" else None


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate (as JSON's "\\ud800" decodes to), which makes it no
    Unicode text and no tokenizer encodes; None: nowhere."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_unicode(text: str) -> None:
    """A ValueError where `text` is no Unicode text (`lone_surrogate`)."""
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(f"text is not valid Unicode: a lone surrogate ({text[at]!a}) at "
                         f"character {at}")
