"""The mutation fuzzer of issue 40: random damage to a saved checkpoint and to a Hugging Face
directory, each load run on two ranks (devices of a DeviceGroup, the same protocol as
processes) and classified:

- ``refused``: a typed error (a FuelError), the same on both ranks, and each rank's model
  and optimiser exactly as they were before the load;
- ``exact``: loaded, and every tensor equal to what was saved (the change was harmless:
  a byte of padding, the marker, an unknown config key; or an edit of the index made
  consistent by hand, whose plain values and step counts then load as edited);
- the failures the fuzzer exists to find: ``partial`` (an error, a model changed),
  ``wrong`` (loaded, a tensor differs), ``untyped`` (an error that is no FuelError),
  ``split`` (the ranks disagree).

Mutations: truncate a file, flip bits in a header, in data, anywhere, edit or drop a field
of a JSON file (the index resealed with its checksum or not), rename or delete a file,
replace one by a symlink out of the folder, swap two tensors' offsets in a header.

CI runs 30 mutations of each kind; the long run (``python tests/run.py --long``) runs
2,000 of each, and prints the counts; alone::

    FUELSPMD_TESTS_LONG=1 pytest -s tests/unit/test_checkpoint_fuzz.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_damage as dmg
import checkpoint_programs as cp
from budget import runs

from fuelspmd import checkpoint, models
from fuelspmd.device_group import DeviceGroup
from fuelspmd.errors import FuelError

EXAMPLES = runs(30, 2000)  # mutations of each kind of directory
BAD = ("partial", "wrong", "untyped", "split")
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 64) | st.sampled_from(
        [0, -1, -3, 1, 2, 10 ** 18, 2 ** 31]) | st.floats(allow_nan=True)
    | st.sampled_from(["", "..", "../../etc/passwd", "/etc/shadow", "float16", "int32",
                       "bfloat16", "shard-00000-of-00002.safetensors", "model.safetensors"])
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=2),
    max_leaves=4)


# ---- the directories ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A checkpoint of a tp-2 model with AdamW state; a Llama directory in one file and a
    GPT-2 one sharded over two files with an index (both with CRC-32s, save_pretrained's)."""
    root = tmp_path_factory.mktemp("fuzz")
    DeviceGroup.cpu(2).run(lambda c: cp.save_state(c, str(root / "ck"), 2, 1, False, 1))
    cfg = models.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    models.Llama(cfg, seed=1, dtype="bfloat16").save_pretrained(root / "llama")
    gpt2 = models.GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=16)
    models.GPT2(gpt2, seed=2).save_pretrained(root / "gpt2")
    _shard(root / "gpt2")
    return {"ck": root / "ck", "llama": root / "llama", "gpt2": root / "gpt2"}


def _shard(d: Path) -> None:
    """Split ``d``'s model.safetensors into two files with an index (checksums kept)."""
    from fuelspmd.models.safetensors_io import SafetensorsReader, StreamingWriter

    with SafetensorsReader(d) as r:
        names = list(r.tensors)
        arrays = {n: r.read(n, tuple(slice(None) for _ in r.info(n)[0])) for n in names}
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for k, part in enumerate(halves):
        f = f"model-0000{k + 1}-of-00002.safetensors"
        with StreamingWriter(d / f, [(n, arrays[n].shape, arrays[n].dtype.name)
                                     for n in part]) as w:
            for n in part:
                w.write(n, arrays[n])
        weight_map.update(dict.fromkeys(part, f))
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {},
                                                                "weight_map": weight_map}))


# ---- mutations ------------------------------------------------------------------------------
def _json_path(draw: Callable[..., Any], value: Any) -> list[Any]:
    """A random path into a JSON value (keys and list indices), at least one step."""
    path: list[Any] = []
    while isinstance(value, (dict, list)) and value and (not path or draw(st.booleans())):
        key = draw(st.sampled_from(sorted(value) if isinstance(value, dict)
                                   else list(range(len(value)))))
        path.append(key)
        value = value[key]
    return path


def mutate(draw: Callable[..., Any], root: Path, outside: Path) -> str:
    """Damage the directory ``root`` once (``outside``: a folder beside it for a symlink to
    point into); return what was done."""
    files = sorted(p for p in root.iterdir() if p.is_file())
    f = draw(st.sampled_from(files))
    size = f.stat().st_size
    kind = draw(st.sampled_from(["truncate", "flip-header", "flip-data", "flip", "json",
                                 "json-drop", "rename", "delete", "symlink-out", "swap"]))
    if kind == "truncate":
        at = draw(st.integers(0, max(0, size - 1)))
        f.write_bytes(f.read_bytes()[:at])
        return f"truncate {f.name} at {at}"
    if kind.startswith("flip"):
        head = 8 + dmg.read_header(f)[0] if f.suffix == ".safetensors" and size >= 8 else 0
        lo, hi = {"flip-header": (0, max(1, head)), "flip-data": (head, size),
                  "flip": (0, size)}[kind]
        if hi <= lo or size == 0:
            return "nothing (no such region)"
        at = draw(st.integers(lo, hi - 1))
        mask = draw(st.integers(1, 255))
        dmg.flip(f, at, mask)
        return f"{kind} {f.name} byte {at} ^ {mask:#x}"
    if kind in ("json", "json-drop"):
        target = f if f.suffix == ".json" else draw(st.sampled_from(
            [p for p in files if p.suffix == ".json"]))
        doc = json.loads(target.read_text())
        path = _json_path(draw, doc)
        if not path:
            return "nothing (empty JSON)"
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if kind == "json-drop":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES)
        target.write_text(json.dumps(doc))
        sealed = target.name == "index.json" and draw(st.booleans())
        if sealed:
            dmg.reseal(target)
        new = "<dropped>" if kind == "json-drop" else repr(parent[path[-1]])[:60]
        return f"{kind} {target.name} {path} -> {new}" + (" resealed" if sealed else "")
    if kind == "rename":
        other = draw(st.sampled_from([p.name for p in files]
                                     + ["x.safetensors", "index.json.old"]))
        f.rename(root / other)
        return f"rename {f.name} -> {other}"
    if kind == "delete":
        f.unlink()
        return f"delete {f.name}"
    if kind == "symlink-out":
        shutil.copy(f, outside / f.name)
        f.unlink()
        f.symlink_to(outside / f.name)
        return f"symlink-out {f.name}"
    shards = [p for p in files if p.suffix == ".safetensors"]
    s = draw(st.sampled_from(shards))
    names = [n for n in dmg.read_header(s)[1] if n != "__metadata__"]
    if len(names) < 2:
        return "nothing (one tensor)"
    a, b = draw(st.lists(st.sampled_from(names), min_size=2, max_size=2, unique=True))
    dmg.swap_offsets(s, a, b)
    return f"swap {s.name} {a} <-> {b}"


# ---- loads and their classes ---------------------------------------------------------------
def classify_checkpoint(path: Path, what: str) -> tuple[str, str]:
    rows = DeviceGroup.cpu(2).run(lambda c: _one_checkpoint(c, path))
    kinds = {k for k, _ in rows}
    if "untyped" in kinds:
        return "untyped", str(rows)
    if len({d for _, d in rows}) > 1 or len(kinds) > 1:
        return "split", str(rows)
    kind, detail = rows[0]
    if kind != "loaded":
        return kind, detail
    # a consistent hand edit of the index (resealed) may change plain values and steps
    exact = json.loads(detail) == [{"version": 1}, 4] or "resealed" in what
    return ("exact" if exact else "wrong"), detail


def _one_checkpoint(comm: Any, path: Path) -> tuple[str, str]:
    mesh, net, opt = cp.build(comm, 2)
    cp.fill(net, opt, 7)
    try:
        values = checkpoint.load(path, {"model": net, "optim": opt}, mesh=mesh)
    except FuelError as e:
        try:
            cp.check(net, opt, 7)
        except AssertionError:
            return "partial", f"{type(e).__name__}: {e}"
        return "refused", f"{type(e).__name__}: {e}"
    except Exception as e:  # what the fuzzer looks for
        return "untyped", f"{type(e).__name__}: {e}"
    steps, opt.steps = opt.steps, 4
    try:
        cp.check(net, opt, 1)  # every tensor as saved
    except AssertionError as e:
        return "wrong-tensors", str(e)[:300]
    return "loaded", json.dumps([values, steps])


def classify_hf(path: Path, ref: dict[str, np.ndarray]) -> tuple[str, str]:
    def one(comm: Any) -> tuple[str, str]:
        try:
            model = models.from_pretrained(path, comm=comm, dtype="float32")
        except FuelError as e:
            return "refused", f"{type(e).__name__}: {e}"
        except Exception as e:
            return "untyped", f"{type(e).__name__}: {e}"
        for name, p in model.named_parameters():
            want = p.spec.shard(ref[name]) if name in ref else None
            if want is None or not np.array_equal(p.numpy(), want):
                return "wrong", f"{name} differs"
        return "exact", ""

    rows = DeviceGroup.cpu(2).run(one)
    kinds = {k for k, _ in rows}
    if "untyped" in kinds:
        return "untyped", str(rows)
    if len({d for _, d in rows}) > 1 or len(kinds) > 1:
        return "split", str(rows)
    return rows[0]


# ---- the fuzzer -----------------------------------------------------------------------------
def fuzz(saved: dict[str, Path], kind: str, examples: int) -> Counter[str]:
    """Run ``examples`` mutations of the ``kind`` directories; the outcome counts. Fails
    at the first bad outcome (hypothesis then shrinks it to the smallest damage)."""
    counts: Counter[str] = Counter()
    refs = {}
    if kind == "hf":
        for name in ("llama", "gpt2"):
            model = models.from_pretrained(saved[name], dtype="float32")
            refs[name] = {n: p.numpy() for n, p in model.named_parameters()}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def one(data: st.DataObject) -> None:
        base = saved["ck"] if kind == "ck" else saved[data.draw(st.sampled_from(
            ["llama", "gpt2"]))]
        work = Path(tempfile.mkdtemp(prefix="fuzz-"))
        try:
            where = work / base.name
            shutil.copytree(base, where, symlinks=True)
            (work / "outside").mkdir()
            what = mutate(data.draw, where, work / "outside")
            if kind == "ck":
                outcome, detail = classify_checkpoint(where, what)
                if outcome == "wrong-tensors":
                    outcome = "wrong"
            else:
                outcome, detail = classify_hf(where, refs[base.name])
            counts[outcome] += 1
            assert outcome not in BAD, f"{outcome} after {what}: {detail[:2000]}"
        finally:
            shutil.rmtree(work, ignore_errors=True)

    one()
    return counts


@pytest.mark.timeout(runs(300, 7200))
@pytest.mark.parametrize("kind", ["ck", "hf"])
def test_mutations_load_exactly_or_are_refused_untouched(saved: dict[str, Path],
                                                         kind: str) -> None:
    counts = fuzz(saved, kind, EXAMPLES)
    print(f"\nfuzz {kind}: {sum(counts.values())} mutations: {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= EXAMPLES
    assert not any(counts[b] for b in BAD), counts
