"""Logprobs in OpenAI's two response shapes: chat (`content` list) and completions.

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
        tops.append({lp.decoded_token: lp.logprob for lp in _top(entry, top_n)})
        offsets.append(offset)
        offset += len(chosen.decoded_token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}
