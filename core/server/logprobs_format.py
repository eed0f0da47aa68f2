"""Logprobs in OpenAI's two response shapes: chat (`content` list) and completions; a
prompt's (echoed completions, and vLLM's `prompt_logprobs` field).

Each token's entry maps token id -> Logprob: the chosen token plus the top `top_n`
alternatives (the chosen one may rank below them).
"""

from __future__ import annotations

from pkv.core.engine.outputs import Logprob

_Entry = dict[int, Logprob]


def _top(entry: _Entry, top_n: int) -> list[Logprob]:
    return sorted((lp for lp in entry.values() if lp.rank <= top_n), key=lambda lp: lp.rank)


def chat(entries: list[_Entry] | None, token_ids: list[int], top_n: int) -> dict | None:
    """{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}"""
    if entries is None:
        return None
    content = []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        top = [{"token": lp.decoded_token, "logprob": lp.logprob,
                "bytes": list(lp.decoded_token.encode())} for lp in _top(entry, top_n)]
        content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "bytes": list(chosen.decoded_token.encode()), "top_logprobs": top})
    return {"content": content}


def completion(entries: list[_Entry] | None, token_ids: list[int], top_n: int,
               offset: int) -> dict | None:
    """{"tokens", "token_logprobs", "top_logprobs", "text_offset"}"""
    if entries is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        chosen = entry[token]
        tokens.append(chosen.decoded_token)
        values.append(chosen.logprob)
        # the chosen token too, wherever it ranks (OpenAI's and vLLM's: a client reads
        # top_logprobs[i][tokens[i]])
        tops.append({**{lp.decoded_token: lp.logprob for lp in _top(entry, top_n)},
                     chosen.decoded_token: chosen.logprob})
        offsets.append(offset)
        offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def completion_prompt(entries: list[_Entry | None], token_ids: list[int], first: str,
                      top_n: int) -> dict:
    """An echoed prompt's part of completions' logprobs: its first token (text `first`) has
    none (null, as OpenAI's echo gives it)."""
    rest = completion(entries[1:], token_ids[1:], top_n, len(first)) or {}  # type: ignore
    return {"tokens": [first, *rest.get("tokens", [])],
            "token_logprobs": [None, *rest.get("token_logprobs", [])],
            "top_logprobs": [None, *rest.get("top_logprobs", [])],
            "text_offset": [0, *rest.get("text_offset", [])]}


def joined(prompt: dict, output: dict | None) -> dict:
    """An echoed prompt's logprobs, then the completion's (whose offsets follow the prompt)."""
    return {key: prompt[key] + (output or {}).get(key, []) for key in prompt}


def vllm_prompt(entries: list[_Entry | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), token id -> its
    logprob, rank and text."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in entry.items()} for entry in entries]
