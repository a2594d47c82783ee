"""``fuelspmd.checkpoint`` (layer 8): sharded, atomic checkpoints that load into any layout.

::

    checkpoint.save(path, {"model": model, "optim": opt, "step": 7}, mesh=mesh)
    values = checkpoint.load(path, {"model": model, "optim": opt})   # {"step": 7}
    h = checkpoint.async_save(path, state, mesh=mesh); ...; h.wait()

A checkpoint is a directory: one safetensors file per writing rank and ``index.json`` (the
format version, the mesh, the plain values, each optimiser's step count, and per tensor
its global shape, dtype and saved pieces: the box of the global tensor each holds, its
file, its name and byte range there and its CRC-32). The ranks all-gather what each
holds (:mod:`.state`); every rank computes the same plan from it (:mod:`.layout`), so a
disagreement raises the same error on every rank before any file is written, and every
distinct block is written once, by the lowest rank holding it (replicated tensors, dp
replicas). A load reads, per block a rank holds now, the intersection with each saved
piece (``get_slice``), so a rank holds its own blocks plus one slice.

The commit, and why any kill leaves a committed checkpoint at ``path``. A directory is
*committed* when it holds ``index.json``; the index is written last, through a temporary
name, fsynced and renamed, and it records the name it is committed under. A save:

1. every rank writes its shard into ``<path>.tmp-<nonce>/``, fsyncs it and the directory,
   then writes a ``done-<rank>`` marker through a temporary name, fsynced and renamed,
   and touches the directory no more, since rank 0 may commit it at once (no collective
   after the agreement, so the writing can run on a background thread);
2. rank 0 waits (with the communicator's deadline) for every marker, writes the index
   into the temporary directory, and commits by renames: ``path -> <path>.old-<nonce>``
   (if a checkpoint is there), ``<path>.tmp-<nonce> -> path``, each fsynced; then it
   deletes the old one and leftovers of earlier crashed saves, each index first;
3. with ``keep=K``, ``latest`` in the run directory (``path``'s parent) is replaced by a
   renamed, fsynced file naming ``path``, and all but the K newest are deleted, index first.

Loading ``path`` takes ``path`` if committed, else the committed ``<path>.old-*``; a
directory under its own temporary name is refused though its index is there. Cases by
where a kill lands: before the first rename, ``path`` is untouched (the old checkpoint
or nothing, and the partial one is not committed); between the two renames ``path`` is
missing and the old one is the committed ``.old-*`` that load falls back to; after the
second, ``path`` is the new committed one. A deletion removes the index first, so a
half-deleted directory is uncommitted, never a committed one missing shards; ``latest``
always names a committed checkpoint because it moves only after the commit, by a rename.
A shard whose bytes were damaged afterwards is found by its CRC-32 (checked over the whole
saved tensor, streamed, before any of its values are used). tests/faults/
test_checkpoint_kill.py kills a rank with SIGKILL at each named point of the save.

Resharding. A parameter's global identity is its state key and dotted name plus its Spec
(rank ``r`` of ``spec.comm`` holds block ``r`` along ``spec.dim``), so a pipeline stage,
a tp size or a dp size other than the save's only changes which boxes a rank asks for.
Optimiser state follows its parameter (``Optimizer.shard_state``: ZeRO-1 slices are flat
ranges, saved as the boxes they cover, and read back for any dp size).
"""

from __future__ import annotations

from fuelspmd.checkpoint.api import SaveHandle, async_save, latest, load, save

__all__ = ["SaveHandle", "async_save", "latest", "load", "save"]
