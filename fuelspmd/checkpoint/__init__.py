"""``fuelspmd.checkpoint`` (layer 8): sharded, atomic checkpoints that load into any layout.

::

    checkpoint.save(path, {"model": model, "optim": opt, "step": 7}, mesh=mesh)
    values = checkpoint.load(path, {"model": model, "optim": opt})   # {"step": 7}
    h = checkpoint.async_save(path, state, mesh=mesh); ...; h.wait()

A checkpoint is a directory: one safetensors file per writing rank, the marker
``fuelspmd-checkpoint.json`` (this format, the checkpoint's name) and ``index.json`` (the
format version, the mesh, the plain values, each optimiser's step count, each file's size
and header CRC-32, and per tensor its global shape, dtype and saved pieces: the box of the
global tensor each holds, its file, its name and byte range there and its CRC-32; sealed
by the CRC-32 of its own contents, :mod:`.index`). The ranks all-gather what each holds
(:mod:`.state`); every rank computes the same plan from it (:mod:`.layout`), so a
disagreement raises the same error on every rank before any file is written, and every
distinct block is written once, by the lowest rank holding it (replicated tensors, dp
replicas).

The commit, and why any kill leaves a committed checkpoint at ``path``
(:mod:`.saving` has the protocol step by step). A directory is *committed* when it holds
``index.json``; the index is written last, through a temporary name, fsynced and renamed.
Every rank writes its shard into ``<path>.tmp-<nonce>/`` and a ``done-<rank>`` note; rank 0
(which holds ``path``'s lock) then writes the index and commits by renames: ``path ->
<path>.old-<nonce>`` (if a checkpoint is there), ``<path>.tmp-<nonce> -> path``, each
fsynced; then it deletes the old one and what crashed saves left, each index first. With
``keep=K``, ``latest`` in the run directory (``path``'s parent) is replaced by a renamed,
fsynced file naming ``path`` and the checkpoints the run's saves recorded, of which all but
the K newest are deleted, index first. A save removes only what it can prove it made
(:mod:`.files`); a failed one (a full disk) removes what it wrote and raises
CheckpointError on every rank.

Loading ``path`` takes ``path`` if committed, else the committed ``<path>.old-*``; a
directory under its own temporary name is refused though its index is there. Cases by
where a kill lands: before the first rename, ``path`` is untouched (the old checkpoint
or nothing, and the partial one is not committed); between the two renames ``path`` is
missing and the old one is the committed ``.old-*`` that load falls back to; after the
second, ``path`` is the new committed one. A deletion removes the index first, so a
half-deleted directory is uncommitted, never a committed one missing shards; ``latest``
always names a committed checkpoint because it moves only after the commit, by a rename.
A load trusts nothing it reads (DESIGN.md invariant 11): the index is checked against its
checksum and schema, every file opened inside the folder, every header against the index,
every piece's bytes against their CRC-32 before its values are used; everything is read
and checked before the ranks agree and anything is assigned (:class:`~.state.Loading`).
tests/faults/test_checkpoint_kill.py kills a rank with SIGKILL at each named point of the
save.

Resharding. A parameter's global identity is its state key and dotted name plus its Spec
(rank ``r`` of ``spec.comm`` holds block ``r`` along ``spec.dim``), so a pipeline stage,
a tp size or a dp size other than the save's only changes which boxes a rank asks for.
Optimiser state follows its parameter (``Optimizer.shard_state``: ZeRO-1 slices are flat
ranges, saved as the boxes they cover, and read back for any dp size).
"""

from __future__ import annotations

from fuelspmd.checkpoint.api import SaveHandle, async_save, latest, load, save

__all__ = ["SaveHandle", "async_save", "latest", "load", "save"]
