"""How one-line user-facing messages word a count: `counted(1, "page")` is "1 page",
`counted(3, "page")` "3 pages" (every count in an error goes through it: "1 pages" read wrong)."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n noun` with the noun in the plural unless n is 1 (plural: its plural form, default noun + 's')."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def pool_size(num_pages: int, page_size: int) -> str:
    """A KV pool's size in errors: "3 pages x 16 tokens = 48 tokens"."""
    tokens = counted(num_pages * page_size, "token")
    return f"{counted(num_pages, 'page')} x {counted(page_size, 'token')} = {tokens}"
