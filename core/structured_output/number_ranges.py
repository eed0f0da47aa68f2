"""Regular expressions for JSON numbers within bounds, exactly and of any width.

A JSON schema's `minimum`/`maximum` (and the exclusive ones) become a regex over the
number's text: digit-by-digit ranges for integers (`[1-9]\\d{0,3}|[1-8]\\d{4}|9[0-8]\\d{3}|...`),
and for numbers a comparison of the integer part, then of the fraction, with the bound.
Exponents are not written by a bounded number (1e3 is 1000).
"""

from __future__ import annotations

from decimal import Decimal


def _digits(lo: str, hi: str) -> str:
    """Digit strings of one length n (as written: "007" counts), lo <= s <= hi."""
    if not lo:
        return ""
    n = len(lo) - 1
    if lo[0] == hi[0]:
        return lo[0] + _group(_digits(lo[1:], hi[1:]))
    first, last = int(lo[0]), int(hi[0])
    parts = []
    if lo[1:] != "0" * n:  # the lowest first digit only for part of its range
        parts.append(lo[0] + _group(_digits(lo[1:], "9" * n)))
        first += 1
    whole_last = hi[1:] == "9" * n
    if first <= (last if whole_last else last - 1):
        parts.append(_cls(first, last if whole_last else last - 1) + (f"\\d{{{n}}}" if n else ""))
    if not whole_last:
        parts.append(hi[0] + _group(_digits("0" * n, hi[1:])))
    return "|".join(parts)


def _cls(a: int, b: int) -> str:
    return str(a) if a == b else f"[{a}-{b}]"


def _group(regex: str) -> str:
    return f"(?:{regex})" if "|" in regex else regex


def natural_range(lo: int, hi: int | None) -> str:
    """Non-negative integers lo..hi (hi None: no bound), written without leading zeros."""
    if hi is not None and lo > hi:
        raise ValueError(f"empty range {lo}..{hi}")
    parts = []
    width = len(str(lo))
    top = hi if hi is not None else 10 ** width - 1
    while lo <= top:
        end = min(top, 10 ** width - 1)
        parts.append(_digits(str(lo), str(end)))
        lo, width = end + 1, width + 1
    if hi is None:
        parts.append(f"[1-9]\\d{{{width - 1},}}")
    return _group("|".join(parts))


def integer_range(lo: int | None, hi: int | None) -> str:
    """Integers lo..hi (None: unbounded) as JSON writes them."""
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"no integer lies in [{lo}, {hi}]")
    parts = []
    if hi is None or hi >= 0:
        parts.append(natural_range(max(lo or 0, 0), hi))
    if lo is None or lo < 0:
        parts.append("-" + natural_range(max(-(hi if hi is not None else -1), 1),
                                         -lo if lo is not None else None))
    return _group("|".join(parts))


# A fraction is the digit string after a number's point; a set of them is a regex of its
# non-empty members and whether the empty one (no point at all, the value .0) is in it.
Fractions = tuple[str, bool]


def _at_least(a: str) -> Fractions:
    """Fractions f with 0.f >= 0.a (a without trailing zeros)."""
    if not a:
        return "\\d+", True
    alts = [a[:i] + _cls(int(d) + 1, 9) + "\\d*" for i, d in enumerate(a) if d != "9"]
    return "(?:" + "|".join([*alts, a + "\\d*"]) + ")", False


def _at_most(b: str) -> Fractions:
    """Fractions f with 0.f <= 0.b (b without trailing zeros)."""
    if not b:
        return "0+", True
    alts = [b[:i] + _cls(0, int(d) - 1) + "\\d*" for i, d in enumerate(b) if d != "0"]
    alts += [b[:i] for i in range(1, len(b))] + [b + "0*"]
    return "(?:" + "|".join(alts) + ")", True


def _between(a: str, b: str) -> Fractions:
    """Fractions f with 0.a <= 0.f <= 0.b."""
    if not a:
        return _at_most(b)
    if a == b:
        return a + "0*", False
    i = next(i for i in range(len(b)) if (a[i] if i < len(a) else "0") != b[i])
    p, da, db = b[:i], int(a[i]) if i < len(a) else 0, int(b[i])
    alts = [p + str(da) + (_at_least(a[i + 1:])[0] if a[i + 1:] else "\\d*")]
    if i >= len(a):
        alts.append(p)  # a itself, written shorter than b
    if db - da > 1:
        alts.append(p + _cls(da + 1, db - 1) + "\\d*")
    rest, _ = _at_most(b[i + 1:])
    alts.append(p + str(db) + f"(?:{rest})?")
    return "(?:" + "|".join(a for a in alts if a) + ")", False


def _point(fractions: Fractions) -> str:
    regex, empty = fractions
    return f"(?:\\.{regex})?" if empty else f"\\.{regex}"


def _split(x: Decimal) -> tuple[int, str]:
    whole = int(x)
    return whole, format(x - whole, "f").partition(".")[2].rstrip("0")


def _magnitudes(lo: Decimal, hi: Decimal | None) -> str:
    """Non-negative numbers written I or I.F, lo <= value <= hi (hi None: no bound)."""
    wl, fl = _split(lo)
    any_point = "(?:\\.\\d+)?"
    if hi is None:
        return _group(natural_range(wl, wl) + _point(_at_least(fl)) + "|"
                      + natural_range(wl + 1, None) + any_point)
    wh, fh = _split(hi)
    if wl == wh:
        return natural_range(wl, wl) + _point(_between(fl, fh))
    alts = [natural_range(wl, wl) + _point(_at_least(fl))]
    if wh - wl > 1:
        alts.append(natural_range(wl + 1, wh - 1) + any_point)
    alts.append(natural_range(wh, wh) + _point(_at_most(fh)))
    return "(?:" + "|".join(alts) + ")"


def number_range(lo: float | None, hi: float | None) -> str:
    """Numbers in [lo, hi] (None: unbounded), written -?I(.F)? with no exponent."""
    low = Decimal(str(lo)) if lo is not None else None
    high = Decimal(str(hi)) if hi is not None else None
    if low is not None and high is not None and low > high:
        raise ValueError(f"no number lies in [{lo}, {hi}]")
    parts = []
    if high is None or high >= 0:
        parts.append(_magnitudes(max(low, Decimal(0)) if low is not None else Decimal(0),
                                 high))
    if low is None or low < 0:  # -m: m from max(-hi, 0) up to -lo
        floor = -high if high is not None and high < 0 else Decimal(0)
        parts.append("-" + _magnitudes(floor, -low if low is not None else None))
    return "(?:" + "|".join(parts) + ")"
