"""SLURM host lists: ``node[01-03,7],gpu5`` into host names, in order, without SLURM's tools."""

from __future__ import annotations

from collections.abc import Iterator

from autoddp.core.errors import ConfigurationError


def first_host(text: str) -> str:
    """The first host of a SLURM host list, without expanding the rest."""
    for host in hosts(text):
        return host
    raise ConfigurationError(f"the SLURM host list {text!r} names no host; set MASTER_ADDR instead")


def hosts(text: str) -> Iterator[str]:
    """The host names of a SLURM host list such as ``node[01-03,7],gpu5``, in order, one at a time.

    Zero padding is kept (``n[08-10]`` gives ``n08 n09 n10``) and several bracket groups in one
    name multiply (``r[1-2]n[1-2]`` gives ``r1n1 r1n2 r2n1 r2n2``).
    """
    depth, start = 0, 0
    for i, char in enumerate(text + ","):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad_hostlist(text, "']' without '['")
        elif char == "," and depth == 0:
            item = text[start:i].strip()
            start = i + 1
            if item:
                yield from _expand_host(item, text)
    if depth:
        raise _bad_hostlist(text, "'[' without ']'")


def _expand_host(item: str, text: str) -> Iterator[str]:
    opening = item.find("[")
    if opening < 0:
        if "]" in item:
            raise _bad_hostlist(text, "']' without '['")
        yield item
        return
    closing = item.find("]", opening)
    if closing < 0:
        raise _bad_hostlist(text, "'[' without ']'")
    prefix, ranges, rest = item[:opening], item[opening + 1 : closing], item[closing + 1 :]
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
            raise _bad_hostlist(text, f"[{ranges}] is not a list of numbers and ranges such as 01-03,7")
        for number in range(int(low), int(high) + 1):
            for tail in _expand_host(rest, text) if rest else ("",):
                yield f"{prefix}{number:0{len(low)}d}{tail}"


def _bad_hostlist(text: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"cannot read the SLURM host list {text!r}: {why}; set MASTER_ADDR to rank 0's host instead"
    )
