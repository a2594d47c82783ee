"""The hash chain that names full KV cache blocks for prefix caching.

Block ``i`` of a sequence is named by ``hash(parent, tokens of block i, extra keys)`` where
``parent`` is the name of block ``i - 1`` (``None`` for the first block). Chaining makes the
name depend on the whole prefix, not only the block's own tokens: the keys and values of a
block depend on every token before it, so two blocks with equal tokens but different
histories must never be confused.

The name must be the same in every process: tensor-parallel ranks hash independently and
must agree, and data-parallel replicas publish their names to a :class:`PrefixRouter`. So
nothing here uses Python's ``hash()`` (salted per process for ``str`` and ``bytes``); the
default hash is SHA-256 over a canonical byte encoding, truncated to 63 bits so a name fits
an ``int64`` buffer when a later layer exchanges names through a transport.

A name is a hint, never proof: the block pool confirms every hit against the tokens,
extra keys and parent it stored, so a collision (forced in tests through an injected
``hash_fn``) costs a miss, never a wrong cache.

Imports only the standard library and :mod:`fuelspmd.errors`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import NewType, TypeAlias

from fuelspmd.errors import CacheUsageError

__all__ = [
    "BlockHash",
    "ExtraKey",
    "HashFn",
    "encode_key",
    "encode_tokens",
    "hash_blocks",
    "sha256_block_hash",
]

BlockHash = NewType("BlockHash", int)
"""The name of a full block: a chain hash in ``[0, 2**63)``."""

ExtraKey: TypeAlias = str | int | bytes | tuple["ExtraKey", ...] | None
"""What may key a sequence besides its tokens (an adapter name, a salt, an image digest)."""

HashFn: TypeAlias = Callable[[BlockHash | None, tuple[int, ...], tuple[ExtraKey, ...]], BlockHash]
"""``hash_fn(parent, block_tokens, extra_keys) -> BlockHash``; must be deterministic."""

_TOKEN_MAX = 2**64


def encode_key(key: ExtraKey, out: list[bytes]) -> None:
    """Append a tagged, length-prefixed encoding of one extra key: injective by construction."""
    if key is None:
        out.append(b"N")
    elif isinstance(key, bool):
        out.append(b"T" if key else b"F")
    elif isinstance(key, int):
        raw = key.to_bytes((key.bit_length() + 8) // 8, "little", signed=True)
        out.append(b"i" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, str):
        raw = key.encode("utf-8")
        out.append(b"s" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(key, bytes):
        out.append(b"b" + struct.pack("<I", len(key)) + key)
    elif isinstance(key, tuple):
        out.append(b"t" + struct.pack("<I", len(key)))
        for item in key:
            encode_key(item, out)
    else:
        raise CacheUsageError(
            f"extra key {key!r} of type {type(key).__name__} has no stable encoding; "
            "use str, int, bytes, None or a tuple of those (e.g. an adapter name or a salt)"
        )


def encode_tokens(tokens: Sequence[int]) -> bytes:
    """Pack token ids as little-endian uint64; ids must lie in ``[0, 2**64)``."""
    try:
        return struct.pack(f"<{len(tokens)}Q", *tokens)
    except struct.error as exc:
        bad = [t for t in tokens if not (isinstance(t, int) and 0 <= t < _TOKEN_MAX)][:3]
        raise CacheUsageError(
            f"token ids must be integers in [0, 2**64); got {bad!r}: pass token ids, "
            "not text or floats"
        ) from exc


def sha256_block_hash(
    parent: BlockHash | None, tokens: tuple[int, ...], extra_keys: tuple[ExtraKey, ...]
) -> BlockHash:
    """The default chain hash: SHA-256 of (parent, tokens, extra keys), first 63 bits."""
    parts: list[bytes] = [b"P" if parent is None else b"p" + struct.pack("<Q", parent)]
    parts.append(struct.pack("<I", len(tokens)))
    parts.append(encode_tokens(tokens))
    encode_key(tuple(extra_keys), parts)
    digest = hashlib.sha256(b"".join(parts)).digest()
    return BlockHash(int.from_bytes(digest[:8], "little") >> 1)


def hash_blocks(
    tokens: Sequence[int],
    block_size: int,
    *,
    extra_keys: tuple[ExtraKey, ...] = (),
    hash_fn: HashFn = sha256_block_hash,
    parent: BlockHash | None = None,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Name every full block of ``tokens`` (at most ``max_blocks``); a partial tail has none.

    The manager and the router both call this, so a replica's published names and a
    router's lookups agree as long as they share ``block_size``, ``extra_keys`` and
    ``hash_fn``.
    """
    count = len(tokens) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    names: list[BlockHash] = []
    for i in range(count):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hash_fn(parent, block, extra_keys)
        names.append(parent)
    return names
