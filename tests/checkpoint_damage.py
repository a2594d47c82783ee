"""Damage done to a saved checkpoint or a Hugging Face directory, as a careless user, a
failing disk or an attacker would: the tests of tests/unit/test_checkpoint_trust.py and
the mutation fuzzer (tests/unit/test_checkpoint_fuzz.py) share these.

Each helper edits files in place. ``reseal`` recomputes the index's own checksum after an
edit (a hand edit by someone who knows the format), so the schema checks behind the
checksum are reached too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header length and header."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8:8 + n])


def write_header(path: Path, header: dict[str, Any]) -> None:
    """Replace ``path``'s header by ``header``, padded to the old length (the data stays)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n, "the new header is longer than the old one"
    path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])


def reseal(index_path: Path) -> None:
    """Recompute the index's checksum after an edit (no-op where the format has none)."""
    try:
        from fuelspmd.checkpoint.index import CHECKSUM, seal
    except ImportError:  # a fuelspmd whose index has no checksum
        return
    index = json.loads(index_path.read_text())
    index.pop(CHECKSUM, None)
    index_path.write_text(json.dumps(seal(index)))


def edit_index(path: Path, change: Any, *, sealed: bool = True) -> None:
    """Apply ``change(index)`` (in place) to the checkpoint at ``path``; ``sealed``: then
    recompute its checksum."""
    p = path / "index.json"
    index = json.loads(p.read_text())
    change(index)
    p.write_text(json.dumps(index))
    if sealed:
        reseal(p)


def swap_offsets(shard: Path, a: str, b: str) -> None:
    """Swap the byte ranges two tensors have in ``shard``'s header (the data stays)."""
    _, header = read_header(shard)
    header[a]["data_offsets"], header[b]["data_offsets"] = (header[b]["data_offsets"],
                                                            header[a]["data_offsets"])
    write_header(shard, header)


def flip(path: Path, at: int, mask: int = 0x10) -> None:
    """Flip bits ``mask`` of byte ``at`` (from the end if negative)."""
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))
